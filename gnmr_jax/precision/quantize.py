"""Quantization primitives shared by the precision paths.

Symmetric absmax quantization, scaled low-precision matmuls whose operands go
into ``lax.dot_general`` in their storage dtype (int8 or fp8), and the packed
2-bit and 4-bit code planes used to store saved activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import explicit_sharding

# Contracts lhs axis 1 with rhs axis 0, no batch axes: [M, C] x [C, N] -> [M, N].
MATMUL_DIMS = (((1,), (0,)), ((), ()))

# Largest finite magnitude of each quantized storage dtype.
MAX_VALUE = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),
}


def absmax_scale(x: jax.Array, axis, max_value: float) -> jax.Array:
  r"""Per-slice absmax scale :math:`s = \max|x| / q_{max}` (1 where the slice is 0).

  Args:
    x: array to quantize.
    axis: axis or axes reduced to one scale (kept as size-1 axes).
    max_value: largest representable code magnitude :math:`q_{max}`.

  Returns:
    float32 scale, broadcastable against ``x``.
  """
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
  return jnp.where(amax > 0, amax / max_value, 1.0)


def quantize(x: jax.Array, axis, dtype) -> tuple[jax.Array, jax.Array]:
  r"""Symmetric absmax quantization to ``dtype`` (int8, float8_e4m3fn or float8_e5m2).

  :math:`q = \mathrm{clip}(\mathrm{round}(x / s), -q_{max}, q_{max})`, rounding to
  the nearest integer for int8 and to the nearest fp8 value (ties to even) for fp8.

  Args:
    x: array to quantize.
    axis: axes sharing one scale (the contraction axis of a matmul operand).
    dtype: storage dtype.

  Returns:
    ``(q, scale)`` with ``x ~= q * scale``; ``scale`` is float32 with ``axis`` kept.
  """
  max_value = MAX_VALUE[jnp.dtype(dtype)]
  scale = absmax_scale(x, axis, max_value)
  y = jnp.clip(x.astype(jnp.float32) / scale, -max_value, max_value)
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.round(y)
  return y.astype(dtype), scale


def scaled_matmul(lhs: jax.Array, rhs: jax.Array, lhs_dtype, rhs_dtype,
                  out_dtype, out_sharding=None) -> jax.Array:
  r"""Quantized 2-D matmul :math:`(q_a s_a)(q_b s_b)` with per-row/per-column scales.

  ``lhs`` [M, C] gets one scale per row and ``rhs`` [C, N] one per column, so the
  scales factor out of the contraction:
  :math:`y_{mn} = s_{a,m}\, s_{b,n} \sum_c q_{a,mc}\, q_{b,cn}`.
  The quantized arrays go into ``lax.dot_general`` as int8/fp8 operands (int32
  accumulation for int8, float32 for fp8), which is what lets XLA emit an
  int8/fp8 GEMM on GPU and TPU.

  Args:
    lhs: [M, C] float array.
    rhs: [C, N] float array.
    lhs_dtype: storage dtype of ``lhs`` codes.
    rhs_dtype: storage dtype of ``rhs`` codes.
    out_dtype: dtype of the result.
    out_sharding: sharding of the result under an explicit-axis mesh (needed
      when the contraction axis is sharded, as in a weight gradient), else None.

  Returns:
    [M, N] array of ``out_dtype``.
  """
  q_lhs, s_lhs = quantize(lhs, 1, lhs_dtype)
  q_rhs, s_rhs = quantize(rhs, 0, rhs_dtype)
  is_int = jnp.issubdtype(lhs_dtype, jnp.integer)
  acc = lax.dot_general(q_lhs, q_rhs, MATMUL_DIMS,
                        preferred_element_type=jnp.int32 if is_int else jnp.float32,
                        **explicit_sharding.dot_kwargs(out_sharding))
  if out_sharding is not None:
    # The per-row / per-column scales get the result's row / column sharding, so
    # the rescale never meets two shardings of one axis (a kernel sharded on K).
    s_lhs = explicit_sharding.along_axis(s_lhs, out_sharding, 0)
    s_rhs = explicit_sharding.along_axis(s_rhs, out_sharding, 1)
  return (acc.astype(jnp.float32) * s_lhs * s_rhs).astype(out_dtype)


def bf16_matmul(lhs: jax.Array, rhs: jax.Array, out_dtype, out_sharding=None
                ) -> jax.Array:
  """[M, C] x [C, N] with bfloat16 operands and float32 accumulation.

  A bfloat16 result is asked of the GEMM itself (it accumulates in float32 and rounds once,
  as the float32 result cast afterwards would): the GPU's cuBLASLt call and the TPU's MXU
  write bf16, with no float32 [M, N] buffer and no cast pass over it.
  ``out_sharding``: the result's sharding under an explicit-axis mesh, else None.
  """
  result = jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32
  acc = lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16),
                        MATMUL_DIMS, preferred_element_type=result,
                        **explicit_sharding.dot_kwargs(out_sharding))
  return acc.astype(out_dtype)


# --- packed code planes --------------------------------------------------------
# A k-bit code c in [-(2^(k-1)-1), 2^(k-1)-1] is stored offset-binary, u = c + 2^(k-1),
# split into fields of f bits (f = 2 for k <= 2, else f = 4), one packed plane per
# field: k <= 2 is one plane of 2-bit fields, uint8[..., ceil(K/4)]; 3 <= k <= 4 one
# nibble plane and 5 <= k <= 8 two nibble planes, uint8[..., ceil(K/2)] each. Every
# plane packs 8/f neighbouring elements of the last axis per byte, lowest field in
# the low bits. Widths 3..8 share the nibble-plane shape, so lax.cond merges the
# residuals of a 4-bit and an 8-bit branch instead of storing both (see
# saved_activation.py); a 2-bit plane has its own, smaller shape.

# Field widths that tile a byte exactly.
PACK_BITS = (1, 2, 4, 8)


def _fields_per_byte(bits: int) -> int:
  if bits not in PACK_BITS:
    raise ValueError(f'packed field bits must be one of {PACK_BITS}, got {bits!r}.')
  return 8 // bits


def pack_bits(values: jax.Array, bits: int) -> jax.Array:
  r"""Packs uint8 values < 2^bits along the last axis, 8/bits per byte.

  Element :math:`k` goes to byte :math:`\lfloor k/n \rfloor`, bits
  :math:`[b\,(k \bmod n), b\,(k \bmod n + 1))`, with :math:`n = 8/b`; the last
  axis is zero-padded to a multiple of :math:`n`. ``bits=4`` is ``pack_nibbles``.

  Args:
    values: uint8 [..., K], each value < ``2**bits`` (not masked).
    bits: field width, one of 1, 2, 4, 8.

  Returns:
    uint8 [..., ceil(K * bits / 8)].
  """
  per_byte = _fields_per_byte(bits)
  pad = -values.shape[-1] % per_byte
  if pad:
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, pad)])
  groups = values.reshape(values.shape[:-1] + (-1, per_byte))
  packed = groups[..., 0]
  for i in range(1, per_byte):
    packed = packed | (groups[..., i] << (bits * i))
  return packed


def unpack_bits(packed: jax.Array, bits: int, size: int) -> jax.Array:
  """Inverse of ``pack_bits``: uint8 [..., ceil(size * bits / 8)] -> uint8 [..., size].

  Args:
    packed: uint8 array from ``pack_bits``.
    bits: the field width it was packed with.
    size: length of the unpacked last axis (drops the padding).

  Returns:
    uint8 [..., size], each value < ``2**bits``.
  """
  per_byte = _fields_per_byte(bits)
  if not 0 <= size <= packed.shape[-1] * per_byte:
    raise ValueError(f'size {size} does not fit {packed.shape[-1]} bytes of '
                     f'{bits}-bit fields.')
  mask = (1 << bits) - 1
  fields = jnp.stack([(packed >> (bits * i)) & mask for i in range(per_byte)], axis=-1)
  return fields.reshape(packed.shape[:-1] + (-1,))[..., :size]


def pack_nibbles(nibbles: jax.Array) -> jax.Array:
  """Packs uint8 values < 16 pairwise along the last axis: [..., K] -> [..., ceil(K/2)]."""
  return pack_bits(nibbles, 4)


def unpack_nibbles(packed: jax.Array, size: int) -> jax.Array:
  """Inverse of ``pack_nibbles``: [..., ceil(K/2)] uint8 -> [..., size] uint8."""
  return unpack_bits(packed, 4, size)


def _field_bits(bits: int) -> int:
  """Field width of the planes of ``bits``-bit codes (2 for bits <= 2, else 4)."""
  if not 1 <= bits <= 8:
    raise ValueError(f'code bits must be in 1..8, got {bits!r}.')
  return 2 if bits <= 2 else 4


def codes_to_planes(codes: jax.Array, bits: int) -> tuple[jax.Array, ...]:
  """Stores signed ``bits``-bit integer codes as packed offset-binary planes.

  Args:
    codes: integer [..., K], each in [-(2^(bits-1)-1), 2^(bits-1)-1].
    bits: code width, 1..8.

  Returns:
    One uint8[..., ceil(K/4)] plane of 2-bit fields for bits <= 2; else
    ceil(bits/4) uint8[..., ceil(K/2)] nibble planes, low nibble first.
  """
  field_bits = _field_bits(bits)
  offset = (codes.astype(jnp.int32) + (1 << (bits - 1))).astype(jnp.uint32)
  num_planes = -(-bits // field_bits)
  field_mask = (1 << field_bits) - 1
  return tuple(
      pack_bits(((offset >> (field_bits * p)) & field_mask).astype(jnp.uint8), field_bits)
      for p in range(num_planes))


def planes_to_codes(planes: tuple[jax.Array, ...], bits: int, size: int) -> jax.Array:
  """Inverse of ``codes_to_planes``: int32 codes of the last-axis ``size``."""
  field_bits = _field_bits(bits)
  offset = jnp.zeros(planes[0].shape[:-1] + (size,), jnp.int32)
  for p, plane in enumerate(planes):
    offset = offset | (unpack_bits(plane, field_bits, size).astype(jnp.int32)
                       << (field_bits * p))
  return offset - (1 << (bits - 1))
