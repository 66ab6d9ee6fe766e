"""The scaling recipes (precision.scaling): per-tensor current and delayed scaling.

References are NumPy: the codes are rounded with ml_dtypes' float8 casts (round to nearest
even, as XLA's convert) and np.round, multiplied in float64; the only difference left is the
float32 accumulation order of the 8-bit products, bounded by tolerances.matmul_atol (a product
of two fp8 or int8 codes is exact in float32).
"""

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gnmr_jax import precision
from gnmr_jax.precision import amax_history, delayed_scaling, path_dot, per_tensor, scaling
from gnmr_jax.precision import tensor_scaling
from gnmr_jax.precision import side_buffer
from tests.tolerances import assert_allclose, matmul_atol

M, K, N = 48, 64, 40
NP_DTYPE = {jnp.dtype(jnp.float8_e4m3fn): ml_dtypes.float8_e4m3fn,
            jnp.dtype(jnp.float8_e5m2): ml_dtypes.float8_e5m2}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
  g = (rng.standard_normal((M, N)) * 1e-3).astype(np.float32)
  return x, w, g


def _np_codes(v, scale, dtype):
  """NumPy codes of v at scale, clipped to the format (float64 values of the codes)."""
  dtype = jnp.dtype(dtype)
  top = float(jnp.finfo(dtype).max) if dtype in NP_DTYPE else 127.0
  y = np.clip(np.asarray(v, np.float64) / scale, -top, top)
  if dtype in NP_DTYPE:
    return y.astype(np.float32).astype(NP_DTYPE[dtype]).astype(np.float64)
  return np.round(y)


def _np_tensor_scale(v, dtype, power_of_two):
  top = float(jnp.finfo(dtype).max) if jnp.dtype(dtype) in NP_DTYPE else 127.0
  scale = np.float32(np.max(np.abs(v))) / np.float32(top)
  return float(2.0 ** np.ceil(np.log2(scale))) if power_of_two else float(scale)


def _vjp(dot, x, w, g, *extra):
  y, vjp = jax.vjp(dot, jnp.asarray(x), jnp.asarray(w), *extra)
  return (y,) + tuple(vjp(jnp.asarray(g)))


def _check_legs(outs, x, w, g, scales, dtypes):
  """y, dx, dW of a per-tensor-scaled path against NumPy at the given scales."""
  (sx, sw, sg), (dx_, dw_, dg_) = scales, dtypes
  qx, qw, qg = _np_codes(x, sx, dx_), _np_codes(w, sw, dw_), _np_codes(g, sg, dg_)
  for actual, a, b, scale in ((outs[0], qx, qw, sx * sw), (outs[1], qg, qw.T, sg * sw),
                              (outs[2], qx.T, qg, sx * sg)):
    assert_allclose(actual, (a @ b) * scale, atol=matmul_atol(a, b) * scale)


@pytest.mark.parametrize('fmt', ['fp8', 'int8'])
def test_tensor_path_is_one_scale_per_tensor_against_numpy(fmt):
  x, w, g = _inputs()
  path = per_tensor.FP8_TENSOR if fmt == 'fp8' else per_tensor.INT8_TENSOR
  dtypes = ((jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2) if fmt == 'fp8'
            else (jnp.int8,) * 3)
  pow2 = fmt == 'fp8'
  scales = [_np_tensor_scale(v, d, pow2) for v, d in zip((x, w, g), dtypes)]
  outs = jax.jit(lambda *a: _vjp(path_dot(path), *a))(x, w, g)
  _check_legs(outs, x, w, g, scales, dtypes)


def _dots_and_reductions(path, dtype=jnp.bfloat16, history=False):
  x = jnp.ones((8, 16), dtype)
  args = (x, jnp.ones((16, 4)), jnp.ones((8, 4), dtype))
  extra = (amax_history.init(4),) if history else ()
  jaxpr = jax.make_jaxpr(lambda *a: _vjp(path_dot(path), *a))(*args, *extra).jaxpr
  dots, reductions = [], 0

  def walk(j):
    nonlocal reductions
    for eqn in j.eqns:
      if eqn.primitive.name == 'dot_general':
        dots.append((eqn.invars[0].aval.dtype, eqn.invars[1].aval.dtype,
                     eqn.params['preferred_element_type']))
      # over an operand (a history row of 4 is no pass over the data)
      reductions += eqn.primitive.name == 'reduce_max' and eqn.invars[0].aval.size > 4
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr)
  return dots, reductions


