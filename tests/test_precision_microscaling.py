"""NVFP4 and MXFP8 (precision/microscaling.py, nvfp4.py, mxfp8.py) against a NumPy reference.

The reference below is written from the formats' definitions with explicit grids
(E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6}, the 126 finite positive E4M3 values listed
from their codes, E8M0 = powers of two found by an exact search) and rounds to
them by nearest-neighbour search in float64, ties to the even code. Where the
format defines a quantity in float32 (the NVFP4 tensor scale, its reciprocal
times 6, a block's encode scale and the scaled element, as the module docstring
spells out), the reference computes that one operation in NumPy float32, which
rounds like XLA's float32. The quantized values must then match bit for bit.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from gnmr_jax import precision
from gnmr_jax.precision import bf16, microscaling as ms, mxfp8, nvfp4, testing
from gnmr_jax.precision.path import path_dot

F32 = np.float32

# --- the NumPy reference ---------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
# E4M3 (fn) codes 0..126: exponent field e = code // 8, mantissa m = code % 8; e = 0 is
# subnormal (m/8 * 2^-6); code 127 (e = 15, m = 7) is NaN, so 448 = 1.75 * 2^8 is the max.
E4M3 = np.array([(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0**(e - 7)
                 for e in range(16) for m in range(8)][:127], np.float64)


def nearest_even(a, grid):
  """|a| (float64, <= grid[-1]) rounded to the nearest grid value, ties to an even index."""
  a = np.asarray(a, np.float64)
  hi_index = np.clip(np.searchsorted(grid, a, side='left'), 1, len(grid) - 1)
  lo, hi = grid[hi_index - 1], grid[hi_index]
  d_lo, d_hi = a - lo, hi - a  # exact: few-bit grid values against float32 inputs
  pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi_index % 2 == 0))
  return np.where(a <= lo, lo, np.where(pick_hi, hi, lo))


def blocked(x, axis, block):
  """x [R, C] float32 -> [..., block] with the blocks of ``axis`` last, zero-padded."""
  x = np.asarray(x, np.float32)
  if axis == 0:
    x = x.T
  pad = -x.shape[1] % block
  x = np.pad(x, ((0, 0), (0, pad)))
  return x.reshape(x.shape[0], -1, block)


def unblocked(xb, axis, shape):
  x = xb.reshape(xb.shape[0], -1)
  x = x[:, :shape[axis]]
  return x.T if axis == 0 else x


def ref_nvfp4(x, axis, uniform=None):
  """(x_hat float32, block scales [R, nb], tensor scale, y = scaled elements, codes)."""
  xb = blocked(x, axis, 16)
  block_amax = np.max(np.abs(xb), axis=-1)
  tensor_amax = F32(np.max(block_amax))
  tensor_scale = F32(1) if tensor_amax == 0 else tensor_amax * F32(1 / 2688)
  raw = block_amax.astype(F32) * (F32(1) / (tensor_scale * F32(6)))
  block_scale = nearest_even(np.clip(raw, 0, 448), E4M3)
  divisor = block_scale.astype(F32) * tensor_scale
  with np.errstate(divide='ignore'):
    encode = np.where(divisor == 0, F32(0), F32(1) / divisor).astype(F32)
  y = (xb * encode[..., None]).astype(F32)
  magnitude = np.minimum(np.abs(y), 6).astype(np.float64)
  if uniform is None:
    codes = nearest_even(magnitude, E2M1)
  else:  # floor(t) + [u < frac(t)] steps of the interval's spacing h
    step = np.where(magnitude < 2, 0.5, np.where(magnitude < 4, 1.0, 2.0))
    t = magnitude / step
    codes = (np.floor(t) + (uniform < t - np.floor(t))) * step
  codes = np.copysign(codes, y)
  x_hat = (codes * block_scale[..., None] * np.float64(tensor_scale)).astype(F32)
  return unblocked(x_hat, axis, np.shape(x)), block_scale, tensor_scale, y, codes


def e8m0_up(amax):
  """Smallest e with 448 * 2^e >= amax (exact), clamped to [-126, 127]."""
  out = []
  for a in np.asarray(amax, np.float64).reshape(-1):
    e = -126
    while 448 * 2.0**e < a and e < 127:
      e += 1
    out.append(e)
  return np.array(out, np.float64).reshape(np.shape(amax))


def ref_mxfp8(x, axis):
  """(x_hat float32, block scales)."""
  xb = blocked(x, axis, 32).astype(np.float64)
  scale = 2.0 ** e8m0_up(np.max(np.abs(xb), axis=-1))
  codes = np.copysign(nearest_even(np.abs(xb) / scale[..., None], E4M3), xb)
  x_hat = (codes * scale[..., None]).astype(F32)
  return unblocked(x_hat, axis, np.shape(x)), scale


# --- inputs, normal and adversarial -------------------------------------------------------


def _ties(shape, grid_midpoints, block, top):
  """Blocks whose maximum makes an exact power-of-two scale 2^k, the rest exact midpoints
  of the code grid times 2^k; the first element sets an NVFP4 tensor scale of 1."""
  rng = np.random.default_rng(7)
  x = np.zeros(shape, F32)
  for r in range(shape[0]):
    for b in range(shape[1] // block):
      k = int(rng.integers(-3, 4))
      row = rng.choice(grid_midpoints, block) * rng.choice([-1, 1], block)
      row[0] = top
      x[r, b * block:(b + 1) * block] = row * 2.0**k
  x[0, 0] = 2688.0 if block == 16 else x[0, 0]
  return x


def inputs(kind, block):
  rng = np.random.default_rng(KINDS.index(kind))
  if kind == 'normal':
    return rng.standard_normal((48, 96)).astype(F32)
  if kind == 'heavy_tailed':  # ~20 binades inside a block: scales and codes underflow
    return (rng.standard_normal((40, 64)) * np.exp(3 * rng.standard_normal((40, 64)))).astype(F32)
  if kind == 'tiny_1e-4':
    return (1e-4 * rng.standard_normal((32, 64))).astype(F32)
  if kind == 'tiny_1e-30':
    return (1e-30 * rng.standard_normal((32, 64))).astype(F32)
  if kind == 'zero_blocks':
    x = rng.standard_normal((32, 64)).astype(F32)
    x[:, :32] = 0  # the first two NVFP4 blocks / first MXFP8 block of every row
    x[5] = 0
    return x
  if kind == 'outlier_per_block':
    x = rng.standard_normal((32, 128)).astype(F32)
    x[:, ::block] = 1e4
    return x
  if kind == 'ties':
    if block == 16:
      return _ties((16, 64), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], 16, 6.0)
    mids = np.array([1.0625, 1.1875, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 304.0, 2.0**-6 + 2.0**-10])
    return _ties((16, 64), mids, 32, 448.0)
  if kind == 'not_divisible':  # 37 and 45: neither a multiple of 16 nor of 32
    return rng.standard_normal((37, 45)).astype(F32)
  raise ValueError(kind)


KINDS = ('normal', 'heavy_tailed', 'tiny_1e-4', 'tiny_1e-30', 'zero_blocks',
         'outlier_per_block', 'ties', 'not_divisible')


def _f32(a):
  return np.asarray(a, np.float32)


@pytest.mark.parametrize('axis', [0, 1])
@pytest.mark.parametrize('kind', KINDS)
def test_nvfp4_matches_numpy_reference_bit_for_bit(kind, axis):
  x = inputs(kind, 16)
  x = x.T.copy() if axis == 0 else x  # blocks run along the contracting axis either way
  want, want_block, want_tensor, y, _ = ref_nvfp4(x, axis)
  got = _f32(jax.jit(ms.nvfp4_dequantized, static_argnums=1)(x, axis))
  np.testing.assert_array_equal(got, want)
  block_scale, tensor_scale = ms.nvfp4_scales(x, axis)
  np.testing.assert_array_equal(_f32(block_scale).T if axis == 0 else _f32(block_scale),
                                want_block)
  assert float(tensor_scale) == float(want_tensor)
  assert np.all(np.isfinite(got))
  if kind in ('zero_blocks', 'ties'):  # not everything rounds to 0
    assert np.count_nonzero(got) > got.size // 3
  if kind == 'ties':  # exact midpoints of the E2M1 grid really occur, and go to even codes
    assert np.sum(np.isin(np.abs(y), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])) > y.size // 2
  if kind == 'outlier_per_block':  # the outliers keep their value; their blocks' rest is 0
    outliers = got[::16] if axis == 0 else got[:, ::16]
    np.testing.assert_allclose(outliers, 1e4, rtol=2**-5)


@pytest.mark.parametrize('axis', [0, 1])
@pytest.mark.parametrize('kind', KINDS)
def test_mxfp8_matches_numpy_reference_bit_for_bit(kind, axis):
  x = inputs(kind, 32)
  x = x.T.copy() if axis == 0 else x
  want, want_scale = ref_mxfp8(x, axis)
  got = _f32(jax.jit(ms.mxfp8_dequantized, static_argnums=1)(x, axis))
  np.testing.assert_array_equal(got, want)
  if kind == 'ties':  # exact E4M3 midpoints occur: x / scale is one of the midpoints
    xb = blocked(x, axis, 32) / want_scale[..., None]
    assert np.sum(np.isin(np.abs(xb), [1.0625, 1.1875, 304.0])) > xb.size // 4
  scale = _f32(ms.mxfp8_scales(x, axis))
  np.testing.assert_array_equal(scale.T if axis == 0 else scale, want_scale)
  assert np.all(np.isfinite(got))


def test_reference_grids_and_ties_are_what_the_formats_say():
  """The reference itself: grid sizes and extremes, and ties going to the even code."""
  assert len(E4M3) == 127 and E4M3[-1] == 448 and E4M3[1] == 2.0**-9 and E4M3[8] == 2.0**-6
  np.testing.assert_array_equal(nearest_even([0.25, 0.75, 1.75, 2.5, 3.5, 5.0], E2M1),
                                [0, 1, 2, 2, 4, 4])
  np.testing.assert_array_equal(nearest_even([1.0625, 1.1875, 304.0], E4M3), [1, 1.25, 320])
  np.testing.assert_array_equal(e8m0_up([448.0, 448.5, 1.0, 0.0]), [0, 1, -8, -126])


# --- scales and block maxima ----------------------------------------------------------------


def test_mxfp8_scales_round_up_so_block_maxima_never_saturate():
  x = inputs('heavy_tailed', 32)
  amax = np.max(np.abs(blocked(x, 1, 32)), axis=-1).astype(np.float64)
  scale = _f32(ms.mxfp8_scales(x, 1)).astype(np.float64)
  exponent = np.log2(scale)
  np.testing.assert_array_equal(exponent, np.round(exponent))  # E8M0: powers of two
  assert np.all(448 * scale >= amax)        # rounded up: the maximum fits
  assert np.all(448 * scale / 2 < amax)     # and the smallest such power
  # The block maximum is rounded (to E4M3), never clipped to 448 * scale.
  x_hat = _f32(ms.mxfp8_dequantized(x, 1)).astype(np.float64)
  hat_max = np.max(np.abs(blocked(x_hat, 1, 32)), axis=-1)
  np.testing.assert_array_equal(hat_max, nearest_even(amax / scale, E4M3) * scale)


def test_nvfp4_scales_round_to_nearest_e4m3_and_global_scale_is_current():
  x = inputs('heavy_tailed', 16)
  block_scale, tensor_scale = ms.nvfp4_scales(x, 1)
  block_scale, tensor_scale = _f32(block_scale).astype(np.float64), float(tensor_scale)
  amax = float(np.max(np.abs(x)))
  # Current scaling: amax / (6 * 448), to within float32 rounding of the product.
  assert abs(tensor_scale - amax / 2688) <= 2 ** -23 * tensor_scale
  assert np.all(np.isin(block_scale, E4M3))
  wanted = np.max(np.abs(blocked(x, 1, 16)), axis=-1) / (6 * tensor_scale)
  # Nearest: within half the E4M3 spacing at the wanted scale (2^-10 below 2^-6).
  spacing = np.where(wanted < 2.0**-6, 2.0**-9, 2.0 ** (np.floor(np.log2(wanted)) - 3))
  assert np.all(np.abs(block_scale - wanted) <= spacing / 2 * (1 + 1e-6))
  assert block_scale.max() == 448  # the tensor's maximum block uses the whole range


# --- zeros, non-finite values, refusals -----------------------------------------------------


@pytest.mark.parametrize('dequantize', [
    lambda x: ms.nvfp4_dequantized(x, 1), lambda x: ms.nvfp4_dequantized(x, 0),
    lambda x: ms.nvfp4_dequantized(x, 1, 3),
    lambda x: ms.mxfp8_dequantized(x, 1), lambda x: ms.mxfp8_dequantized(x, 0)],
    ids=['nvfp4_axis1', 'nvfp4_axis0', 'nvfp4_stochastic', 'mxfp8_axis1', 'mxfp8_axis0'])
def test_all_zero_tensors_quantize_to_exact_zeros(dequantize):
  got = _f32(dequantize(jnp.zeros((20, 40))))
  assert not np.any(np.isnan(got))
  np.testing.assert_array_equal(got, 0)


def test_nonfinite_inputs_propagate():
  """A NaN or Inf never comes out finite. An Inf makes its NVFP4 tensor scale, hence the
  whole tensor, non-finite (its MXFP8 block, hence that block); a NaN does so where
  XLA's max propagates it (XLA:CPU's reduction may skip it), else only itself is NaN.
  Values outside the bad MXFP8 block are untouched."""
  x = inputs('normal', 16)
  for bad in (np.nan, np.inf, -np.inf):
    x_bad = x.copy()
    x_bad[3, 40] = bad
    for axis in (0, 1):
      got = _f32(ms.nvfp4_dequantized(x_bad, axis))
      assert not np.isfinite(got[3, 40])
      if np.isinf(bad):
        assert not np.any(np.isfinite(got))
      else:
        clean = _f32(ms.nvfp4_dequantized(x, axis))
        assert np.all((got == clean) | ~np.isfinite(got))
      got, clean = _f32(ms.mxfp8_dequantized(x_bad, axis)), _f32(ms.mxfp8_dequantized(x, axis))
      block = (slice(3, 4), slice(32, 64)) if axis == 1 else (slice(0, 32), slice(40, 41))
      assert not np.isfinite(got[3, 40])
      if np.isinf(bad):
        assert not np.any(np.isfinite(got[block]))
      outside = np.ones_like(got, bool)
      outside[block] = False
      np.testing.assert_array_equal(got[outside], clean[outside])
  # Through the paths' matmuls: the output is non-finite, as a bf16 matmul's would be.
  w = np.ones((96, 8), F32)
  for bad in (np.nan, np.inf):
    x_bad = x.copy()
    x_bad[0, 0] = bad
    for dot in (path_dot(nvfp4.nvfp4_path()), mxfp8.mxfp8_dot):
      assert not np.any(np.isfinite(_f32(dot(x_bad, w))[0]))


def test_quantizers_and_path_options_refuse_bad_arguments():
  with pytest.raises(ValueError, match='2-D operand'):
    ms.nvfp4_quantize(jnp.ones((2, 3, 16)), 1)
  with pytest.raises(ValueError, match='axis 0 or 1'):
    ms.mxfp8_quantize(jnp.ones((2, 32)), 2)
  with pytest.raises(ValueError, match="gradient_rounding must be one of \\('nearest', "
                                       "'stochastic'\\), got 'up'"):
    nvfp4.nvfp4_path(gradient_rounding='up')
  with pytest.raises(ValueError, match='forward_only must be a bool'):
    nvfp4.nvfp4_path(forward_only='yes')
  for field, value, allowed in [('nvfp4_gradient_rounding', 'up', "('nearest', 'stochastic')"),
                                ('nvfp4_forward_only', None, '(False, True)')]:
    config = precision.default_precision_config()
    config.low_cost_path = 'nvfp4'
    config[field] = value
    with pytest.raises(ValueError) as error:
      precision.make_policy(config)
    assert repr(field) in str(error.value) and allowed in str(error.value)


# --- stochastic rounding -------------------------------------------------------------------


def _uniform_like_blocks(x, axis, salt):
  """The quantizer's uniforms for ``x`` laid out like ``blocked(x, axis, 16)``."""
  seed = ms.block_scale_seed(ms.nvfp4_scales(x, axis)[0], salt)
  rows, cols = x.shape
  padded = -(x.shape[axis]) % 16 + x.shape[axis]
  shape = (rows, padded // 16, 16) if axis == 1 else (padded // 16, 16, cols)
  u = np.asarray(ms.hash_uniform(seed, shape), np.float64)
  if axis == 0:
    u = u.reshape(padded, cols).T
  return u.reshape(-1, padded // 16, 16)


@pytest.mark.parametrize('axis', [0, 1])
def test_nvfp4_stochastic_rounding_matches_reference_given_its_uniforms(axis):
  x = inputs('not_divisible', 16)
  want = ref_nvfp4(x, axis, uniform=_uniform_like_blocks(x, axis, 5))[0]
  got = _f32(jax.jit(ms.nvfp4_dequantized, static_argnums=(1, 2))(x, axis, 5))
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, ref_nvfp4(x, axis)[0])  # not round to nearest


def test_nvfp4_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not():
  """Errors in units of the local grid step h: each SR error is within one step with
  variance f(1 - f) <= 1/4, so the mean of n independent ones has SD <= 1/(2 sqrt(n)):
  allow 5 SD. Conditioned on a fraction f < 1/2, round to nearest errs by -f every
  time (mean ~ -1/4); stochastic rounding must stay unbiased there too."""
  rng = np.random.default_rng(11)
  sr_errors, rtn_errors, fractions = [], [], []
  for trial in range(12):
    x = rng.standard_normal((64, 256)).astype(F32)
    _, _, _, y, rtn_codes = ref_nvfp4(x, 1)
    block_scale = _f32(ms.nvfp4_scales(x, 1)[0]).astype(np.float64)
    values = _f32(ms.nvfp4_quantize(x, 1, trial)[0]).astype(np.float64)
    codes = blocked(values, 1, 16).astype(np.float64) / block_scale[..., None]
    magnitude = np.abs(y.astype(np.float64))
    step = np.where(magnitude < 2, 0.5, np.where(magnitude < 4, 1.0, 2.0))
    inside = magnitude < 6  # saturated maxima round down by design
    t = magnitude / step
    sr_errors.append(((np.abs(codes) - magnitude) / step)[inside])
    rtn_errors.append(((np.abs(rtn_codes) - magnitude) / step)[inside])
    fractions.append((t - np.floor(t))[inside])
    # SR only ever picks one of the two grid neighbours.
    assert np.all(np.abs(codes - np.copysign(magnitude, y))[inside] < step[inside])
  sr, rtn, frac = (np.concatenate(a) for a in (sr_errors, rtn_errors, fractions))
  low = (frac > 0) & (frac < 0.5)
  assert abs(sr.mean()) < 5 / (2 * np.sqrt(sr.size)), sr.mean()
  assert abs(sr[low].mean()) < 5 / (2 * np.sqrt(low.sum())), sr[low].mean()
  assert rtn[low].mean() < -0.2  # the conditioned test does catch a bias
  assert np.mean(sr != rtn) > 0.1  # and SR really departs from nearest


def test_stochastic_rounding_noise_is_a_function_of_the_tensor_and_the_leg():
  x = inputs('normal', 16)
  quantize = jax.jit(ms.nvfp4_dequantized, static_argnums=(1, 2))
  first = _f32(quantize(x, 1, 1))
  np.testing.assert_array_equal(first, _f32(quantize(x, 1, 1)))  # reproducible
  # Another leg (salt) or another tensor redraws the noise: many elements round the
  # other way (about half of those not on the grid).
  assert np.mean(first != _f32(quantize(x, 1, 2))) > 0.1
  other = (x * F32(1.37)).astype(F32)
  assert np.mean(first * F32(1.37) != _f32(quantize(other, 1, 1))) > 0.1
  # Float32 reordering noise in a non-maximal element (last bits) keeps the block
  # scales, hence the noise: every other element rounds the same way.
  nudged = x.copy()
  nudged[0, 1] = np.nextafter(np.nextafter(nudged[0, 1], F32(np.inf)), F32(np.inf))
  assert np.abs(nudged[0, 1]) < np.max(np.abs(x[0, :16]))
  mask = np.ones_like(x, bool)
  mask[0, 1] = False
  np.testing.assert_array_equal(_f32(quantize(nudged, 1, 1))[mask], first[mask])
  # Round to nearest needs no salt and is deterministic.
  np.testing.assert_array_equal(_f32(quantize(x, 1, None)), _f32(quantize(x, 1, None)))


# --- the paths: jaxpr structure, accuracy ------------------------------------------------------


def _producers(jaxpr):
  """dot_general eqns of every (sub)jaxpr, each with the eqns producing its two operands."""
  found = []
  def walk(jaxpr):
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        found.append((eqn, [made_by.get(v) for v in eqn.invars[:2]]))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr)
  return found


