"""Numerics of each precision path against float64 NumPy references."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gnmr_jax.precision import bf16, blockwise, fp8, int8, quantize
from gnmr_jax.precision import saved_activation as sa
from test_precision_stress import _bf16  # tests/ is on sys.path under pytest
from tests.tolerances import F32_EPS, assert_allclose, matmul_atol

M, K, N = 96, 256, 160


def _rel(a, b):
  a = np.asarray(a, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _inputs(seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K))
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  g = rng.standard_normal((M, N))
  return x, w, g


def _bf16_reorder_atols(seed):
  """How far _errors of two programs of the same bf16 products (y, dx, dW) may differ.

  Two float32 orders of a bf16 product's sum differ by <= 2 gamma_K of its terms
  (tests/tolerances.py), which moves a norm-wise relative error by at most the
  norm of that bound over the norm of the exact product.
  """
  x, w, g = _inputs(seed)
  operands = ((_bf16(x), _bf16(w), x @ w), (_bf16(g), _bf16(w).T, g @ w.T),
              (_bf16(x).T, _bf16(g), x.T @ g))
  return [np.linalg.norm(matmul_atol(a, b, programs=2)) / np.linalg.norm(exact)
          for a, b, exact in operands]


def _errors(dot, seed):
  """Relative errors of y, dx, dW against float64 on fresh random inputs."""
  x, w, g = _inputs(seed)
  fn = jax.jit(lambda x, w, g: (lambda y, vjp: (y,) + vjp(g))(*jax.vjp(dot, x, w)))
  y, dx, dw = fn(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                 jnp.asarray(g, jnp.float32))
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32
  return _rel(y, x @ w), _rel(dx, g @ w.T), _rel(dw, x.T @ g)


# (dot, upper bounds on the relative error of y, dx, dW). bf16 rounds each operand
# to 8 significant bits (~2.3e-3 here); int8 per-channel ~1e-2; fp8 e4m3 (4
# significant bits) ~4e-2, e5m2 gradients (3 bits) ~6e-2.
PATHS = {
    'bf16': (bf16.bf16_dot, (4e-3, 4e-3, 4e-3)),
    'int8': (int8.int8_dot, (1.5e-2, 1.5e-2, 1.5e-2)),
    'fp8': (fp8.fp8_dot, (5e-2, 8e-2, 8e-2)),
    'blockwise8': (blockwise.make_blockwise_dot(8), (1.8e-2, 1.8e-2, 1.8e-2)),
    'blockwise6': (blockwise.make_blockwise_dot(6), (7e-2, 7e-2, 7e-2)),
}


@pytest.mark.parametrize('name', sorted(PATHS))
def test_path_matches_float64_within_format_bound(name):
  dot, bounds = PATHS[name]
  errors = _errors(dot, seed=1)
  for err, bound in zip(errors, bounds):
    assert err < bound, (name, errors)
  if name != 'bf16':  # The quantization really happens: coarser than bf16.
    bf16_errors = _errors(bf16.bf16_dot, seed=1)
    assert all(e > 2 * b for e, b in zip(errors, bf16_errors)), (errors, bf16_errors)


def test_blockwise_6_bits_is_coarser_than_8():
  e6, e8 = _errors(blockwise.make_blockwise_dot(6), 2), _errors(blockwise.make_blockwise_dot(8), 2)
  assert all(a > 2.5 * b for a, b in zip(e6, e8)), (e6, e8)


def test_saved_activation_only_touches_weight_gradient():
  bf16_err = _errors(bf16.bf16_dot, seed=3)
  # The same bf16 products in another program: their float32 sums may be reordered.
  atols = _bf16_reorder_atols(seed=3)
  dw_err = {}
  for bits in (2, 4, 8, 16):
    y_err, dx_err, dw_err[bits] = _errors(sa.make_saved_activation_dot(bits), seed=3)
    assert_allclose((y_err, dx_err), bf16_err[:2], atol=np.asarray(atols[:2]))
  # Per-token absmax, round to nearest: error ~ 1/(2^(b-1)-1) relative to absmax.
  assert 0.5 < dw_err[2] < 1.0
  assert 0.08 < dw_err[4] < 0.2
  assert 4e-3 < dw_err[8] < 1.2e-2
  # bf16 storage is bit-exact, so dW is again the bf16 product, up to the sum's order.
  assert_allclose(dw_err[16], bf16_err[2], atol=atols[2])


def test_stochastic_rounding_is_unbiased_and_bracketed():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
  bits = 4
  planes, scale = sa.quantize_activation(x, bits, stochastic_rounding=True)
  x_hat = np.asarray(sa.dequantize_activation(planes, scale, bits, 512))
  y = np.asarray(x) / np.asarray(scale)
  codes = x_hat / np.asarray(scale)
  # x_hat = code * scale rounds once in float32: codes come back within max_code * u.
  slack = (2 ** (bits - 1) - 1) * F32_EPS
  assert np.all((codes >= np.floor(y) - slack) & (codes <= np.ceil(y) + slack))
  # Unbiased: each element's error has mean 0 and variance <= scale^2 / 4, so the mean
  # of N errors is within 3 standard errors, 3 sqrt(mean(scale^2) / 4 / N), of 0; and
  # the noise itself is a fraction of a step (scale ~ 0.5 here), far above 0.02.
  err = x_hat - np.asarray(x)
  assert abs(err.mean()) < 3 * np.sqrt(np.mean(np.asarray(scale) ** 2) / 4 / err.size)
  assert err.std() > 0.02
  rtn = np.asarray(sa.dequantize_activation(*sa.quantize_activation(x, bits), bits, 512))
  # Stochastic rounding takes the other neighbouring code for a share E[min(f, 1 - f)]
  # = 1/4 of uniformly placed elements: whole steps apart, not rounding.
  assert np.mean(rtn != x_hat) > 0.1


@settings(max_examples=10, deadline=None, derandomize=True)
@given(bits=st.integers(2, 8), rows=st.integers(1, 5), cols=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_nibble_planes_round_trip(bits, rows, cols, seed):
  max_code = 2 ** (bits - 1) - 1
  codes = np.random.default_rng(seed).integers(-max_code, max_code + 1, (rows, cols))
  planes = quantize.codes_to_planes(jnp.asarray(codes), bits)
  assert len(planes) == -(-bits // 4)
  width = (cols + 3) // 4 if bits <= 2 else (cols + 1) // 2  # 2-bit fields, else nibbles
  for plane in planes:
    assert plane.dtype == jnp.uint8 and plane.shape == (rows, width)
  np.testing.assert_array_equal(quantize.planes_to_codes(planes, bits, cols), codes)


def test_bf16_storage_is_bit_exact():
  x = jax.random.normal(jax.random.key(5), (7, 33), jnp.bfloat16)
  planes, scale = sa.quantize_activation(x, sa.BF16_BITS)
  assert len(planes) == 4
  np.testing.assert_array_equal(
      sa.dequantize_activation(planes, scale, sa.BF16_BITS, 33), x.astype(jnp.float32))


def test_blockwise_tiles_and_blocks_have_their_own_scale():
  # One huge value must only coarsen its own 1x128 tile / 128x128 block.
  x = np.ones((2, 256), np.float32) * 0.3
  x[0, 0] = 1000.0
  xq = np.asarray(blockwise.qdq_tiles(jnp.asarray(x), 8, 128))
  # A tile at its own scale (absmax 0.3) is within half a step, 0.3 / 127 / 2, plus the
  # float32 roundings of scale and product; the outlier's scale would round 0.3 to 0.
  own_scale = 0.5 / 127 + 3 * F32_EPS / 2
  np.testing.assert_allclose(xq[0, 128:], 0.3, rtol=own_scale)
  np.testing.assert_allclose(xq[1], 0.3, rtol=own_scale)
  assert np.all(xq[0, 1:128] == 0.0)  # 0.3 rounds to 0 at scale 1000/127.
  w = np.full((256, 256), 0.3, np.float32)
  w[0, 0] = 1000.0
  wq = np.asarray(blockwise.qdq_blocks(jnp.asarray(w), 8, 128))
  assert np.all(wq[1:128, 1:128] == 0.0)
  np.testing.assert_allclose(wq[128:, :], 0.3, rtol=own_scale)
  np.testing.assert_allclose(wq[:128, 128:], 0.3, rtol=own_scale)


def _dot_general_dtypes(fn, *args):
  """(lhs dtype, rhs dtype, preferred_element_type) of every dot_general in fn's jaxpr."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        found.append((eqn.invars[0].aval.dtype, eqn.invars[1].aval.dtype,
                      eqn.params['preferred_element_type']))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _fwd_bwd(dot):
  def fn(x, w, g):
    y, vjp = jax.vjp(dot, x, w)
    return y, vjp(g)
  return fn, (jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((8, 4)))


def test_int8_legs_feed_int8_operands_with_int32_accumulation():
  fn, args = _fwd_bwd(int8.int8_dot)
  i8 = jnp.dtype(jnp.int8)
  assert _dot_general_dtypes(fn, *args) == [(i8, i8, jnp.dtype(jnp.int32))] * 3


def test_fp8_legs_feed_fp8_operands():
  fn, args = _fwd_bwd(fp8.fp8_dot)
  e4, e5, f32 = (jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32))
  # forward e4m3 x e4m3; dlhs e5m2 grad x e4m3 weight; drhs e4m3 act x e5m2 grad.
  assert _dot_general_dtypes(fn, *args) == [(e4, e4, f32), (e5, e4, f32), (e4, e5, f32)]


def test_bf16_legs_feed_bf16_operands_with_f32_accumulation():
  fn, args = _fwd_bwd(bf16.bf16_dot)
  b, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  assert _dot_general_dtypes(fn, *args) == [(b, b, f32)] * 3