def test_each_operand_is_reduced_once_and_the_gemm_writes_bf16():
  e4, e5, bf = (jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16))
  dots, reductions = _dots_and_reductions(per_tensor.FP8_TENSOR)
  assert dots == [(e4, e4, bf), (e5, e4, bf), (e4, e5, jnp.dtype(jnp.float32))]  # dW: f32 kernel
  assert reductions == 3                                           # x, W, g: once each
  _, row_reductions = _dots_and_reductions(precision.fp8.PATH)
  assert row_reductions == 6                                       # two per leg
  dots, reductions = _dots_and_reductions(per_tensor.FP8_DELAYED, history=True)
  assert [d[:2] for d in dots] == [(e4, e4), (e5, e4), (e4, e5)]
  # delayed: no reduction feeds a scale; the observations read the codes (x, g) and W
  assert reductions == 3


def test_power_of_two_scale_rounds_up_exactly_and_passes_non_finite():
  values = jnp.array([1.0, 0.75, 2.0 ** -20 * 1.5, 3.0, 0.0, jnp.inf, jnp.nan], jnp.float32)
  out = np.asarray(tensor_scaling.power_of_two_scale(values))
  np.testing.assert_array_equal(out[:5], [1.0, 1.0, 2.0 ** -19, 4.0, 0.0])
  assert np.isinf(out[5]) and np.isnan(out[6])
  # A nan amax stays nan (an int8 cast would launder it to a finite code); zero scales by 1.
  assert np.isnan(tensor_scaling.tensor_scale(jnp.array([1.0, jnp.nan]), jnp.int8, False))
  assert tensor_scaling.tensor_scale(jnp.zeros(3), jnp.float8_e4m3fn, True) == 1.0


def test_history_push_settle_and_saturation():
  history = amax_history.init(3)
  history = amax_history.push(history, 1.0, 2.0, 3.0)
  pushed = amax_history.push(history, jnp.inf, 1.0, 9.0)
  assert np.isinf(pushed[0, 0])  # as observed; the step settles it after its micro-batches
  history = amax_history.settle(pushed)
  np.testing.assert_array_equal(history, [[0.0, 1.0, 0.0], [1.0, 2.0, 0.0], [9.0, 3.0, 0.0]])
  # Saturation against the scale of the history the step scaled from (powers of two with up
  # to 2x headroom, so outgrowing the history is not yet saturating): x's previous amax 1 ->
  # scale 2^-8, range 1.75; W's 2 -> 2^-7, 3.5; g's 3 (e5m2) -> 2^-14, 3.5.
  previous = amax_history.push(amax_history.init(3), 1.0, 2.0, 3.0)
  current = amax_history.push(previous, 1.5, 7.0, 2 * 57344 * 2.0 ** -14)
  np.testing.assert_allclose(delayed_scaling.saturation(previous, current),
                             [1.5 / (448 * 2.0 ** -8), 7.0 / (448 * 2.0 ** -7), 2.0], rtol=1e-6)
  with pytest.raises(ValueError, match='length'):
    amax_history.init(0)


def test_observation_from_codes_saturation_doubles_underflow_bounds():
  e4 = jnp.float8_e4m3fn
  scale = jnp.float32(0.25)
  exact = delayed_scaling.observe_codes(jnp.array([-96.0, 3.0], e4), scale)
  assert float(exact) == 24.0
  assert float(delayed_scaling.observe_codes(jnp.array([448.0], e4), scale)) == 2 * 448 * 0.25
  # A NaN code reads as +inf (settled as no observation), inside a fused reduction too.
  nan_codes = jnp.zeros(4096, e4).at[1234].set(jnp.nan)
  assert np.isinf(jax.jit(delayed_scaling.observe_codes)(nan_codes, scale))
  under = float(delayed_scaling.observe_codes(jnp.zeros(4, jnp.float8_e5m2), scale))
  assert under == float(jnp.finfo(jnp.float8_e5m2).smallest_subnormal) / 2 * 0.25