def _operand_kind(eqn, operand):
  """'name(SR)' / 'name(RN)' for a quantizer call (and its block axis), else the primitive."""
  if eqn.primitive.name != 'jit':
    return eqn.primitive.name
  inner = eqn.params['jaxpr'].jaxpr
  reshapes = [e.params['new_sizes'] for e in inner.eqns if e.primitive.name == 'reshape'
              and len(e.params['new_sizes']) == 3]
  block = 16 if eqn.params['name'] == 'nvfp4_quantize' else 32
  # The blocks run along the matmul's contracting axis: lhs [M, K/B, B], rhs [K/B, B, N].
  assert reshapes and reshapes[0][2 if operand == 0 else 1] == block, reshapes
  # Stochastic rounding hashes element indices: an iota inside the call.
  rounding = 'SR' if any(e.primitive.name == 'iota' for e in inner.eqns) else 'RN'
  return f"{eqn.params['name']}({rounding})"


def _leg_kinds(dot):
  def fn(x, w, g):
    y, vjp = jax.vjp(dot, x, w)
    return y, vjp(g)
  jaxpr = jax.make_jaxpr(fn)(jnp.ones((64, 48)), jnp.ones((48, 40)), jnp.ones((64, 40))).jaxpr
  return [tuple(_operand_kind(p, i) for i, p in enumerate(producers))
          for _, producers in _producers(jaxpr)]


