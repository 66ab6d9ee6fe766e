"""The Transformer and the train loop on explicit-axis meshes (jax.make_mesh's default).

Each parallelism (data, fsdp, tensor, a mix) gets a mesh of the user's own, built by
`jax.make_mesh(shape, sharding.MESH_AXES)` (explicit axes), and must give, for 3 routed
int8/bf16 steps, the losses, gradients and controller masks of the single-device run.
"""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import AxisType

from gnmr_jax import optim, sharding, train_loop
from gnmr_jax.data import make_data
from tests.tolerances import BF16_EPS, F32_EPS, chain_ulps, f32_atol, transformer_reductions
from tests.train_helpers import small_config

STEPS = 3
BATCH = 8
# (data, fsdp, tensor): runlocal has 2 heads, so tensor parallelism is 2-way.
PARALLELISMS = {'data': (8, 1, 1), 'fsdp': (1, 8, 1), 'tensor': (1, 1, 2), 'mix': (2, 2, 2)}


def config_for(data_dirs, **overrides):
  return small_config(data_dirs, **{'data.batch_size': BATCH, 'train.steps': 8, **overrides})


@pytest.fixture(scope='module')
def data(data_dirs):
  return make_data(config_for(data_dirs).data)


def user_mesh(shape):
  devices = jax.devices()[:int(np.prod(shape))]
  return jax.make_mesh(shape, sharding.MESH_AXES, devices=devices)


def run_steps(run, batches):
  """Metrics of `STEPS` train steps, and the gradients at the initial params on the first
  batch with every unit on the low-cost (False) or the recovery path (True)."""
  num_layers = run.model_config.num_layers

  def grad(params, batch, bit):
    mask = jax.tree.map(lambda p: jnp.full((num_layers,), bit), params)
    loss = lambda p: train_loop.cross_entropy(
        run.model.apply({'params': p}, batch['inputs'], recovery_mask=mask),
        batch['targets'])[0]
    return jax.grad(loss)(params)

  grad = jax.jit(grad)
  with sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(0))
    first = train_loop.device_batch(run, batches[0])
    grads = {bit: jax.tree.map(np.asarray, grad(state.params, first, jnp.asarray(bit)))
             for bit in (False, True)}
    metrics = []
    for batch in batches:
      state, step_metrics = run.train_step(state, train_loop.device_batch(run, batch))
      metrics.append({k: np.asarray(step_metrics[k]) for k in (
          'loss', 'grad_norm', 'unit_mask_used', 'unit_mask_next')})
  return metrics, grads, state


@pytest.fixture(scope='module')
def single_device(data_dirs, data):
  config = config_for(data_dirs)  # one device, auto axes: the reference program
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  batches = [next(it) for it in [data.train_iterator()] for _ in range(STEPS)]
  metrics, grads, _ = run_steps(run, batches)
  params = jax.jit(run.init_state)(jax.random.key(0)).params
  max_logit = float(np.max(np.abs(jax.jit(run.model.apply)({'params': params},
                                                            batches[0]['inputs']))))
  num_params = sum(p.size for p in jax.tree.leaves(params))
  return config, run, batches, metrics, grads, max_logit, num_params


def quantized_roundings(model_cfg):
  """Operand roundings (to int8 or bf16) on a gradient's path: 2 operands x 3 matmuls
  (forward, dlhs, drhs) x 7 projections per layer."""
  return 2 * 3 * 7 * model_cfg.num_layers