def test_delayed_path_scales_from_the_history_and_pushes_what_it_saw():
  x, w, g = _inputs(1)
  x[0, 0] = 40.0  # past the history: x saturates this step
  past = np.array([4.0, 0.5, 8e-3], np.float32)  # g stays within its history
  history = jnp.asarray(amax_history.init(4)).at[:, 1].set(past)
  outs = jax.jit(lambda *a: _vjp(path_dot(per_tensor.FP8_DELAYED), *a))(x, w, g, history)
  dtypes = (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2)
  scales = [float(2.0 ** np.ceil(np.log2(a / float(jnp.finfo(d).max))))
            for a, d in zip(past, dtypes)]
  _check_legs(outs[:3], x, w, g, scales, dtypes)
  pushed = np.asarray(outs[3])
  np.testing.assert_array_equal(pushed[:, 1:], np.asarray(history)[:, :3])
  assert pushed[0, 0] == 2 * 448 * scales[0]                    # saturated: doubled
  assert pushed[1, 0] == np.max(np.abs(w))                      # W: its true amax
  top_g = np.max(np.abs(_np_codes(g, scales[2], jnp.float8_e5m2)))
  assert pushed[2, 0] == np.float32(top_g * scales[2])           # g: from its codes
  sat = np.asarray(delayed_scaling.saturation(history, outs[3]))
  assert sat[0] == 2.0 and 0 < sat[1] <= 1 and 0 < sat[2] <= 1  # x saturated, W and g not


def _routed_case(storage, recover, scaling_name='delayed', seed=2):
  x, w, g = _inputs(seed)
  history = jnp.asarray(amax_history.init(4)).at[:, 0].set(
      jnp.array([np.abs(x).max(), np.abs(w).max(), np.abs(g).max()]))
  config = precision.default_precision_config()
  config.mode, config.low_cost_path, config.scaling = 'gnmr', 'fp8', scaling_name
  config.recovery_storage = storage
  policy = precision.make_policy(config, max_recovered=1)
  side = policy.init_side((M,), [(K, N)], jnp.float32)

  def loss(x, w, history):
    y, out = policy.dot_side(x, w, jnp.array(recover), side, history=history)
    return side_buffer.attach(jnp.vdot(y, jnp.asarray(g)), out)

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, history)
  return value, grads, (x, w, g, history)


@pytest.mark.parametrize('storage', ['per_unit', 'side_buffer'])
@pytest.mark.parametrize('scaling_name', ['tensor', 'delayed'])
def test_routed_per_tensor_is_the_static_path_or_bf16_and_observes_either_way(storage,
                                                                               scaling_name):
  # Both per-tensor recipes quantize outside the cond (path.Hoisted); a history is observed
  # whichever branch runs (the tensor recipe takes none but reports what it saw when given one).
  value, (dx, dw, pushed), (x, w, g, history) = _routed_case(storage, False, scaling_name)
  path = per_tensor.FP8_DELAYED if scaling_name == 'delayed' else per_tensor.FP8_TENSOR
  static = jax.jit(lambda *a: _vjp(path_dot(path), *a))(x, w, g, history)
  np.testing.assert_array_equal(dx, static[1])
  np.testing.assert_array_equal(dw, static[2])
  np.testing.assert_array_equal(pushed, static[3])
  value, (dx, dw, pushed_rec), _ = _routed_case(storage, True, scaling_name)
  bf16 = jax.jit(lambda *a: _vjp(precision.bf16.bf16_dot, *a))(x, w, g)
  np.testing.assert_array_equal(dx, bf16[1])
  np.testing.assert_array_equal(dw, bf16[2])
  # The codes are quantized outside the cond, so a recovered step observes the same amaxes.
  np.testing.assert_array_equal(pushed_rec, pushed)


def test_scaling_config_is_validated_where_the_path_is_built():
  config = precision.default_precision_config()
  config.mode, config.low_cost_path = 'static', 'int8'
  config.scaling = 'delayed'
  with pytest.raises(ValueError, match=r"'int8' path has no 'delayed' scaling.*'row', 'tensor'"):
    precision.make_policy(config)
  config.scaling = 'block'
  with pytest.raises(ValueError, match=r"'scaling' must be one of \('row', 'tensor', 'delayed'"):
    precision.make_policy(config)
  config.scaling, config.amax_history_length = 'row', 0
  with pytest.raises(ValueError, match='amax_history_length'):
    precision.make_policy(config)
  assert scaling.names() == ('row', 'tensor', 'delayed')
  config = precision.default_precision_config()
  config.mode, config.low_cost_path, config.scaling = 'static', 'fp8', 'delayed'
  policy = precision.make_policy(config)
  assert policy.takes_history and policy.amax_history_length == 16
  with pytest.raises(ValueError, match='amax history'):
    policy.dot(jnp.ones((2, 4)), jnp.ones((4, 3)))