NV, MX = 'nvfp4_quantize', 'mxfp8_quantize'


@pytest.mark.parametrize('name,dot,want', [
    ('nvfp4', path_dot(nvfp4.nvfp4_path()),
     [(f'{NV}(RN)', f'{NV}(RN)'), (f'{NV}(SR)', f'{NV}(RN)'), (f'{NV}(RN)', f'{NV}(SR)')]),
    ('nvfp4_nearest', path_dot(nvfp4.nvfp4_path(gradient_rounding='nearest')),
     [(f'{NV}(RN)', f'{NV}(RN)')] * 3),
    ('nvfp4_forward_only', path_dot(nvfp4.nvfp4_path(forward_only=True)),
     [(f'{NV}(RN)', f'{NV}(RN)')] + [('convert_element_type', 'convert_element_type')] * 2),
    ('nvfp4_backward_only', path_dot(nvfp4.nvfp4_path(backward_only=True)),
     [('convert_element_type', 'convert_element_type'), (f'{NV}(SR)', f'{NV}(RN)'),
      (f'{NV}(RN)', f'{NV}(SR)')]),
    ('mxfp8', mxfp8.mxfp8_dot, [(f'{MX}(RN)', f'{MX}(RN)')] * 3),
    ('mxfp8_backward_only', path_dot(mxfp8.BACKWARD_PATH),
     [('convert_element_type', 'convert_element_type')] + [(f'{MX}(RN)', f'{MX}(RN)')] * 2),
])
def test_every_matmul_takes_both_operands_from_its_quantizer(name, dot, want):
  """forward (x, W), dlhs (g, W^T), drhs (x^T, g): each operand comes straight out of a
  quantizer call that blocks it along that matmul's contraction; SR only on g."""
  assert _leg_kinds(dot) == want, name


