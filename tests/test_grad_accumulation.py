"""Gradient accumulation (config.train.grad_accum_steps, gnmr_jax/grad_accumulation.py): the
step over k micro-batches against the step over the whole batch, on 8 simulated devices."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gnmr_jax import grad_accumulation, train_loop
from gnmr_jax import train_step as step_lib
from gnmr_jax.control import state as control_state
from gnmr_jax.data import make_data
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import registry
from gnmr_jax.sharding import MESH_AXES
from tolerances import F32_EPS, chain_ulps, transformer_reductions
from train_helpers import small_config

ACCUM = 4
BATCH = 16  # micro-batches of 4 rows: one per (data, fsdp) shard of a 2 x 2 x 2 mesh
SENTINEL = 255  # a byte the corpus never holds: the row that carries it poisons its micro-batch
GRADIENT_STEPS = (1, 5, 9, 10, 15, 20)  # first, before, during and after the spike, NaN, last


def test_micro_batches_split_each_devices_rows_without_communication():
  mesh = jax.make_mesh((4, 2, 1), MESH_AXES)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  rows = np.arange(BATCH * 3, dtype=np.int32).reshape(BATCH, 3)
  split = jax.jit(lambda b: grad_accumulation.micro_batches(b, 2))
  out = split(jax.device_put(rows, sharding))
  np.testing.assert_array_equal(out, np.stack([rows[0::2], rows[1::2]]))
  hlo = split.lower(jax.device_put(rows, sharding)).compile().as_text()
  for collective in ("all-to-all", "all-gather", "collective-permute", "all-reduce"):
    assert collective not in hlo, collective
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    grad_accumulation.micro_batches({"inputs": rows}, 3)


def _f32_path():
  def matmul(a, b, out_dtype):
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).astype(out_dtype)
  return path_lib.three_leg_path(matmul, matmul, matmul)


def _float32_routed_config(data_dirs, **overrides):
  """The routed tiny model entirely in float32 (a float32 path on both sides of the cond): the
  two steps then differ only in the order of float32 additions, no rounding of a quantizer."""
  if "test_accum_f32" not in registry.available_paths():
    registry.register_path("test_accum_f32", lambda config, role: _f32_path())
  config = small_config(data_dirs, **{"data.batch_size": BATCH, **overrides})
  config.precision.update(low_cost_path="test_accum_f32", recovery_path="test_accum_f32")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  return config


class _PoisonRows:
  """The model, with the loss of any (micro-)batch holding SENTINEL times NaN: a non-finite
  micro-batch (its gradients NaN too)."""

  def __init__(self, model):
    self.model = model

  def apply(self, variables, inputs, **kwargs):
    out = self.model.apply(variables, inputs, **kwargs)
    poison = jnp.where(jnp.any(inputs == SENTINEL), jnp.nan, 1.0)
    if isinstance(out, tuple):
      return out[0] * poison, out[1]
    return out * poison


def _controller_fields(opt_state):
  ctl = control_state.maybe_controller_state(opt_state, flat=True)
  return {f: np.asarray(getattr(ctl, f).values if hasattr(getattr(ctl, f), "values")
                        else getattr(ctl, f))
          for f in ("mask", "lock", "norm", "gnmr", "delta_gnmr", "score", "risky",
                    "norm_sum", "norm_count", "window")}


def test_accumulated_step_equals_the_whole_batch_step_with_a_spike_and_a_nan_micro_batch(
    data_dirs):
  # A x30 spike of one unit's gradient at steps 9-10; step 15's batch has one poisoned row
  # (one micro-batch's loss and gradients NaN: the whole step is skipped, as without
  # accumulation).
  faults = {"faults.enabled": True, "faults.schedule": "9:3:scale:30:2"}
  configs = [_float32_routed_config(data_dirs, **faults, **{"train.grad_accum_steps": k})
             for k in (1, ACCUM)]
  data = make_data(configs[0].data)
  whole, accumulated = (train_loop.build(c, data=data) for c in configs)
  specs = [dataclasses.replace(r.spec, model=_PoisonRows(r.spec.model))
           for r in (whole, accumulated)]
  steps = [jax.jit(lambda s, b, spec=spec: step_lib.train_step(s, b, spec=spec))
           for spec in specs]
  grads_fns = [jax.jit(lambda s, b, spec=spec: step_lib.loss_and_grads(
      spec, s, b, *step_lib._mask_of(spec, s.opt_state))[1][0]) for spec in specs]
  it = data.train_iterator()
  tokens = BATCH * configs[0].data.seq_len
  # Both sides sum the same float32 per-token terms in a different order; their drift is that of
  # the chain of sums from a token to the loss, then over the batch's tokens (tolerances.py).
  grad_ulps = chain_ulps(transformer_reductions(configs[0].model, configs[0].data.seq_len)
                         + [configs[0].model.vocab_size, tokens])
  with train_loop.sharding.activation_sharding(whole.mesh):
    state = whole.init_state(jax.random.key(0))
    for t in range(1, 21):
      batch = next(it)
      if t == 15:
        batch = {k: np.array(v) for k, v in batch.items()}
        batch["inputs"][5, 3] = SENTINEL  # row 5: micro-batch 1 of 4
      batch = train_loop.device_batch(whole, batch)
      (s1, m1), (s2, m2) = (step(state, batch) for step in steps)
      if t == 15:
        assert not np.isfinite(m1["loss"]) and not np.isfinite(m2["loss"])
        jax.tree.map(np.testing.assert_array_equal, s1.params, state.params)
        jax.tree.map(np.testing.assert_array_equal, s2.params, state.params)
      else:
        np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=F32_EPS * grad_ulps)
      if t in GRADIENT_STEPS:  # every leaf; at the other steps, their per-unit norms below
        g1, g2 = (jax.tree.map(np.asarray, fn(state, batch)) for fn in grads_fns)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
          if t == 15:
            assert not np.isfinite(a).all() and not np.isfinite(b).all()
          else:
            np.testing.assert_allclose(b, a, rtol=0,
                                       atol=F32_EPS * grad_ulps * np.max(np.abs(a)))
      c1, c2 = _controller_fields(s1.opt_state), _controller_fields(s2.opt_state)
      for field in ("mask", "lock", "risky", "norm_count"):
        np.testing.assert_array_equal(c2[field], c1[field], err_msg=f"{field} at step {t}")
      for field in ("norm", "gnmr", "delta_gnmr", "score", "norm_sum", "window"):
        # Ratios and sums of gradient norms: a few times the gradients' relative drift.
        np.testing.assert_allclose(c2[field], c1[field], rtol=8 * F32_EPS * grad_ulps,
                                   err_msg=f"{field} at step {t}")
      if t == 10:  # the spike is the controller's: the unit is in the next mask on both sides
        assert c1["mask"].any()
      state = s1


def _micro_batch_runs(data_dirs):
  """optax.MultiSteps over micro-batches of BATCH / ACCUM rows, with the controller inside
  (MultiSteps(chain(controller, ...))) and outside (chain(controller, MultiSteps(...)))."""
  from gnmr_jax import control, optim  # pylint: disable=g-import-not-at-top
  micro = _float32_routed_config(data_dirs, **{"data.batch_size": BATCH // ACCUM})

  def inside(config):
    return optax.MultiSteps(optim.make_optimizer(config), ACCUM).gradient_transformation()

  def outside(config):
    rest = config.copy_and_resolve_references()
    rest.gnmr.enabled = False
    return optax.chain(control.from_config(config.gnmr, config.train.seed),
                       optax.MultiSteps(optim.make_optimizer(rest), ACCUM)
                       .gradient_transformation())

  data = make_data(micro.data)
  return {name: train_loop.build(micro, data=data, make_tx=make_tx)
          for name, make_tx in (("inside", inside), ("outside", outside))}


def test_multisteps_with_the_controller_inside_is_the_accumulated_step_and_outside_is_not(
    data_dirs):
  config = _float32_routed_config(data_dirs, **{"train.grad_accum_steps": ACCUM})
  data = make_data(config.data)
  accumulated = train_loop.build(config, data=data)
  runs = _micro_batch_runs(data_dirs)
  batches = [next(it) for it in [data.train_iterator()] for _ in range(2)]
  ulps = chain_ulps(transformer_reductions(config.model, config.data.seq_len)
                    + [config.model.vocab_size, BATCH * config.data.seq_len, ACCUM])
  with train_loop.sharding.activation_sharding(accumulated.mesh):
    state = accumulated.init_state(jax.random.key(0))
    states = {name: run.init_state(jax.random.key(0)) for name, run in runs.items()}
    for t, batch in enumerate(batches, start=1):
      state, _ = accumulated.train_step(state, train_loop.device_batch(accumulated, batch))
      want = _controller_fields(state.opt_state)
      micro_norms = []
      for i in range(ACCUM):
        micro = {k: v[i::ACCUM] for k, v in batch.items()}  # the accumulated step's split
        for name, run in runs.items():
          states[name], _ = run.train_step(states[name], train_loop.device_batch(run, micro))
        micro_norms.append(_controller_fields(states["outside"].opt_state)["norm"])
      inside = _controller_fields(states["inside"].opt_state)
      # Inside: once per window, on the window's mean gradient: the accumulated step's
      # statistics (MultiSteps' running mean adds one rounding per micro-batch).
      for field in ("mask", "lock", "risky", "norm_count"):
        np.testing.assert_array_equal(inside[field], want[field], err_msg=f"{field}, step {t}")
      rtol = F32_EPS * ulps if t == 1 else 1e-4  # step 2: after one Adam step from each
      np.testing.assert_allclose(inside["norm"], want["norm"], rtol=rtol)
      outside = _controller_fields(states["outside"].opt_state)
      # Outside: every micro-batch is a controller step, ranked on its own gradient ...
      np.testing.assert_array_equal(outside["norm_count"], ACCUM * want["norm_count"])
      if t == 1:  # ... whose mean square exceeds the step gradient's (Jensen; same params)
        mean_sq = np.mean(np.square(micro_norms), axis=0)
        assert np.all(mean_sq >= want["norm"] ** 2 * (1 - 4 * F32_EPS * ulps))
        assert np.median(mean_sq / want["norm"] ** 2) > 1.5, mean_sq / want["norm"] ** 2


def test_accumulation_config_errors_name_the_field(data_dirs):
  from gnmr_jax.config import validate_config  # pylint: disable=g-import-not-at-top
  for value, match in ((0, "grad_accum_steps must be an integer >= 1"),
                       (3, "grad_accum_steps=3 must divide config.data.batch_size=16")):
    with pytest.raises(ValueError, match=match):
      validate_config(_float32_routed_config(data_dirs, **{"train.grad_accum_steps": value}))
  with pytest.raises(ValueError, match=r"micro-batch data.batch_size / train.grad_accum_steps=2 "
                                       r"must be divisible by data \* fsdp"):
    train_loop.build(_float32_routed_config(data_dirs, **{"train.grad_accum_steps": 8}))


def test_delayed_scaling_histories_combine_by_max_and_settle_a_nan_micro_batch(data_dirs):
  configs = [_float32_routed_config(data_dirs, **{"train.grad_accum_steps": k}) for k in (1, ACCUM)]
  for config in configs:
    config.precision.update(low_cost_path="fp8", recovery_path="bf16", scaling="delayed")
  data = make_data(configs[0].data)
  runs = [train_loop.build(c, data=data) for c in configs]
  fns = [jax.jit(lambda s, b, spec=dataclasses.replace(r.spec, model=_PoisonRows(r.spec.model)):
                 step_lib.loss_and_grads(spec, s, b, *step_lib._mask_of(spec, s.opt_state))[1][1])
         for r in runs]
  it = data.train_iterator()
  with train_loop.sharding.activation_sharding(runs[0].mesh):
    state = runs[0].init_state(jax.random.key(0))
    for t in range(1, 4):
      batch = next(it)
      if t == 3:
        batch = {k: np.array(v) for k, v in batch.items()}
        batch["inputs"][6, 0] = SENTINEL  # row 6: micro-batch 2 of 4
      batch = train_loop.device_batch(runs[0], batch)
      whole, accumulated = (jax.tree.map(np.asarray, fn(state, batch)) for fn in fns)
      for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(accumulated)):
        np.testing.assert_array_equal(b[..., 1:], a[..., 1:])  # older columns: as they were
        # The newest: the amax of the same fp8 codes (one code apart at most where a reordered
        # float32 sum rounded across a code boundary: e4m3 2^-3, e5m2 2^-2 relative).
        np.testing.assert_allclose(b[..., 0, 0], a[..., 0, 0], rtol=2.0 ** -3)   # x
        np.testing.assert_array_equal(b[..., 1, 0], a[..., 1, 0])                # W: whole
        np.testing.assert_allclose(b[..., 2, 0], a[..., 2, 0], rtol=2.0 ** -2)   # g
        if t == 3:  # a NaN in one micro-batch settles as in the whole batch: no observation
          assert not np.any(a[..., 2, 0]) and not np.any(b[..., 2, 0])
        else:
          assert np.all(a[..., :, 0] > 0)
      state, _ = runs[0].train_step(state, batch)


def test_accumulation_on_an_explicit_mesh_matches_the_whole_batch(data_dirs):
  configs = [_float32_routed_config(data_dirs, **{"train.grad_accum_steps": k}) for k in (1, ACCUM)]
  data = make_data(configs[0].data)
  batch = next(data.train_iterator())
  ulps = chain_ulps(transformer_reductions(configs[0].model, configs[0].data.seq_len)
                    + [configs[0].model.vocab_size, BATCH * configs[0].data.seq_len])
  results = []
  for config in configs:
    run = train_loop.build(config, data=data, mesh=jax.make_mesh((2, 2, 2), MESH_AXES))
    assert run.config.mesh.axis_types == "explicit"
    with train_loop.sharding.activation_sharding(run.mesh):
      state = run.init_state(jax.random.key(0))
      _, metrics = run.train_step(state, train_loop.device_batch(run, batch))
    results.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  (loss_1, norm_1), (loss_k, norm_k) = results
  np.testing.assert_allclose(loss_k, loss_1, rtol=F32_EPS * ulps)
  np.testing.assert_allclose(norm_k, norm_1, rtol=F32_EPS * ulps)