@pytest.mark.plumbing  # both runs without XLA optimizations
def test_delayed_histories_train_checkpoint_and_resume_bit_for_bit(tmp_path, data_dirs):
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  from tests.train_helpers import small_config  # pylint: disable=g-import-not-at-top
  config = small_config(data_dirs, **{
      'train.steps': 4, 'train.eval_every': 0, 'checkpoint.every_steps': 2,
      'precision.low_cost_path': 'fp8', 'precision.scaling': 'delayed',
      'precision.amax_history_length': 3})
  data = make_data(config.data)
  devices = jax.devices()[:1]
  run = train_loop.build(config, data=data, devices=devices)
  state = run.init_state(jax.random.key(0))
  assert jax.tree.leaves(state.amax_history) and not np.any(
      [np.any(np.asarray(h)) for h in jax.tree.leaves(state.amax_history)])
  one = train_loop.train_and_evaluate(config, str(tmp_path / 'a'), data=data, devices=devices)
  first = train_loop.train_and_evaluate(config, str(tmp_path / 'b'), data=data,
                                        devices=devices, stop_at=2)
  assert first['preempted'] and first['step'] == 2
  two = train_loop.train_and_evaluate(config, str(tmp_path / 'b'), data=data, devices=devices)
  assert one['eval_loss'] == two['eval_loss']
  states = []
  for name in ('a', 'b'):
    ckpt = train_loop.checkpointing.Checkpointer(str(tmp_path / name), 2)
    abstract = run.abstract_state
    fingerprint = train_loop.checkpointing.config_fingerprint(run.config, data.vocab_size)
    step, restored, _ = ckpt.restore(
        train_loop.checkpointing.abstract_like(abstract, run.state_shardings), fingerprint)
    ckpt.close()
    assert step == 4
    states.append(jax.tree.map(np.asarray, restored))
  jax.tree.map(np.testing.assert_array_equal, states[0], states[1])
  # Every projection observed 3 steps of amaxes (x, W, g; the last 3 of 4), all positive.
  for history in jax.tree.leaves(states[0].amax_history):
    assert history.shape == (config.model.num_layers, 3, 3) and np.all(history > 0), history


def test_the_controller_reads_an_overflowed_unit_as_risk():
  import gnmr_jax  # pylint: disable=g-import-not-at-top
  params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2)), 'c': jnp.ones((2, 2))}
  tx = gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=4, max_o=1, t_lock=2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3):  # calm: equal norms every step
    _, state = update(params, state)
  assert not any(jax.tree.leaves(gnmr_jax.recovery_mask(state)))
  overflow = {'a': False, 'b': True, 'c': True}
  _, state = update(params, state, overflow=overflow)
  # Both overflowed units are risky; the budget (max_o=1) takes the first in tree order.
  assert jax.tree.map(bool, gnmr_jax.recovery_mask(state)) == {'a': False, 'b': True,
                                                               'c': False}
  assert int(state.telemetry.num_risky) == 2


def test_auto_scaling_resolves_per_low_cost_path_and_platform():
  class Device:  # what resolve reads of a jax Device
    def __init__(self, platform):
      self.platform = platform
  table = {('fp8', 'cuda'): 'delayed', ('int8', 'gpu'): 'tensor', ('int8', 'tpu'): 'tensor',
           ('int8', 'cpu'): 'row', ('fp8', 'cpu'): 'row', ('bf16', 'gpu'): 'row'}
  for (path, platform), expect in table.items():
    assert scaling.resolve('auto', path, Device(platform)) == expect, (path, platform)
  assert scaling.resolve('tensor', 'fp8', Device('cpu')) == 'tensor'
  config = precision.default_precision_config()
  config.mode, config.low_cost_path, config.scaling = 'static', 'fp8', 'auto'
  assert precision.make_policy(config, device=Device('gpu')).takes_history
  assert precision.make_policy(config).low_cost is precision.fp8.PATH   # this CPU: 'row'
  assert scaling.resolved_config(config, Device('gpu')).scaling == 'delayed'
  assert config.scaling == 'auto'                                         # not changed in place