def _errors(dot, seed=1, shape=(96, 256, 160)):
  m, k, n = shape
  rng = np.random.default_rng(seed)
  x, w, g = (rng.standard_normal(s) for s in ((m, k), (k, n), (m, n)))
  w /= np.sqrt(k)
  fn = jax.jit(lambda x, w, g: (lambda y, vjp: (y,) + vjp(g))(*jax.vjp(dot, x, w)))
  got = fn(*(jnp.asarray(a, jnp.float32) for a in (x, w, g)))
  rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
  return [rel(a, b) for a, b in zip(got, (x @ w, g @ w.T, x.T @ g))], got


def test_path_errors_against_float64_follow_the_formats():
  # Relative quantization error of one N(0, 1) operand: MXFP8 ~0.026 (E4M3, 3 mantissa
  # bits), NVFP4 ~0.09 (E2M1); a product of two quantized operands ~sqrt(2) x that;
  # stochastic rounding (dx, dW) adds up to twice the variance of nearest.
  bf16_errors, _ = _errors(bf16.bf16_dot)
  mx_errors, _ = _errors(mxfp8.mxfp8_dot)
  nv_errors, _ = _errors(path_dot(nvfp4.nvfp4_path()))
  rtn_errors, _ = _errors(path_dot(nvfp4.nvfp4_path(gradient_rounding='nearest')))
  assert all(0.025 < e < 0.05 for e in mx_errors), mx_errors
  assert all(0.09 < e < 0.2 for e in nv_errors), nv_errors
  assert all(e > 5 * b for e, b in zip(mx_errors, bf16_errors))
  assert nv_errors[0] == rtn_errors[0]  # the same forward
  assert all(sr > rtn for sr, rtn in zip(nv_errors[1:], rtn_errors[1:]))


