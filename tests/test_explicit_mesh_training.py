"""The Transformer and the train loop on explicit-axis meshes (jax.make_mesh's default).

Each parallelism (data, fsdp, tensor, a mix) gets a mesh of the user's own, built by
`jax.make_mesh(shape, sharding.MESH_AXES)` (explicit axes), and must give, for 3 routed
int8/bf16 steps, the losses, gradients and controller masks of the single-device run.
"""
import collections
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import gnmr_jax
from gnmr_jax import checkpointing, metrics_log, optim, sharding, train_loop
from gnmr_jax.config import base_config
from gnmr_jax.data import make_data
from gnmr_jax.model import PROJECTIONS, Transformer
from gnmr_jax.model_configs import model_config
from gnmr_jax.precision import make_policy
from tests.tolerances import BF16_EPS, F32_EPS, chain_ulps, f32_atol, transformer_reductions
from tests.train_helpers import small_config

STEPS = 3
BATCH = 8
# (data, fsdp, tensor): runlocal has 2 heads, so tensor parallelism is 2-way. Pure data
# parallelism is 'mix''s data axis and test_issue_scenario_value_and_grad_on_a_user_mesh's
# (8, 1, 1) (its own train steps cost ~40 s of the suite's budget, for nothing those miss).
PARALLELISMS = {'fsdp': (1, 8, 1), 'tensor': (1, 1, 2), 'mix': (2, 2, 2)}


def config_for(data_dirs, **overrides):
  return small_config(data_dirs, **{'data.batch_size': BATCH, 'train.steps': 8, **overrides})


@pytest.fixture(scope='module')
def data(data_dirs):
  return make_data(config_for(data_dirs).data)


def user_mesh(shape):
  devices = jax.devices()[:int(np.prod(shape))]
  return jax.make_mesh(shape, sharding.MESH_AXES, devices=devices)


def run_steps(run, batches):
  """Metrics of `STEPS` train steps, the gradients at the initial params on the first
  batch with every unit on the low-cost (False) or the recovery path (True), the final state
  and the initial params (host copies)."""
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
    initial = jax.tree.map(np.asarray, state.params)  # the steps donate the state
    metrics = []
    for batch in batches:
      state, step_metrics = run.train_step(state, train_loop.device_batch(run, batch))
      metrics.append({k: np.asarray(step_metrics[k]) for k in (
          'loss', 'grad_norm', 'unit_mask_used', 'unit_mask_next')})
  return metrics, grads, state, initial


@pytest.fixture(scope='module')
def single_device(data_dirs, data):
  config = config_for(data_dirs)  # one device, auto axes: the reference program
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  batches = [next(it) for it in [data.train_iterator()] for _ in range(STEPS)]
  metrics, grads, _, params = run_steps(run, batches)
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
  got, got_grads, state, _ = run_steps(run, batches)
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
    (lambda: user_mesh((3, 1, 1)), None, r'batch_size=8 must be divisible by data \* fsdp'),
    (lambda: jax.make_mesh((2, 2, 1, 2), sharding.MESH_AXES + ('pipe',)), None,
     r"unknown: \['pipe'\]"),
    (lambda: 'data=2,fsdp=4', None, 'must be a jax.sharding.Mesh'),
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


# The issue's scenario, verbatim: a user's `jax.make_mesh` (explicit axes), params from
# `sharding.init_params`, tokens placed by `sharding.batch_sharding`, and a jitted
# `value_and_grad` of the routed int8/bf16 Transformer with the recovery mask of a chained
# `gnmr_jax.gnmr`, under `sharding.activation_sharding`.
SCENARIO_SHAPES = [(1, 8, 1), (2, 2, 2), (8, 1, 1)]
SCENARIO_BATCH, SCENARIO_SEQ = 8, 32


def scenario_model():
  cfg = model_config('tiny')
  # vocab 192, d_model 64, ffn 128: every weight shape tells which weight it is in the HLO.
  cfg.update(dict(vocab_size=192, d_model=64, num_layers=2, num_heads=2, num_kv_heads=2,
                  ffn_dim=128, max_seq_len=SCENARIO_SEQ))
  precision = base_config('tiny').precision
  precision.update(dict(mode='gnmr', low_cost_path='int8', recovery_path='bf16'))
  return cfg, Transformer(cfg, make_policy(precision, max_recovered=2))