def test_delayed_scaling_on_an_explicit_mesh_matches_one_device():
  from gnmr_jax import sharding  # pylint: disable=g-import-not-at-top
  from gnmr_jax.model import PROJECTIONS, Transformer, init_amax_history  # pylint: disable=g-import-not-at-top
  from gnmr_jax.model_configs import model_config  # pylint: disable=g-import-not-at-top
  cfg = model_config('tiny')
  cfg.update(dict(vocab_size=192, d_model=64, num_layers=2, num_heads=2, num_kv_heads=2,
                  ffn_dim=128, max_seq_len=32))
  config = precision.default_precision_config()
  config.mode, config.low_cost_path, config.scaling = 'gnmr', 'fp8', 'delayed'
  config.recovery_storage = 'per_unit'
  model = Transformer(cfg, precision.make_policy(config))
  tokens = np.random.default_rng(0).integers(0, 192, (8, 33)).astype(np.int32)
  # a history from one earlier step: every scale set, none saturating by much
  history = jax.tree.map(lambda h: h.at[:, :, 0].set(jnp.array([4.0, 0.5, 1e-3])),
                         init_amax_history(cfg, 4))
  mask = {'layers': {g: {n: {'kernel': jnp.arange(2) == 0} for n in names}
                     for g, names in PROJECTIONS.items()}}

  def loss(params, history, inputs, targets):
    return model.apply({'params': params}, inputs, recovery_mask=mask, targets=targets,
                       amax_history=history) / targets.size

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  one_mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES, devices=jax.devices()[:1])
  with jax.set_mesh(one_mesh):
    params = jax.tree.map(np.asarray, sharding.init_params(model, jax.random.key(0), one_mesh))
  want_loss, (_, want_history) = step(params, history, tokens[:, :-1], tokens[:, 1:])
  mesh = jax.make_mesh((2, 2, 2), sharding.MESH_AXES)
  with jax.set_mesh(mesh):
    sharded = sharding.init_params(model, jax.random.key(0), mesh)
    batch = sharding.batch_sharding(mesh)
    with sharding.activation_sharding(mesh):
      got_loss, (_, got_history) = step(sharded, history, jax.device_put(tokens[:, :-1], batch),
                                        jax.device_put(tokens[:, 1:], batch))
  # Same params, other reduction orders (so an fp8 code at a rounding tie may flip): the
  # observed amaxes within one code step of their format (one e4m3 / e5m2 spacing at the top:
  # 2^-3 / 2^-2 relative), the weights' exactly (a max is order-free), the older columns as
  # given.
  assert np.isfinite(got_loss) and np.isfinite(want_loss)
  for got, want in zip(jax.tree.leaves(got_history), jax.tree.leaves(want_history)):
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])
    np.testing.assert_array_equal(got[:, 1, 0], want[:, 1, 0])
    assert_allclose(got[:, 0, 0], want[:, 0, 0], rtol=2.0 ** -3)
    assert_allclose(got[:, 2, 0], want[:, 2, 0], rtol=2.0 ** -2)


def _numpy_saturation(previous, current):
  """float64 [3] per-row saturation of one unit (delayed_scaling.saturation), from scratch: the
  largest observation of the previous history over the format's top, rounded up to a power of
  two (1 with no observation), times the top, divides this step's observation."""
  out = []
  for row, top in enumerate((448.0, 448.0, 57344.0)):
    amax = float(np.max(previous[row]))
    scale = 2.0 ** np.ceil(np.log2(amax / top)) if amax > 0 else 1.0
    out.append(float(current[row, 0]) / (scale * top))
  return np.array(out)