def test_forward_only_nvfp4_has_the_bf16_backward_exactly():
  _, (_, dx, dw) = _errors(path_dot(nvfp4.nvfp4_path(forward_only=True)), shape=(64, 48, 40))
  _, (_, bf16_dx, bf16_dw) = _errors(bf16.bf16_dot, shape=(64, 48, 40))
  _, (nv_y, nv_dx, _) = _errors(path_dot(nvfp4.nvfp4_path()), shape=(64, 48, 40))
  fwd_y = _errors(path_dot(nvfp4.nvfp4_path(forward_only=True)), shape=(64, 48, 40))[1][0]
  np.testing.assert_array_equal(dx, bf16_dx)
  np.testing.assert_array_equal(dw, bf16_dw)
  np.testing.assert_array_equal(fwd_y, nv_y)
  assert not np.array_equal(dx, nv_dx)


def test_backward_only_mxfp8_is_the_bf16_forward_and_the_mxfp8_backward_exactly():
  """'mxfp8_backward': y of the bf16 path, dx and dW of the MXFP8 path, bit for bit."""
  shape = (64, 64, 40)
  config = precision.default_precision_config()
  config.update(mode='static', low_cost_path='mxfp8_backward')
  _, (y, dx, dw) = _errors(precision.make_policy(config).dot, shape=shape)
  _, (bf16_y, bf16_dx, _) = _errors(bf16.bf16_dot, shape=shape)
  _, (mx_y, mx_dx, mx_dw) = _errors(mxfp8.mxfp8_dot, shape=shape)
  np.testing.assert_array_equal(y, bf16_y)
  np.testing.assert_array_equal(dx, mx_dx)
  np.testing.assert_array_equal(dw, mx_dw)
  assert not np.array_equal(y, mx_y) and not np.array_equal(dx, bf16_dx)