def scenario_loss(model, params, inputs, targets, mask):
  logits = model.apply({'params': params}, inputs, recovery_mask=mask)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def scenario_masks(params):
  """The controller's mask (all low-cost before its warmup ends) and one that recovers the
  even layers' units (both lax.cond branches run)."""
  tx = optax.chain(gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=3, max_o=2, t_lock=2,
                                 units=r'layers/.*kernel', layer_axis=r'^layers/'),
                   optax.adamw(1e-3))
  mask = gnmr_jax.recovery_mask(jax.jit(tx.init)(params))
  half = jax.tree.map(lambda m: m | (jnp.arange(m.shape[0]) % 2 == 0) if m.ndim else m, mask)
  return {'controller': mask, 'even_layers': half}


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]], int, str]]:
  """(op, result shapes, group size, op_name) of every collective in a compiled module."""
  found = []
  for line in hlo.splitlines():
    m = re.search(r'= (\([^=]*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|'
                  r'collective-permute)(?:-start)?\(', line)
    if not m:
      continue
    shapes = [tuple(int(d) for d in dims.split(',') if d)
              for dims in re.findall(r'[a-z0-9]+\[([0-9,]*)\]', m.group(1))]
    groups = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    size = 1
    if groups:
      sizes = dict(re.findall(r"'(\w+)'=(\d+)", groups.group(1)))
      for axis in re.findall(r"'(\w+)'", groups.group(2)):
        size *= int(sizes[axis])
    name = re.search(r'op_name="([^"]*)"', line)
    found.append((m.group(2), shapes, size, name.group(1) if name else ''))
  return found


@pytest.fixture(scope='module')
def scenario_reference():
  """Params (host copies), batch, masks, and loss and gradients of one device, no mesh."""
  cfg, model = scenario_model()
  mesh = jax.make_mesh((1, 8, 1), sharding.MESH_AXES)
  with jax.set_mesh(mesh):
    params = jax.tree.map(np.asarray, sharding.init_params(model, jax.random.key(0), mesh))
  tokens = np.random.default_rng(0).integers(
      0, cfg.vocab_size, (SCENARIO_BATCH, SCENARIO_SEQ + 1)).astype(np.int32)
  masks = jax.tree.map(np.asarray, scenario_masks(params))
  step = jax.jit(jax.value_and_grad(functools.partial(scenario_loss, model)))
  want = {k: jax.tree.map(np.asarray, step(params, tokens[:, :-1], tokens[:, 1:], m))
          for k, m in masks.items()}
  max_logit = float(np.max(np.abs(jax.jit(model.apply)({'params': params}, tokens[:, :-1]))))
  return cfg, model, params, tokens, masks, want, max_logit


