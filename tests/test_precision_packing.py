"""Packed code planes: bit layout vs a NumPy reference, and the bytes 2-bit storage saves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax.precision import quantize
from gnmr_jax.precision import saved_activation as sa
from test_precision_stress import _bf16, _qdq, _vjp, assert_bf16_product  # tests/ is on sys.path
from tests.tolerances import F32_EPS, assert_allclose


def _np_pack(values, bits):
  """Reference layout: element k in byte k // n at bit offset bits * (k % n), n = 8 // bits."""
  per_byte = 8 // bits
  size = values.shape[-1]
  packed = np.zeros(values.shape[:-1] + (-(-size // per_byte),), np.int64)
  for k in range(size):
    packed[..., k // per_byte] += values[..., k].astype(np.int64) << (bits * (k % per_byte))
  assert packed.max(initial=0) < 256
  return packed.astype(np.uint8)


def _every_value_at_every_position(bits, size):
  """uint8 [2^bits, size]: row r holds (r + k) mod 2^bits, so each field slot sees each value."""
  levels = 2**bits
  return ((np.arange(levels)[:, None] + np.arange(size)[None, :]) % levels).astype(np.uint8)


@pytest.mark.parametrize('bits', [2, 4])
@pytest.mark.parametrize('size', [1, 2, 3, 4, 5, 6, 7, 8, 9, 33])
def test_pack_bits_matches_numpy_layout_and_round_trips(bits, size):
  values = _every_value_at_every_position(bits, size)
  pack = jax.jit(quantize.pack_bits, static_argnums=1)
  unpack = jax.jit(quantize.unpack_bits, static_argnums=(1, 2))
  packed = pack(jnp.asarray(values), bits)
  assert packed.dtype == jnp.uint8 and packed.shape == (2**bits, -(-size * bits // 8))
  np.testing.assert_array_equal(packed, _np_pack(values, bits))
  unpacked = unpack(packed, bits, size)
  assert unpacked.dtype == jnp.uint8
  np.testing.assert_array_equal(unpacked, values)


def test_pack_bits_golden_bytes():
  two_bit = quantize.pack_bits(jnp.asarray([1, 2, 3, 0, 3], jnp.uint8), 2)
  np.testing.assert_array_equal(two_bit, [1 | 2 << 2 | 3 << 4, 3])  # low field first, zero pad
  nibble = quantize.pack_bits(jnp.asarray([1, 2, 15], jnp.uint8), 4)
  np.testing.assert_array_equal(nibble, [0x21, 0x0F])


@pytest.mark.parametrize('size', [7, 8])
def test_pack_nibbles_is_pack_bits_4(size):
  values = jnp.asarray(_every_value_at_every_position(4, size))
  packed = quantize.pack_nibbles(values)
  np.testing.assert_array_equal(packed, quantize.pack_bits(values, 4))
  np.testing.assert_array_equal(quantize.unpack_nibbles(packed, size), values)


def test_pack_bits_rejects_widths_that_do_not_tile_a_byte_and_oversized_unpacks():
  with pytest.raises(ValueError, match=r'\(1, 2, 4, 8\), got 3'):
    quantize.pack_bits(jnp.zeros((4,), jnp.uint8), 3)
  with pytest.raises(ValueError, match='size 9'):
    quantize.unpack_bits(jnp.zeros((2,), jnp.uint8), 2, 9)


@pytest.mark.parametrize('bits', range(2, 9))
@pytest.mark.parametrize('size', [13, 16])
def test_code_planes_round_trip_with_offset_binary_layout(bits, size):
  max_code = 2 ** (bits - 1) - 1
  rng = np.random.default_rng(bits)
  codes = rng.integers(-max_code, max_code + 1, (64, size))
  codes[0, :3] = (-max_code, 0, max_code)  # the full range, whatever the draw
  planes = jax.jit(quantize.codes_to_planes, static_argnums=1)(jnp.asarray(codes), bits)
  offset = codes + 2 ** (bits - 1)
  if bits <= 2:
    want = [_np_pack(offset, 2)]
  else:
    want = [_np_pack((offset >> (4 * p)) & 15, 4) for p in range(-(-bits // 4))]
  assert len(planes) == len(want)
  for plane, want_plane in zip(planes, want):
    assert plane.dtype == jnp.uint8
    np.testing.assert_array_equal(plane, want_plane)
  got = jax.jit(quantize.planes_to_codes, static_argnums=(1, 2))(planes, bits, size)
  np.testing.assert_array_equal(got, codes)


def test_two_bit_planes_are_half_the_four_bit_planes():
  x = jnp.ones((5, 37))
  planes2, _ = sa.quantize_activation(x, 2)
  planes4, _ = sa.quantize_activation(x, 4)
  assert [p.shape for p in planes2] == [(5, 10)] and [p.shape for p in planes4] == [(5, 19)]


@pytest.mark.parametrize('scale', ['token', 'tensor'])
def test_two_bit_path_matches_float64_quantize_dequantize(scale):
  # K = 37 is no multiple of 4: the last byte of every row is padded.
  rng = np.random.default_rng(7)
  x = rng.standard_normal((24, 37))
  x[5] *= 10.0
  w = rng.standard_normal((37, 16)) / np.sqrt(37)
  g = rng.standard_normal((24, 16))
  x_hat = _qdq(np.asarray(np.float32(x), np.float64), 2, scale == 'tensor')
  planes, x_scale = sa.quantize_activation(jnp.asarray(x, jnp.float32), 2, scale=scale)
  # Same codes; the float32 scale absmax / max_code rounds once (twice where XLA
  # multiplies by a rounded reciprocal) and code * scale once more: <= 3u relative.
  assert_allclose(sa.dequantize_activation(planes, x_scale, 2, 37), x_hat,
                  rtol=1.5 * F32_EPS)
  y, dx, dw = _vjp(sa.make_saved_activation_dot(2, scale=scale), x, w, g)
  # bf16 operands, float32 accumulation: gamma_K of the terms (test_precision_stress).
  assert_bf16_product(y, _bf16(x), _bf16(w))
  assert_bf16_product(dx, _bf16(g), _bf16(w).T)
  assert_bf16_product(dw, _bf16(x_hat).T, _bf16(g))


TOKENS = 256


def _residual_bytes_per_token(bits, tokens=TOKENS, width=512, out=128):
  """Slope of the compiled vjp forward's output (its residuals) between T and 2T tokens."""
  dot = sa.make_saved_activation_dot(bits)
  forward = jax.jit(lambda x, w: jax.vjp(dot, x, w)[1])

  def residual_bytes(t):
    x = jax.ShapeDtypeStruct((t, width), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((width, out), jnp.float32)
    return forward.lower(x, w).compile().memory_analysis().output_size_in_bytes

  return (residual_bytes(2 * tokens) - residual_bytes(tokens)) / tokens


def test_two_bit_residuals_are_about_half_the_four_bit_residuals():
  width = 512
  two, four = _residual_bytes_per_token(2, width=width), _residual_bytes_per_token(4, width=width)
  # Codes plus the float32 per-token scale: K/4 + 4 and K/2 + 4 bytes per token. The
  # slope over T tokens cancels fixed bytes; XLA:CPU's 64-byte alignment of the two
  # token-sized residuals (plane, scale) can add <= 2 * 64 / T bytes per token.
  np.testing.assert_allclose((two, four), (width / 4 + 4, width / 2 + 4), rtol=0,
                             atol=2 * 64 / TOKENS)
  assert two <= 0.55 * four, (two, four)