def test_backward_only_nvfp4_is_the_bf16_forward_and_the_nvfp4_backward_exactly():
  """'nvfp4_backward' (the forward-only late switch's recovery path): y of the bf16 path,
  dx and dW of the NVFP4 path (the same SR noise: it is keyed by g's block scales)."""
  shape = (64, 48, 40)
  config = precision.default_precision_config()
  config.update(mode='static', low_cost_path='nvfp4_backward')
  routed = precision.make_policy(config).dot
  _, (y, dx, dw) = _errors(routed, shape=shape)
  _, (bf16_y, bf16_dx, _) = _errors(bf16.bf16_dot, shape=shape)
  _, (nv_y, nv_dx, nv_dw) = _errors(path_dot(nvfp4.nvfp4_path()), shape=shape)
  np.testing.assert_array_equal(y, bf16_y)
  np.testing.assert_array_equal(dx, nv_dx)
  np.testing.assert_array_equal(dw, nv_dw)
  assert not np.array_equal(y, nv_y) and not np.array_equal(dx, bf16_dx)
  config.nvfp4_gradient_rounding = 'nearest'
  _, (_, rtn_dx, _) = _errors(precision.make_policy(config).dot, shape=shape)
  _, (_, want_dx, _) = _errors(path_dot(nvfp4.nvfp4_path(gradient_rounding='nearest')),
                               shape=shape)
  np.testing.assert_array_equal(rtn_dx, want_dx)
  with pytest.raises(ValueError, match='exclude each other'):
    nvfp4.nvfp4_path(forward_only=True, backward_only=True)
  with pytest.raises(ValueError, match='backward_only must be a bool'):
    nvfp4.nvfp4_path(backward_only='yes')