@pytest.mark.parametrize('shape', SCENARIO_SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_issue_scenario_value_and_grad_on_a_user_mesh(shape, scenario_reference):
  cfg, model, host_params, tokens, host_masks, want, max_logit = scenario_reference
  mesh = jax.make_mesh(shape, sharding.MESH_AXES)
  assert set(mesh.axis_types) == {AxisType.Explicit}
  with jax.set_mesh(mesh):
    params = sharding.init_params(model, jax.random.key(0), mesh)
    masks = scenario_masks(params)
    batch = sharding.batch_sharding(mesh)
    inputs = jax.device_put(tokens[:, :-1], batch)
    targets = jax.device_put(tokens[:, 1:], batch)
    with sharding.activation_sharding(mesh):
      step = jax.jit(jax.value_and_grad(functools.partial(scenario_loss, model)))
      got = {k: step(params, inputs, targets, m) for k, m in masks.items()}
      compiled = step.lower(params, inputs, targets, masks['controller']).compile()
  # The same init in its sharded layout, and the controller's mask, exactly.
  for p, w in zip(jax.tree.leaves(params), jax.tree.leaves(host_params)):
    np.testing.assert_array_equal(np.asarray(p), w)
  for k in masks:
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, masks[k]),
                 host_masks[k])
  # Tolerances as in test_explicit_mesh_routed_steps_match_single_device (step 1): the
  # forward's float32 rounding for the loss, sqrt(R) flipped operand roundings for the
  # gradients (int8 codes: 1/127 of a row's scale, the larger of the two paths).
  tokens_count = SCENARIO_BATCH * SCENARIO_SEQ
  rounding = 2 * chain_ulps(transformer_reductions(cfg, SCENARIO_SEQ)) * F32_EPS * max_logit
  bound_eps = np.sqrt(quantized_roundings(cfg)) / 127
  for k, (loss, grads) in got.items():
    want_loss, want_grads = want[k]
    assert abs(float(loss) - float(want_loss)) <= rounding + f32_atol(
        want_loss, chain_ulps([cfg.vocab_size, tokens_count])), (shape, k)
    for (path, g), w, p in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                               jax.tree.leaves(want_grads), jax.tree.leaves(params)):
      assert g.sharding.is_equivalent_to(p.sharding, g.ndim), jax.tree_util.keystr(path)
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      assert np.linalg.norm(g - w) <= bound_eps * np.linalg.norm(w), (
          shape, k, jax.tree_util.keystr(path))
  if shape != (1, 8, 1):
    return
  # FSDP over 8 devices: each device holds 1/8 of every weight; only the norms' scales are
  # whole (replicated by the rules).
  leaves = jax.tree.leaves(params)
  total = sum(p.nbytes for p in leaves)
  per_device = sum(p.addressable_shards[0].data.nbytes for p in leaves)
  replicated = sum(p.nbytes for p in leaves if p.sharding.is_fully_replicated)
  print(f'scenario fsdp=8 per-device parameter bytes: {per_device} of {total} '
        f'(1/8: {total / 8:.0f}; replicated norms: {replicated})')
  assert per_device <= total / 8 + replicated and replicated < total / 100
  # The compiled step's collectives over the 8 fsdp devices: each weight is all-gathered to
  # its whole (per-layer) shape where it is used (`sharding.gather_weight`), and nothing else
  # is; each weight's gradient is summed over the 8 devices and comes back sharded like the
  # weight (asserted above): a reduce-scatter. XLA:CPU writes a reduce-scatter as an
  # all-reduce and a dynamic-slice of the device's shard (its pipeline has no reduce-scatter
  # creator pass; GPU and TPU fuse the two), so either form counts.
  ops = collectives(compiled.as_text())
  d, f, v = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
  kernel_shapes = {'q': (d, d), 'k': (d, d), 'v': (d, d), 'o': (d, d), 'gate': (d, f),
                   'up': (d, f), 'down': (f, d)}
  gathers = [(shapes[0], name) for op, shapes, size, name in ops if op == 'all-gather']
  print(f'scenario fsdp=8 collectives: {collections.Counter(op for op, *_ in ops)}')
  assert all(name.endswith('/reshard') for _, name in gathers), gathers
  wanted = {f'layers/{g}/{n}/reshard': kernel_shapes[n] for g, names in PROJECTIONS.items()
            for n in names}
  wanted.update({'embed/reshard': (v, d), 'jvp(Transformer)/reshard': (d, v)})
  for suffix, weight_shape in wanted.items():
    assert [s for s, name in gathers if name.endswith(suffix)] == [weight_shape], suffix
  assert len(gathers) == len(wanted), gathers  # no activation is gathered
  summed = [(s, name) for op, shapes, size, name in ops
            if op in ('all-reduce', 'reduce-scatter') and size == 8 for s in shapes]
  for g, names in PROJECTIONS.items():
    for n in names:  # one sum per lax.cond branch (int8: int32 partials; bf16: float32)
      assert sum(s == kernel_shapes[n] and 'transpose(jvp(Transformer))/while/body/' in name
                 and f'layers/{g}/{n}/cond/' in name for s, name in summed) == 2, (g, n)
  shapes = [s for s, _ in summed]
  # The embedding table's and lm_head's (XLA may compute the latter transposed, [V, D]).
  assert sum(s in ((v, d), (d, v)) for s in shapes) >= 2, shapes
  with jax.set_mesh(mesh):
    grads_bytes = sum(x.addressable_shards[0].data.nbytes
                      for x in jax.tree.leaves(got['controller'][1]))
  assert grads_bytes == per_device


def restore_newest(workdir, run):
  """The newest checkpoint in `workdir` restored into the state of `run` (a train_loop.build
  result): (step, host arrays, the restored leaves' shardings)."""
  ckpt = checkpointing.Checkpointer(workdir, 2)
  with sharding.activation_sharding(run.mesh):
    abstract = run.abstract_state
    step, state, _ = ckpt.restore(checkpointing.abstract_like(abstract, run.state_shardings),
                                  checkpointing.config_fingerprint(run.config,
                                                                   run.data.vocab_size))
  ckpt.close()
  return step, jax.tree.map(np.asarray, state), [x.sharding for x in jax.tree.leaves(state)]