def test_train_step_logs_each_units_saturation_and_the_saturation_priority_recovers_it(
    data_dirs):
  # History of 1 step: a unit whose x, W or g amax grows past the power-of-two range of the
  # last step's saturates, which the first steps of training do.
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  from tests.train_helpers import small_config  # pylint: disable=g-import-not-at-top
  config = small_config(data_dirs, **{
      'precision.mode': 'gnmr', 'precision.low_cost_path': 'fp8',
      'precision.scaling': 'delayed', 'precision.amax_history_length': 1,
      'gnmr.priority': 'saturation', 'gnmr.t_lock': 0, 'gnmr.warmup': 0})
  config.gnmr.max_o = 7 * config.model.num_layers  # every unit fits: the mask is the rule's
  data = make_data(config.data)
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  names = run.unit_names
  it = data.train_iterator()
  saturated = 0
  with train_loop.sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(0))
    for _ in range(8):
      previous = jax.tree.map(np.asarray, state.amax_history)
      state, metrics = run.train_step(state, train_loop.device_batch(run, next(it)))
      current = jax.tree.map(np.asarray, state.amax_history)
      want = []
      for name in names:  # 'layers/<group>/<name>/kernel[<layer>]'
        _, group, proj, rest = name.split('/')
        layer = int(rest[len('kernel['):-1])
        want.append(np.max(_numpy_saturation(previous[group][proj][layer],
                                             current[group][proj][layer])))
      got = np.asarray(metrics['unit_saturation'])
      np.testing.assert_array_equal(got, np.asarray(want, np.float32))
      # The controller read saturation > 1 as the alarm: the next step's mask is that set.
      np.testing.assert_array_equal(np.asarray(metrics['unit_mask_next']), got > 1)
      saturated += int(np.sum(got > 1))
  assert saturated > 0  # the run had events to check


def test_saturation_priority_without_delayed_scaling_is_refused(data_dirs):
  from gnmr_jax.config import validate_config  # pylint: disable=g-import-not-at-top
  from tests.train_helpers import small_config  # pylint: disable=g-import-not-at-top
  config = small_config(data_dirs, **{'precision.mode': 'gnmr', 'precision.low_cost_path': 'fp8',
                                      'gnmr.priority': 'saturation'})
  with pytest.raises(ValueError, match="priority='saturation'.*precision.scaling='delayed'"):
    validate_config(config, device_count=1)


def test_the_unit_log_keeps_a_saturation_a_hair_over_one_over_one(tmp_path):
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  log = metrics_log.MetricsLogger(str(tmp_path), 1, tensorboard=False, progress_bar=False,
                                  unit_names=['a', 'b'])
  hair = np.nextafter(np.float32(1), np.float32(2))  # a weight clipped by one ulp
  log.units(1, mask=[False, False], score=[0.0, 0.0], gnmr=[1.0, 1.0], delta_gnmr=[1.0, 1.0],
            saturation=np.array([hair, 1.0], np.float32))
  log.close()
  row, = metrics_log.read_jsonl(str(tmp_path / metrics_log.UNITS_FILE))
  assert row['saturation'][0] > 1 and row['saturation'][1] == 1.0
  assert np.float32(row['saturation'][0]) == hair


def test_the_saturation_priority_recovers_a_saturated_unit_whose_norm_history_is_zero():
  # Step 1: every output gradient underflows (an empty history scales by 1), so the norms are 0;
  # step 2 saturates b. With no norm history the norm ratio is inf, and inf over the infinite
  # threshold must not make b's score NaN, which would rank it last and leave it unrecovered
  # (max_o smaller than the units, so the ranking decides).
  import gnmr_jax  # pylint: disable=g-import-not-at-top
  from gnmr_jax.control import research  # pylint: disable=g-import-not-at-top
  params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2)), 'c': jnp.ones((2, 2))}
  tx = research.saturation(max_o=1, t_lock=1)
  update = jax.jit(tx.update)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, state = update(zeros, state, params, overflow={'a': False, 'b': False, 'c': False})
  _, state = update(params, state, params, overflow={'a': False, 'b': True, 'c': True})
  assert jax.tree.map(bool, gnmr_jax.recovery_mask(state)) == {'a': False, 'b': True,
                                                               'c': False}
  assert all(np.all(np.isfinite(np.asarray(s))) for s in jax.tree.leaves(state.score))
  # Locked the next step (no saturation): still b, then free.
  _, state = update(params, state, params, overflow={'a': False, 'b': False, 'c': False})
  assert bool(gnmr_jax.recovery_mask(state)['b'])
  _, state = update(params, state, params, overflow={'a': False, 'b': False, 'c': False})
  assert not any(jax.tree.leaves(gnmr_jax.recovery_mask(state)))