# --- routed per unit ----------------------------------------------------------------------


def _policy(mode, low_cost_path, **fields):
  config = precision.default_precision_config()
  config.update(dict(mode=mode, low_cost_path=low_cost_path, recovery_path='bf16', **fields))
  return precision.make_policy(config, max_recovered=2)


@pytest.mark.parametrize('path', ['nvfp4', 'mxfp8'])
def test_routed_layer_is_the_static_path_or_the_recovery_path_exactly(path):
  """A routed unit runs lax.cond(bit, bf16, path): bit False gives the static path's
  y, dx and dW bit for bit, bit True the bf16 path's."""
  rng = np.random.default_rng(3)
  # K = 48 and N = 40: padded blocks in every leg; M = 64 tokens.
  x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((64, 48), (48, 40), (64, 40)))

  def run(policy, bit):
    def fn(x, w, g, bit):
      y, vjp = jax.vjp(lambda a, b: policy.dot(a, b, bit), x, w)
      return (y,) + vjp(g)
    return [_f32(a) for a in jax.jit(fn)(x, w, g, jnp.array(bit))]

  routed = _policy('gnmr', path)
  static = run(_policy('static', path), False)
  recovery = run(_policy('static', 'bf16'), False)
  for got, want in zip(run(routed, False), static):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(run(routed, True), recovery):
    np.testing.assert_array_equal(got, want)
  for a, b in zip(static, recovery):
    assert not np.array_equal(a, b)  # the bit really switches the numerics


