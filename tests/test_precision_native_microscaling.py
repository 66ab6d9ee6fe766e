"""The native NVFP4 / MXFP8 GEMMs (precision/native_microscaling.py) against the emulation.

The native path hands ``jax.nn.scaled_matmul`` the emulation's codes and block scales in the
formats' own dtypes. That GEMM lowers for CUDA only, so these tests register its definition
for the CPU (``testing.register_cpu_scaled_matmul``: dequantize, float32 dot at HIGHEST) and
run everything else of the native program as it is; the B200 compile (tests/aot) shows the
same calls become cuDNN block-scaled GEMMs. The quantized values must equal the emulation's
bit for bit; products may differ only by the order of float32 sums: two orders of an n-term
sum differ by at most 2 gamma_n (|a| @ |b|) ~ 2 n eps (|a| @ |b|).
"""

import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from gnmr_jax import precision
from gnmr_jax.precision import bf16, microscaling as ms, mxfp8, native_microscaling as nm
from gnmr_jax.precision import nvfp4, testing
from gnmr_jax.precision.path import path_dot
from test_precision_microscaling import KINDS, MESHES, inputs

F32 = np.float32
EPS = float(np.finfo(F32).eps)
B200 = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA B200', compute_capability='10.0')
H100 = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA H100 80GB HBM3',
                             compute_capability='9.0')


@pytest.fixture(scope='module', autouse=True)
def cpu_scaled_matmul():
  testing.register_cpu_scaled_matmul()


def _emulated_rows_last(values, axis, padded):
  """The emulation's [M, K] / [K, N] values as [rows, padded K], float64."""
  values = np.asarray(values, np.float64)
  values = values if axis == 1 else values.T
  return np.pad(values, [(0, 0), (0, padded - values.shape[1])])