@pytest.mark.plumbing  # restore and resume: both sides of each comparison without XLA optimizations
def test_checkpoints_restore_across_axis_types_and_resume_exactly(tmp_path, data_dirs, data):
  """A checkpoint written under auto axes restores under explicit ones and the other way
  round, bit for bit, into the other run's shardings; a run resumed under explicit axes
  continues bit for bit (the same compiled step on the same state)."""
  shape = (2, 2, 2)
  config = config_for(data_dirs, **{'train.steps': 4, 'checkpoint.every_steps': 0,
                                    'train.eval_every': 0, 'logging.log_every': 1})
  auto = ml_collections.ConfigDict(config.to_dict())
  auto.mesh.update(dict(zip(sharding.MESH_AXES, shape), axis_types='auto'))
  losses = lambda w: [r['loss'] for r in metrics_log.read_jsonl(
      os.path.join(w, metrics_log.METRICS_FILE))]
  whole = train_loop.train_and_evaluate(config, str(tmp_path / 'whole'), data=data,
                                        mesh=user_mesh(shape))
  # The runs that restore (built once: each restore reads the newest checkpoint afresh).
  auto_run = train_loop.build(auto, data=data)
  explicit_run = train_loop.build(config, data=data, mesh=user_mesh(shape))
  for writer in ('explicit', 'auto'):
    workdir = str(tmp_path / writer)
    first = train_loop.train_and_evaluate(
        auto if writer == 'auto' else config, workdir, data=data, stop_at=2,
        mesh=None if writer == 'auto' else user_mesh(shape))
    assert first['preempted'] and first['step'] == 2
    step_a, state_a, shardings_a = restore_newest(workdir, auto_run)
    step_e, state_e, shardings_e = restore_newest(workdir, explicit_run)
    assert step_a == step_e == 2
    jax.tree.map(np.testing.assert_array_equal, state_a, state_e)
    assert {s.mesh.axis_types for s in shardings_a} == {(AxisType.Auto,) * 3}
    assert {s.mesh.axis_types for s in shardings_e} == {(AxisType.Explicit,) * 3}
    assert [s.spec for s in shardings_a] == [s.spec for s in shardings_e]
    # Resumed under explicit axes.
    second = train_loop.train_and_evaluate(config, workdir, data=data, mesh=user_mesh(shape))
    assert second['resumed_from_step'] == 2 and second['step'] == 4
    assert second['corrupted_checkpoints'] == []
    if writer == 'explicit':  # one axis type throughout: exact
      assert losses(workdir) == losses(tmp_path / 'whole') and len(losses(workdir)) == 4
      assert second['eval_loss'] == whole['eval_loss']
      _, got, _ = restore_newest(workdir, explicit_run)
      _, want, _ = restore_newest(str(tmp_path / 'whole'), explicit_run)
      jax.tree.map(np.testing.assert_array_equal, got, want)
    else:
      assert all(np.isfinite(losses(workdir)))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train_py(workdir, data_dirs, *flags):
  """train.py on configs/tiny.py:runlocal over 8 simulated CPU devices."""
  cmd = [sys.executable, os.path.join(REPO, 'train.py'), '--config',
         os.path.join(REPO, 'configs/tiny.py') + ':runlocal', f'--workdir={workdir}',
         f'--config.data.data_dir={data_dirs[0]}', f'--config.data.sdist_path={data_dirs[1]}',
         '--config.logging.plots=False', '--config.data.batch_size=8', *flags]
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
         'JAX_PLATFORMS': 'cpu'}
  return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


@pytest.mark.plumbing  # train.py's runs, resume and refusals; no XLA optimizations
def test_train_py_on_an_explicit_mesh_trains_resumes_and_names_bad_meshes(tmp_path, data_dirs):
  workdir = str(tmp_path / 'run')
  mesh_flags = ('--config.mesh.axis_types=explicit', '--config.mesh.data=2',
                '--config.mesh.fsdp=2', '--config.mesh.tensor=2')
  out = run_train_py(workdir, data_dirs, '--config.train.steps=4', *mesh_flags)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'validation perplexity' in out.stdout
  summary = json.load(open(os.path.join(workdir, metrics_log.SUMMARY_FILE)))
  assert summary['step'] == 4 and np.isfinite(summary['eval_loss'])
  # The same workdir, more steps: resumes at 4 on the explicit mesh.
  out = run_train_py(workdir, data_dirs, '--config.train.steps=6', *mesh_flags)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.load(open(os.path.join(workdir, metrics_log.SUMMARY_FILE)))
  assert summary['step'] == 6 and summary['resumed_from_step'] == 4
  rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.METRICS_FILE))
  assert [r['step'] for r in rows] == [2, 4, 6] and all(np.isfinite(r['loss']) for r in rows)
  # Bad axis types and meshes that do not fit end with one line naming them (exit 2).
  for flags, match in [(('--config.mesh.axis_types=manual',), 'mesh.axis_types'),
                       (('--config.mesh.axis_types=explicit', '--config.mesh.tensor=8',
                         '--config.mesh.fsdp=1'), 'num_heads=2 % tensor=8')]:
    out = run_train_py(str(tmp_path / 'bad'), data_dirs, *flags)
    assert out.returncode == 2 and match in out.stderr, out.stderr[-2000:]
    assert 'Traceback' not in out.stderr