@pytest.mark.parametrize('path', ['nvfp4', 'mxfp8'])
def test_routed_stack_empty_mask_and_full_mask_match_static_programs(path):
  """The layer-stacked MLP under scan + cond + grad: an empty mask gives the static
  low-cost program's loss and gradients, a full mask the bf16 program's."""
  num_layers, tokens, width, ffn = 2, 32, 48, 80
  params = testing.init_stack(jax.random.key(0), num_layers, width, ffn)
  x = jax.random.normal(jax.random.key(1), (tokens, width), jnp.float32)

  def grads(policy, mask):
    fn = jax.jit(jax.value_and_grad(lambda p, m: testing.stack_loss(policy, p, x, m)))
    return fn(params, mask)

  routed = _policy('gnmr', path)
  for bits, reference in ((False, _policy('static', path)), (True, _policy('static', 'bf16'))):
    loss, grad = grads(routed, jnp.full((num_layers,), bits))
    ref_loss, ref_grad = grads(reference, None)
    assert float(loss) == float(ref_loss), (bits, float(loss), float(ref_loss))
    for name in grad:
      np.testing.assert_array_equal(grad[name], ref_grad[name])


@pytest.mark.parametrize('module', [ms, nvfp4, mxfp8], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
  import doctest  # pylint: disable=g-import-not-at-top
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result


# --- explicit-axis meshes ----------------------------------------------------------------

MESHES = {  # mesh shape, axis names, x spec, kernel spec
    'data8': ((8,), ('data',), P('data', None), P(None, None)),
    'data2_model4_rows': ((2, 4), ('data', 'model'), P('data', 'model'), P('model', None)),
    'data2_model4_cols': ((2, 4), ('data', 'model'), P('data', None), P(None, 'model')),
}


def _quantized_operands(path, bit, x, w, g):
  """The operands each matmul multiplies (forward, dlhs, drhs), as float64 NumPy."""
  if bit:  # the bf16 recovery path
    q = lambda a, axis, salt=None: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  elif path == 'nvfp4':
    q = lambda a, axis, salt=None: np.asarray(ms.nvfp4_dequantized(a, axis, salt), np.float64)
  else:
    q = lambda a, axis, salt=None: np.asarray(ms.mxfp8_dequantized(a, axis), np.float64)
  return ((q(x, 1), q(w, 0)), (q(g, 1, 1), q(w.T, 0)), (q(x.T, 1), q(g, 0, 2)))


@pytest.mark.parametrize('layout', sorted(MESHES))
@pytest.mark.parametrize('path', ['nvfp4', 'mxfp8'])
def test_paths_under_explicit_meshes_match_one_device(path, layout):
  """Sharded operands, routed per unit: y, dx (x's sharding) and dW (W's sharding) equal
  the one-device results up to the order of the float32 sums. Block and tensor maxima
  and the noise seeds take no order, so the quantized operands are the same; two orders
  of an n-term sum differ by <= 2 gamma_n (|a| @ |b|) ~ 2 n eps (|a| @ |b|)."""
  shape, names, x_spec, w_spec = MESHES[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
  rng = np.random.default_rng(4)
  x, w, g = (rng.standard_normal(s).astype(F32) for s in ((64, 48), (48, 40), (64, 40)))
  policy = _policy('gnmr', path, recovery_storage='per_unit')

  @jax.jit
  def run(x, w, g, bit):
    y, vjp = jax.vjp(lambda a, b: policy.dot(a, b, bit), x, w)
    return (y,) + vjp(g)

  eps = float(np.finfo(F32).eps)
  for bit in (False, True):
    want = run(x, w, g, jnp.array(bit))
    with jax.set_mesh(mesh):
      x_s = jax.device_put(x, NamedSharding(mesh, x_spec))
      w_s = jax.device_put(w, NamedSharding(mesh, w_spec))
      got = run(x_s, w_s, jax.device_put(g, NamedSharding(mesh, P(x_spec[0], w_spec[1]))),
                jax.device_put(jnp.array(bit), NamedSharding(mesh, P())))
    assert got[1].sharding.is_equivalent_to(x_s.sharding, 2), (layout, bit)
    assert got[2].sharding.is_equivalent_to(w_s.sharding, 2), (layout, bit)
    for name, a, b, (qa, qb) in zip(('y', 'dx', 'dW'), got, want,
                                    _quantized_operands(path, bit, x, w, g)):
      bound = 2 * qa.shape[1] * eps * (np.abs(qa) @ np.abs(qb))
      diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
      assert np.all(diff <= bound), (layout, bit, name, float(np.max(diff - bound)))