def _dequantized(codes, scales):
  codes = np.asarray(codes.astype(jnp.float32), np.float64)
  scales = np.asarray(scales.astype(jnp.float32), np.float64)
  return codes * np.repeat(scales, codes.shape[1] // scales.shape[1], axis=1)


@pytest.mark.parametrize('salt', [None, 1])
@pytest.mark.parametrize('axis', [0, 1])
@pytest.mark.parametrize('kind', KINDS)
def test_nvfp4_codes_and_scales_are_the_emulations_values_bit_for_bit(kind, axis, salt):
  x = jnp.asarray(inputs(kind, 16))
  codes, scales, tensor_scale = nm.nvfp4_encode(x, axis, salt)
  rows, k = x.shape[1 - axis], x.shape[axis]
  assert (codes.dtype, scales.dtype) == (jnp.float4_e2m1fn, jnp.float8_e4m3fn)
  assert codes.shape == (rows, -(-k // 16) * 16) and scales.shape == (rows, -(-k // 16))
  values, want_scale = ms.nvfp4_quantize(x, axis, salt)
  np.testing.assert_array_equal(_dequantized(codes, scales),
                                _emulated_rows_last(values, axis, codes.shape[1]))
  assert float(tensor_scale) == float(want_scale)


@pytest.mark.parametrize('axis', [0, 1])
@pytest.mark.parametrize('kind', KINDS)
def test_mxfp8_codes_and_scales_are_the_emulations_values_bit_for_bit(kind, axis):
  x = jnp.asarray(inputs(kind, 32))
  codes, scales = nm.mxfp8_encode(x, axis)
  assert (codes.dtype, scales.dtype) == (jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
  assert scales.shape == (x.shape[1 - axis], -(-x.shape[axis] // 32))
  np.testing.assert_array_equal(
      _dequantized(codes, scales),
      _emulated_rows_last(ms.mxfp8_quantize(x, axis), axis, codes.shape[1]))


def test_e8m0_scales_cover_the_clamped_exponent_range_and_nan():
  """Exponents -126..127 are the E8M0 values 2^e exactly (the emulation clamps there);
  a block with a non-finite value gets E8M0's NaN, as its emulated scale is NaN."""
  exponent = jnp.arange(-126, 128, dtype=jnp.int32)
  got = nm.e8m0(exponent, jnp.ones_like(exponent, jnp.float32)).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(got, np.float64), 2.0 ** np.arange(-126, 128))
  nan = nm.e8m0(jnp.array([3]), jnp.array([jnp.nan]))
  assert np.isnan(float(nan.astype(jnp.float32)[0]))


def _operands(seed=0, shape=(64, 80, 48)):
  m, k, n = shape
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(F32)
  x[3, :16] *= 1e3  # an outlier block
  w = (0.1 * rng.standard_normal((k, n))).astype(F32)
  w[:, 5] = 0  # an all-zero column: zero blocks for W and W^T
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(rng.standard_normal((m, n)).astype(F32))


def _step(path):
  dot = path_dot(path)

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(dot, x, w)
    return (y,) + vjp(g)
  return run


def _legs_operands(path_name, x, w, g):
  """float64 dequantized operands of (forward, dlhs, drhs) as the emulation quantizes them."""
  def q(a, axis, salt=None):
    if path_name.startswith('nvfp4'):
      return np.asarray(ms.nvfp4_dequantized(a, axis, salt), np.float64)
    return np.asarray(ms.mxfp8_dequantized(a, axis), np.float64)
  return ((q(x, 1), q(w, 0)), (q(g, 1, 1), q(w.T, 0)), (q(x.T, 1), q(g, 0, 2)))


PATHS = {  # name -> (emulated, native, which legs are quantized: forward, dlhs, drhs)
    'nvfp4': (nvfp4.nvfp4_path(), nvfp4.nvfp4_path(native=True), (1, 1, 1)),
    'nvfp4_forward_only': (nvfp4.nvfp4_path(forward_only=True),
                           nvfp4.nvfp4_path(forward_only=True, native=True), (1, 0, 0)),
    'nvfp4_backward': (nvfp4.nvfp4_path(backward_only=True),
                       nvfp4.nvfp4_path(backward_only=True, native=True), (0, 1, 1)),
    'mxfp8': (mxfp8.mxfp8_path(), mxfp8.mxfp8_path(native=True), (1, 1, 1)),
    'mxfp8_backward': (mxfp8.BACKWARD_PATH, mxfp8.mxfp8_path(True, True), (0, 1, 1)),
}


@pytest.mark.parametrize('name', sorted(PATHS))
def test_native_path_is_the_emulated_path_up_to_the_order_of_float32_sums(name):
  """y, dx and dW of each path (stochastic gradient rounding included): the native GEMMs
  multiply the emulation's quantized operands, so they agree within 2 n eps (|a| @ |b|)."""
  emulated, native, _ = PATHS[name]
  x, w, g = _operands()
  want, got = _step(emulated)(x, w, g), _step(native)(x, w, g)
  for leg, a, b, (qa, qb) in zip(('y', 'dx', 'dW'), got, want, _legs_operands(name, x, w, g)):
    bound = 2 * qa.shape[1] * EPS * (np.abs(qa) @ np.abs(qb))
    if a.dtype == jnp.bfloat16:  # y in x's dtype: one more rounding, half an ulp of bf16
      bound = bound + 2.0**-8 * np.abs(np.asarray(b, np.float64))
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert np.all(diff <= bound), (name, leg, float(np.max(diff - bound)))


def _scaled_matmuls(jaxpr):
  """(lhs dtype, rhs dtype, lhs scale dtype, rhs scale dtype) of every scaled_matmul."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith('scaled_matmul'):
      out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          out += _scaled_matmuls(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          out += _scaled_matmuls(sub)
  return out


@pytest.mark.parametrize('name', sorted(PATHS))
def test_every_quantized_leg_is_one_block_scaled_gemm_of_the_formats_dtypes(name):
  """The jaxpr of y and both gradients: one scaled_matmul per quantized leg, its operands
  E2M1 codes with E4M3 scales (NVFP4) or E4M3 codes with E8M0 scales (MXFP8)."""
  _, native, legs = PATHS[name]
  dot = path_dot(native)
  x, w, g = _operands()
  jaxpr = jax.make_jaxpr(lambda x, w, g: jax.vjp(dot, x, w)[1](g))(x, w, g)
  want = (('float4_e2m1fn',) * 2 + ('float8_e4m3fn',) * 2 if name.startswith('nvfp4')
          else ('float8_e4m3fn',) * 2 + ('float8_e8m0fnu',) * 2)
  found = _scaled_matmuls(jaxpr.jaxpr)
  assert found == [want] * sum(legs), found


def test_non_finite_values_reach_the_same_outputs():
  """NaN and Inf propagate as in the emulation: an NVFP4 tensor with one is NaN everywhere
  (its tensor scale), an MXFP8 block with one makes the outputs it contributes to NaN."""
  x, w, g = _operands()
  x = x.at[7, 9].set(jnp.inf).at[20, 70].set(jnp.nan)
  for name in ('nvfp4', 'mxfp8'):
    emulated, native, _ = PATHS[name]
    for a, b in zip(_step(native)(x, w, g), _step(emulated)(x, w, g)):
      np.testing.assert_array_equal(np.isnan(np.asarray(a, F32)),
                                    np.isnan(np.asarray(b, F32)), err_msg=name)


# --- choosing the implementation ---------------------------------------------------------


def test_auto_is_native_on_block_scaled_gpus_only_and_native_is_refused_elsewhere():
  cpu = jax.devices('cpu')[0]
  tpu = types.SimpleNamespace(platform='tpu', device_kind='TPU v6 lite')
  rocm = types.SimpleNamespace(platform='rocm', device_kind='AMD Instinct MI355X',
                               compute_capability='gfx950')
  named_only = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA GB200')
  rtx = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA RTX PRO 6000',
                              compute_capability='12.0')
  assert [nm.resolve_impl('auto', d) for d in (B200, named_only, rtx)] == ['native'] * 3
  assert [nm.resolve_impl('auto', d) for d in (cpu, tpu, rocm, H100)] == ['emulated'] * 4
  assert nm.resolve_impl('emulated', B200) == 'emulated'
  for device, named in ((H100, 'compute capability 9.0'), (tpu, r"'TPU v6 lite' \(tpu\)")):
    with pytest.raises(ValueError, match=r"microscaling_impl='native'.*" + named):
      nm.resolve_impl('native', device)
  with pytest.raises(ValueError, match="'microscaling_impl' must be one of"):
    nm.resolve_impl('cudnn', B200)


def _config(low_cost_path='nvfp4', recovery_path='bf16', impl='auto', mode='gnmr'):
  config = precision.default_precision_config()
  config.update(dict(mode=mode, low_cost_path=low_cost_path, recovery_path=recovery_path,
                     microscaling_impl=impl))
  return config


def test_make_policy_builds_the_paths_the_device_runs():
  """'auto' gives the emulated paths on this CPU and the native ones for a B200; the
  late switch's NVFP4-backward recovery path follows too; 'native' on the CPU is refused
  before anything is traced; paths that take no block scales never ask for a device."""
  config = _config('nvfp4', 'nvfp4_backward')
  on_cpu, on_b200 = precision.make_policy(config), precision.make_policy(config, device=B200)
  assert (on_cpu.low_cost, on_cpu.recovery) == (nvfp4.nvfp4_path(),
                                                nvfp4.nvfp4_path(backward_only=True))
  assert (on_b200.low_cost, on_b200.recovery) == (
      nvfp4.nvfp4_path(native=True), nvfp4.nvfp4_path(backward_only=True, native=True))
  assert precision.make_policy(_config('mxfp8', mode='static'),
                               device=B200).low_cost is mxfp8.mxfp8_path(native=True)
  assert precision.recovery_policy(_config('int8', 'mxfp8_backward'),
                                   device=B200).low_cost is mxfp8.mxfp8_path(True, True)
  with pytest.raises(ValueError, match="microscaling_impl='native' needs .*'cpu'"):
    precision.make_policy(_config(impl='native'))
  int8 = precision.make_policy(_config('int8', impl='native'), device=H100)  # not asked
  assert int8.recovery is bf16.PATH
  with pytest.raises(ValueError, match="'microscaling_impl' must be one of"):
    precision.make_policy(_config(impl='fast'))


def test_resolved_config_records_the_choice_and_leaves_other_paths_alone():
  config = _config('mxfp8')
  resolved = nm.resolved_config(config, B200)
  assert resolved.microscaling_impl == 'native' and config.microscaling_impl == 'auto'
  assert nm.resolved_config(config, H100).microscaling_impl == 'emulated'
  assert nm.resolved_config(_config('int8', 'bf16'), B200).microscaling_impl == 'auto'


# --- routed and sharded ------------------------------------------------------------------


@pytest.mark.parametrize('layout,tokens', [(None, 64), ('data2_model4_rows', 64),
                                           ('data8', 128)])
def test_routed_native_unit_is_the_emulated_one_on_any_mesh(layout, tokens):
  """A routed NVFP4 unit built for a B200 (bit False: native NVFP4, True: bf16), on one
  device and under explicit-axis meshes: y, dx and dW as the emulated policy's on one device,
  with the gradients typed like x and W. A K of 48 over 4 'model' shards splits NVFP4
  blocks (the contraction is gathered); 128 tokens over 8 'data' shards do not (dW: partial
  GEMMs per shard, summed)."""
  config = _config()
  config.recovery_storage = 'per_unit'
  native = precision.make_policy(config, device=B200, max_recovered=2)
  emulated = precision.make_policy(config, max_recovered=2)
  x, w, g = _operands(seed=4, shape=(tokens, 48, 40))

  def runner(policy):
    @jax.jit
    def run(x, w, g, bit):
      y, vjp = jax.vjp(lambda a, b: policy.dot(a, b, bit), x, w)
      return (y,) + vjp(g)
    return run

  for bit in (False, True):
    want = runner(emulated)(x, w, g, jnp.array(bit))
    if layout is None:
      got = runner(native)(x, w, g, jnp.array(bit))
    else:
      shape, names, x_spec, w_spec = MESHES[layout]
      mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
      with jax.set_mesh(mesh):
        x_s = jax.device_put(x, NamedSharding(mesh, x_spec))
        w_s = jax.device_put(w, NamedSharding(mesh, w_spec))
        got = runner(native)(x_s, w_s,
                             jax.device_put(g, NamedSharding(mesh, P(x_spec[0], w_spec[1]))),
                             jax.device_put(jnp.array(bit), NamedSharding(mesh, P())))
      assert got[1].sharding.is_equivalent_to(x_s.sharding, 2), (layout, bit)
      assert got[2].sharding.is_equivalent_to(w_s.sharding, 2), (layout, bit)
    f64 = lambda a: np.asarray(a, np.float64)
    operands = (((f64(x), f64(w)), (f64(g), f64(w).T), (f64(x).T, f64(g))) if bit
                else _legs_operands('nvfp4', x, w, g))
    for leg, a, b, (qa, qb) in zip(('y', 'dx', 'dW'), got, want, operands):
      # bit True: the same bf16 GEMM on both sides; |bf16(a)| <= 2 |a| bounds its terms.
      bound = (2 if bit else 1) * 2 * qa.shape[1] * EPS * (np.abs(qa) @ np.abs(qb))
      diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
      assert np.all(diff <= bound), (layout, bit, leg, float(np.max(diff - bound)))


# --- jax.nn.scaled_dot_general, the peer: what the docs say it does differently ------------


def test_jax_scaled_dot_general_quantizes_by_another_recipe_as_the_docs_say():
  """experiments/microscaling_semantics.py's table, checked: jax's NVFP4 with the recipe's
  per-tensor scale as its global scale gives the recipe's values; with its default global
  scale 1 small tensors underflow and large ones saturate; its MXFP8 equals the recipe's but
  for all-zero blocks, which become NaN here (XLA:CPU flushes its 2^-127 scale to zero)."""
  from experiments import microscaling_semantics as semantics
  rows = {(t, f, r): (error, differ, bad)
          for t, f, r, error, differ, bad in semantics.quantize_rows()}
  tensors = {t for t, _, _ in rows}
  for tensor in tensors:
    assert rows[tensor, 'nvfp4', "jax, global scale = the recipe's"][1] == 0, tensor
    recipe_error = rows[tensor, 'nvfp4', 'recipe'][0]
    assert recipe_error < 0.1, tensor
  assert rows['small (1e-4 x normal)', 'nvfp4', 'jax, global scale 1 (default)'][0] > 0.99
  assert rows['large (1e4 x normal)', 'nvfp4', 'jax, global scale 1 (default)'][0] > 0.5
  for tensor in tensors - {'all-zero blocks (1/4 of them)'}:
    assert rows[tensor, 'mxfp8', 'jax'][1:] == (0, 0), tensor
  _, differ, bad = rows['all-zero blocks (1/4 of them)', 'mxfp8', 'jax']
  assert (differ, bad) == (0.25, 64 * 64)


def test_jax_scaled_dot_general_nvfp4_backward_is_unquantized():
  """Its NVFP4 input gradient is g W^T on the unquantized operands (float32 here), where the
  recipe quantizes g (stochastically) and W^T: the path the training comparison runs."""
  from experiments import microscaling_semantics as semantics
  from gnmr_jax.precision import registry
  semantics.register_sdg_paths()
  config = precision.default_precision_config()
  dot = path_dot(registry.get_path('jax_sdg_nvfp4')(config, 'low_cost'))
  x, w, g = _operands(shape=(32, 64, 48))
  dx, dw = jax.vjp(dot, x, w)[1](g)
  f64 = lambda a: np.asarray(a, np.float64)
  x64, w64, g64 = f64(x), f64(w), f64(g)
  for got, want, magnitude, k in ((dx, g64 @ w64.T, np.abs(g64) @ np.abs(w64).T, 48),
                                  (dw, x64.T @ g64, np.abs(x64).T @ np.abs(g64), 32)):
    # float32 products summed in float32: within 2 k eps (|a| @ |b|) of the float64 product.
    assert np.all(np.abs(f64(got) - want) <= 2 * k * EPS * magnitude)
