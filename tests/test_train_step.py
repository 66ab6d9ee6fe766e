"""The module-level train and eval steps, called without the loop (nanodo's train_test style)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import gnmr_jax
from gnmr_jax import train_loop
from gnmr_jax import train_step as step_lib
from tests.tolerances import assert_allclose, chain_ulps, f32_atol, transformer_reductions
from tests.train_helpers import small_config


def test_module_level_step_is_the_run_step_and_compiles_once(data_dirs):
  # The default priority with the gap measured every 2 steps from step 2: the step reads the
  # mask from the state, measures on steps 2 and 4, and the controller consumes the gap.
  config = small_config(data_dirs, **{"gnmr.priority": "gap", "gnmr.warmup": 1,
                                      "diagnostics.recovery_gap_every": 2,
                                      "diagnostics.recovery_gap_start": 2})
  run = train_loop.build(config, devices=jax.devices()[:1])
  assert isinstance(run.spec, step_lib.StepSpec) and run.spec.probe.every == 2
  direct = jax.jit(functools.partial(step_lib.train_step, spec=run.spec))
  it = run.data.train_iterator()
  state = run.init_state(jax.random.key(0))
  copy = jax.tree.map(jnp.copy, state)  # run.train_step donates its state
  measured = []
  for _ in range(4):
    batch = train_loop.device_batch(run, next(it))
    copy, metrics_direct = direct(copy, batch)
    state, metrics = run.train_step(state, batch)
    # The same function of the same inputs: bit for bit.
    jax.tree.map(np.testing.assert_array_equal, state.params, copy.params)
    for name in ("loss", "grad_norm", "unit_mask_used", "unit_gap"):
      np.testing.assert_array_equal(metrics[name], metrics_direct[name])
    measured.append(bool(metrics["gap_measured"]))
  assert measured == [False, True, False, True] and int(state.step) == 4
  assert float(np.max(metrics["unit_gap"])) > 0
  # Measured and unmeasured steps are one program (the measurement is a lax.cond).
  assert run.train_step._cache_size() == 1  # pylint: disable=protected-access

  # eval_step: the summed token loss with the mask of the next step, against a separate
  # forward pass of the same model and mask, reduced in float64.
  batch = train_loop.device_batch(run, next(iter(run.data.eval_batches())))
  total, count = run.eval_step(state, batch)
  mask = gnmr_jax.recovery_mask(state.opt_state)
  logits = run.model.apply({"params": state.params}, batch["inputs"], recovery_mask=mask)
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  want = -np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"])[..., None],
                             axis=-1).sum()
  assert int(count) == batch["targets"].size
  reductions = transformer_reductions(run.model_config, config.data.seq_len)
  assert_allclose(float(total), want, atol=f32_atol(abs(want), chain_ulps(reductions)))