@pytest.mark.parametrize('parallelism', sorted(PARALLELISMS))
def test_explicit_mesh_routed_steps_match_single_device(parallelism, single_device, data):
  config, single, batches, want, want_grads, max_logit, num_params = single_device
  mesh = user_mesh(PARALLELISMS[parallelism])
  assert set(mesh.axis_types) == {AxisType.Explicit}  # jax.make_mesh's default
  run = train_loop.build(config, data=data, mesh=mesh)
  assert run.config.mesh.axis_types == 'explicit'
  got, got_grads, state = run_steps(run, batches)
  model_cfg = run.model_config
  tokens = batches[0]['inputs'].size
  # Gradients: a reordered float32 sum can flip the rounding of a quantized operand (an
  # int8 code: 1/127 of its row's scale; a bf16 value: eps_bf16), and such flips add up
  # like a random walk over the R roundings on a gradient's path: a norm-wise drift of
  # sqrt(R) eps_q (tests/tolerances.py), far below a wrong reduction (a factor >= 2).
  rounding_count = quantized_roundings(model_cfg)
  for bit, eps_q in ((False, 1 / 127), (True, BF16_EPS)):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got_grads[bit])[0],
                            jax.tree.leaves(want_grads[bit])):
      g, w = g.astype(np.float64), w.astype(np.float64)
      bound = np.sqrt(rounding_count) * eps_q * np.linalg.norm(w)
      assert np.linalg.norm(g - w) <= bound, (parallelism, bit, jax.tree_util.keystr(path))
  # Losses: step 1 at the same params differs by the forward's float32 rounding (the logits
  # z move by <= f32_atol(z, chain), the mean cross entropy by <= 2 max|dz|, plus the sums
  # over vocabulary and tokens). Step k also at params Adam moved apart by <= 2 sum lr_t
  # per entry (Kingma and Ba 2015, sec. 2.1; test_train.py), so by <= that x sqrt(P) in
  # norm, which moves the loss by <= |grad L| |d params| (first order, Cauchy-Schwarz).
  forward_ulps = chain_ulps(transformer_reductions(model_cfg, config.data.seq_len))
  rounding = 2 * forward_ulps * F32_EPS * max_logit + f32_atol(
      want[0]['loss'], chain_ulps([model_cfg.vocab_size, tokens]))
  schedule = optim.learning_rate_schedule(config.optimizer, config.train.steps)
  for k in range(STEPS):
    apart = 2 * sum(float(schedule(t)) for t in range(k)) * np.sqrt(num_params)
    grad_norm = max(float(got[k]['grad_norm']), float(want[k]['grad_norm']))
    assert abs(float(got[k]['loss']) - float(want[k]['loss'])) <= rounding + grad_norm * apart
    # The controller's decisions: the same masks, exactly.
    np.testing.assert_array_equal(got[k]['unit_mask_used'], want[k]['unit_mask_used'])
    np.testing.assert_array_equal(got[k]['unit_mask_next'], want[k]['unit_mask_next'])
  q = state.params['layers']['attn']['q']['kernel']
  assert q.sharding.mesh.axis_types == mesh.axis_types and not q.sharding.is_fully_replicated \
      or parallelism == 'data'
  if parallelism == 'fsdp':
    # No accidental replication: each device holds 1/8 of every sharded leaf; only the
    # norms' scales (replicated by the rules) are whole on every device.
    leaves = jax.tree.leaves(state.params)
    total = sum(p.nbytes for p in leaves)
    per_device = sum(p.addressable_shards[0].data.nbytes for p in leaves)
    replicated = sum(p.nbytes for p in leaves if p.sharding.is_fully_replicated)
    print(f'fsdp=8 per-device parameter bytes: {per_device} of {total} '
          f'(1/8: {total / 8:.0f}; replicated norms: {replicated})')
    assert per_device <= total / 8 + replicated
    assert replicated < total / 100


@pytest.mark.parametrize('mesh_fn, devices, match', [
    (lambda: jax.make_mesh((8,), ('batch',)), None, r"missing: \['data', 'fsdp', 'tensor'\]"),
    (lambda: jax.make_mesh((1, 1, 8), sharding.MESH_AXES), None, r'num_heads=2 % tensor=8'),
    (lambda: user_mesh((8, 1, 1)), jax.devices()[:1], 'not both'),
])
def test_a_user_mesh_is_checked_up_front(mesh_fn, devices, match, data_dirs, data):
  with pytest.raises(ValueError, match=match):
    train_loop.build(config_for(data_dirs), data=data, mesh=mesh_fn(), devices=devices)


def test_mesh_axis_types_config():
  cfg = ml_collections.ConfigDict(dict(data=2, fsdp=-1, tensor=2, axis_types='explicit'))
  assert sharding.make_mesh(cfg).axis_types == (AxisType.Explicit,) * 3
  cfg.axis_types = 'explicit,auto,auto'
  assert sharding.make_mesh(cfg).axis_types == (AxisType.Explicit, AxisType.Auto, AxisType.Auto)
  for bad in ('manual', 'explicit,auto', 3):
    with pytest.raises(ValueError, match='mesh.axis_types'):
      sharding.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1,
                                                        axis_types=bad)))
