"""The training loop: `train_and_evaluate(config, workdir)`, used by train.py and the notebooks.

One jitted, sharded train step with donated state: forward/backward with the recovery mask
from the optimizer state, optax.chain(gnmr, guard(clip, adamw)). Metrics are fetched one step
late so the host never waits on the device; checkpoints hold params, optimizer + GNMR state,
the RNG and the data iterator position, so a reused --workdir resumes exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import flax.linen as nn

from gnmr_jax import checkpointing, metrics_log, recovery_gap, sharding
from gnmr_jax import faults as faults_lib
from gnmr_jax.config import validate_config
from gnmr_jax.controller import GNMRState, controller_state
from gnmr_jax.data import make_data
from gnmr_jax.model import Transformer
from gnmr_jax.optim import learning_rate_schedule, make_optimizer
from gnmr_jax.precision import make_policy


class TrainState(NamedTuple):
  step: jax.Array       # int32 []
  params: Any           # float32 params tree (unboxed 'params' collection)
  opt_state: Any        # optax state, GNMRState inside
  rng: jax.Array        # uint32 [2]: raw key data, for any stochastic part of the step


@dataclasses.dataclass
class Run:
  """Everything built from a config, shared by the train loop, tests and notebooks."""
  config: ml_collections.ConfigDict
  model_config: ml_collections.ConfigDict
  data: Any
  policy: Any
  model: Transformer
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  state_shardings: Any
  batch_sharding: jax.sharding.NamedSharding
  init_state: Any       # jitted rng -> TrainState
  train_step: Any       # jitted (state, batch) -> (state, metrics)
  eval_step: Any        # jitted (state, batch) -> (sum_loss, num_tokens)
  unit_names: list
  faults: Any = None    # gnmr_jax.faults.FaultInjector when config.faults is on, else None


def cross_entropy(logits_BxSxV, targets_BxS):
  """Mean next-token cross-entropy in nats (float32)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, targets_BxS)
  return jnp.mean(losses), jnp.sum(losses), targets_BxS.size


def _controller(opt_state) -> Optional[GNMRState]:
  try:
    return controller_state(opt_state)
  except ValueError:
    return None


def _unit_layout(unit_regex, layer_regex, params) -> list:
  from gnmr_jax import units as units_lib  # pylint: disable=g-import-not-at-top
  return units_lib.layout_of(params, unit_regex or None, layer_regex or None)


def _make_train_step(model, tx, routed: bool, unit_flags: list, schedule, injector=None,
                     gap_model=None, gap_every: int = 0, gap_start: int = 1,
                     unit_selectors=(None, None), gap_pass: str = "swapped"):
  def select(tree):
    leaves = [l for l, keep in zip(jax.tree_util.tree_leaves(tree), unit_flags) if keep]
    return jnp.concatenate([jnp.ravel(l) for l in leaves]) if leaves else jnp.zeros((0,))

  def train_step(state: TrainState, batch):
    ctl = _controller(state.opt_state)
    mask = ctl.mask if (routed and ctl is not None) else None
    step_number = state.step + 1  # 1-based, as logged

    def loss_fn(params):
      if injector is not None:  # reliability tests only (config.faults)
        params = injector.corrupt_params(params, step_number,
                                         select(mask) if mask is not None else None)
      logits, sown = model.apply({"params": params}, batch["inputs"], recovery_mask=mask,
                                 mutable=["intermediates"])
      loss, _, _ = cross_entropy(logits, batch["targets"])
      if injector is not None:
        loss = injector.corrupt_loss(loss, step_number)
      # Recoveries the side buffer had no room for (0 with the controller's mask).
      dropped = sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(
          sown.get("intermediates", {}).get("side_buffer_dropped", ())))
      return loss, jnp.asarray(dropped, jnp.int32)

    (loss, dropped), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    if injector is not None:
      grads = injector.corrupt_grads(grads, step_number)
    extra = {}
    if gap_every:
      units, layer_axis = unit_selectors
      # Steps gap_start, gap_start + K, gap_start + 2K, ...
      gap_measured = (step_number >= gap_start) & ((step_number - gap_start) % gap_every == 0)

      def measure(_):
        def pass_grads(pass_model, pass_mask):
          def pass_loss(params):
            logits = pass_model.apply({"params": params}, batch["inputs"],
                                      recovery_mask=pass_mask)
            return cross_entropy(logits, batch["targets"])[0]
          return jax.grad(pass_loss)(state.params)

        if gap_pass == "uniform":  # every unit low-cost against every unit recovered
          grads_low = grads if mask is None else pass_grads(model, None)
          return recovery_gap.unit_gaps(grads_low, pass_grads(gap_model, None), None,
                                        units=units, layer_axis=layer_axis)
        swap = gap_pass == "swapped"
        other = None if (mask is None or not swap) else recovery_gap.swapped_mask(
            mask, state.params, units=units, layer_axis=layer_axis)
        return recovery_gap.unit_gaps(grads, pass_grads(gap_model, other), mask, swapped=swap,
                                      units=units, layer_axis=layer_axis)

      def skip(_):
        return recovery_gap.not_measured(state.params, units=units, layer_axis=layer_axis)

      # One extra forward+backward on the measured steps only (two for the 'uniform' pass of a
      # routed step).
      extra["recovery_gap"] = jax.lax.cond(gap_measured, measure, skip, None)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    metrics = {"loss": loss, "grad_norm": grad_norm,
               "learning_rate": schedule(state.step),
               "nonfinite": ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm)),
               "side_buffer_dropped": dropped}
    new_ctl = _controller(opt_state)
    if new_ctl is not None:
      tel = new_ctl.telemetry
      metrics.update(num_units=tel.num_units, num_risky=tel.num_risky,
                     num_candidates=tel.num_candidates, num_active=tel.num_active,
                     num_locked=tel.num_locked, num_nonfinite_units=tel.num_nonfinite,
                     active_unit_steps=tel.active_unit_steps,
                     risky_unit_steps=tel.risky_unit_steps,
                     # Recovery mask used by *this* step, and the per-unit scores it produced.
                     unit_mask_used=select(ctl.mask), unit_mask_next=select(new_ctl.mask),
                     unit_score=select(new_ctl.score), unit_gnmr=select(new_ctl.gnmr),
                     unit_delta_gnmr=select(new_ctl.delta_gnmr), unit_norm=select(new_ctl.norm))
    if gap_every:
      gap = extra["recovery_gap"]
      metrics.update(gap_measured=gap_measured,
                     unit_gap=select(gap.gap), unit_gap_rec_norm=select(gap.rec_norm))
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           rng=state.rng)
    return new_state, metrics

  return train_step


def _make_eval_step(model, routed: bool):
  def eval_step(state: TrainState, batch):
    ctl = _controller(state.opt_state)
    mask = ctl.mask if (routed and ctl is not None) else None
    logits = model.apply({"params": state.params}, batch["inputs"], recovery_mask=mask)
    _, total, count = cross_entropy(logits, batch["targets"])
    return total, jnp.float32(count)
  return eval_step


def _opt_state_shardings(abstract_opt_state, abstract_params, param_shardings, replicated):
  """Optimizer-state leaves that mirror a param (same path suffix and shape) get its sharding;
  everything else (counters, the controller's small per-unit leaves) is replicated."""
  from gnmr_jax.units import path_to_str  # pylint: disable=g-import-not-at-top
  by_path = {}
  for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(abstract_params)[0],
                              jax.tree_util.tree_leaves(param_shardings)):
    by_path[path_to_str(path)] = (tuple(leaf.shape), sh)

  def pick(path, leaf):
    name = path_to_str(path)
    for pname, (shape, sh) in by_path.items():
      if (name == pname or name.endswith("/" + pname)) and tuple(leaf.shape) == shape:
        return sh
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


VOCAB_MULTIPLE = 64


def build(config: ml_collections.ConfigDict, *, data=None, devices=None,
          make_tx=None) -> Run:
  """Validates the config and builds data, policy, model, optimizer, mesh and jitted steps.

  The model's vocabulary is the tokenizer's, padded up to a multiple of 64 so it
  divides over tensor-parallel meshes (the padded ids never occur in the data).
  `devices` restricts the mesh (default: all devices). `make_tx(config)` replaces
  gnmr_jax.optim.make_optimizer (experiments with baseline transforms); the train step
  reads the recovery mask from whatever GNMRState the chain holds.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  validate_config(config, len(devices) if devices is not None else jax.device_count())
  policy = make_policy(config.precision,
                       max_recovered=config.gnmr.max_o if config.gnmr.enabled else None)
  if data is None:
    data = make_data(config.data, jax.process_index(), jax.process_count())
  elif hasattr(data, "for_config"):  # prebuilt: this run's seed, or a ValueError on a mismatch
    data = data.for_config(config.data)
  model_config = ml_collections.ConfigDict(config.model.to_dict())
  model_config.vocab_size = -(-int(data.vocab_size) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  if policy.routed:
    model_config.scan_unroll = policy.scan_unroll(model_config.num_layers)
  mesh = sharding.make_mesh(config.mesh, devices)
  sharding.check_model_fits_mesh(model_config, mesh, config.data.batch_size)
  model = Transformer(model_config, policy)
  tx = (make_tx or make_optimizer)(config)
  seq_len = config.data.seq_len
  replicated = sharding.replicated(mesh)

  perturbation = float(config.train.get("init_perturbation", 0.0))

  def init_state(rng):
    params = nn.unbox(model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"])
    if perturbation:  # the noise floor of a seed: the same init but for ~one rounding
      keys = jax.random.split(jax.random.fold_in(rng, 2), len(jax.tree_util.tree_leaves(params)))
      params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), [
          p * (1 + perturbation * jax.random.normal(k, p.shape, p.dtype))
          for p, k in zip(jax.tree_util.tree_leaves(params), keys)])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.fold_in(rng, 1)))

  with sharding.activation_sharding(mesh):
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    param_sh = sharding.param_shardings(model, mesh, tokens_shape=(1, seq_len))
  state_sh = TrainState(
      step=replicated, params=param_sh,
      opt_state=_opt_state_shardings(abstract.opt_state, abstract.params, param_sh, replicated),
      rng=replicated)
  # The gap is logged per controller unit: no controller, no measurement.
  gap_every = (config.diagnostics.recovery_gap_every
               if "diagnostics" in config and config.gnmr.enabled else 0)
  # First measured step: 0 means the first step at which the controller selects (warmup + 1):
  # before it the mask is empty and no priority reads the gap.
  gap_start = ((config.diagnostics.get("recovery_gap_start", 0) or config.gnmr.warmup + 1)
               if gap_every else 1)
  gap_model = None
  gap_pass = (config.diagnostics.get("recovery_gap_pass", "recovery")
              if "diagnostics" in config else "recovery")
  swap = gap_pass == "swapped"
  if gap_every:  # the same params; each projection on the other path than in the step
    if policy.routed and swap:  # routed by the swapped mask; per-unit slots: any number recovered
      gap_precision = ml_collections.ConfigDict(config.precision.to_dict())
      gap_precision.recovery_storage = "per_unit"
      gap_model = Transformer(model_config, make_policy(gap_precision))
    else:  # every projection on the recovery path (no conds): the swapped pass of a static
      # step, or the 'recovery' pass
      gap_model = Transformer(model_config, recovery_gap.recovery_policy(config.precision))
  unit_flags = []
  unit_names = []
  layout = _unit_layout(config.gnmr.units, config.gnmr.layer_axis, abstract.params)
  injector = faults_lib.make_injector(config, layout)
  if config.gnmr.enabled:
    unit_flags = [u.is_unit for u in layout]
    ctl = controller_state(abstract.opt_state)
    names = metrics_log.flat_unit_names(ctl.mask)
    # flat_unit_names expands every leaf; keep only the unit leaves' names.
    offset = 0
    for path_leaf, keep in zip(jax.tree_util.tree_leaves(ctl.mask), unit_flags):
      size = max(1, int(np.prod(path_leaf.shape)))
      if keep:
        unit_names.extend(names[offset:offset + size])
      offset += size
  schedule = learning_rate_schedule(config.optimizer, config.train.steps)
  batch_sh = sharding.batch_sharding(mesh)
  step_fn = _make_train_step(model, tx, policy.routed, unit_flags, schedule, injector,
                             gap_model=gap_model, gap_every=gap_every, gap_start=gap_start,
                             gap_pass=gap_pass,
                             unit_selectors=(config.gnmr.units or None,
                                             config.gnmr.layer_axis or None))
  train_step = jax.jit(step_fn,
                       in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                       donate_argnums=0)
  eval_step = jax.jit(_make_eval_step(model, policy.routed), in_shardings=(state_sh, batch_sh),
                      out_shardings=replicated)
  init_fn = jax.jit(init_state, out_shardings=state_sh)
  return Run(config=config, model_config=model_config, data=data, policy=policy, model=model,
             tx=tx, mesh=mesh, state_shardings=state_sh, batch_sharding=batch_sh,
             init_state=init_fn, train_step=train_step, eval_step=eval_step,
             unit_names=unit_names, faults=injector)


def device_batch(run: Run, batch: dict) -> dict:
  """This process's rows -> a global array sharded over (data, fsdp)."""
  return {k: jax.make_array_from_process_local_data(run.batch_sharding, np.asarray(v))
          for k, v in batch.items()}


def evaluate(run: Run, state: TrainState) -> dict:
  total, count = 0.0, 0.0
  with sharding.activation_sharding(run.mesh):
    for batch in run.data.eval_batches():
      t, c = run.eval_step(state, device_batch(run, batch))
      total += float(t)
      count += float(c)
  loss = total / max(count, 1.0)
  return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint and returns cleanly."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. some notebook kernels)
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _truncate_logs(workdir: str, start: int) -> None:
  """Drops JSONL rows after the step a run resumes from (a killed run logged steps past its last
  checkpoint, possibly a half-written line), so the logs read as one uninterrupted run."""
  for name in (metrics_log.METRICS_FILE, metrics_log.EVAL_FILE, metrics_log.UNITS_FILE,
               metrics_log.GAP_FILE):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      continue
    kept = []
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:  # a line cut short by SIGKILL
          continue
        if isinstance(row, dict) and row.get("step", start + 1) <= start:
          kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(path + ".tmp", path)


def _host(metrics: dict) -> dict:
  return {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, data=None,
                       devices=None, stop_at: Optional[int] = None, make_tx=None) -> dict:
  """Trains (or resumes) in `workdir` and returns the run summary.

  Args:
    config: a config from configs/*.py (see gnmr_jax.config.base_config).
    workdir: checkpoints, logs and plots go here; a workdir with a checkpoint of
      the same config is resumed exactly.
    data: optional prebuilt gnmr_jax.data.Data (tests, notebooks, experiments): its batches
      follow `config.data.seed`; any other field that shapes the batches must agree with
      `config.data` (`Data.for_config`; a ValueError otherwise).
    devices: optional devices for the mesh (default: all).
    stop_at: stop after this step with a checkpoint, as a preemption would
      (tests of exact resume); None runs to config.train.steps.
    make_tx: optional `config -> optax transform` replacing the configured chain.

  Returns:
    A dict with final eval loss/perplexity, the unigram baseline, recovered
    unit-steps %, threshold exceedance %, tokens/s and file paths.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  run = build(config, data=data, devices=devices, make_tx=make_tx)
  config = run.config
  is_main = jax.process_index() == 0
  ckpt = checkpointing.Checkpointer(workdir, config.checkpoint.max_to_keep)
  fingerprint = checkpointing.config_fingerprint(config, run.data.vocab_size)
  train_iter = run.data.train_iterator()
  with sharding.activation_sharding(run.mesh):
    abstract = jax.eval_shape(run.init_state, jax.random.key(config.train.seed))
    restored = ckpt.restore(checkpointing.abstract_like(abstract, run.state_shardings),
                            fingerprint)
    if restored is None:
      state = run.init_state(jax.random.key(config.train.seed))
      start = 0
    else:
      start, state, data_state = restored
      train_iter.set_state(data_state)
  total = config.train.steps
  if is_main:
    _truncate_logs(workdir, start)
  log = metrics_log.MetricsLogger(
      workdir, total, tensorboard=config.logging.tensorboard,
      progress_bar=config.logging.progress_bar, unit_names=run.unit_names, start_step=start,
      enabled=is_main)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  pending = None  # (step, device metrics) fetched one step late
  bad_streak = 0
  dropped_total = 0
  timed_steps, timed_seconds = 0, 0.0
  last_eval = None
  t_last = time.perf_counter()
  steps_since_log = 0

  def save(step, force=False):
    if ckpt.latest_step() == step:
      return
    meta = {"fingerprint": fingerprint, "step": int(step)}
    ckpt.save(step, state, train_iter.get_state(), meta, force=force)

  def handle(step, metrics):
    nonlocal bad_streak, t_last, steps_since_log, timed_steps, timed_seconds, dropped_total
    host = _host(metrics)
    bad_streak = bad_streak + 1 if bool(host["nonfinite"]) else 0
    dropped_total += int(host["side_buffer_dropped"])
    steps_since_log += 1
    if step % config.logging.log_every == 0 or step == total:
      now = time.perf_counter()
      dt = (now - t_last) / steps_since_log
      if step > start + 1:  # the first interval includes compilation
        timed_steps += steps_since_log
        timed_seconds += now - t_last
      t_last, steps_since_log = now, 0
      scalars = {k: float(v) if v.dtype.kind == "f" else int(v) for k, v in host.items()
                 if v.ndim == 0}
      scalars.update(steps_per_s=1.0 / max(dt, 1e-9), tokens_per_s=tokens_per_step / max(dt, 1e-9))
      log.train(step, scalars)
    every = config.logging.unit_log_every
    if every and "unit_mask_used" in host and (step % every == 0 or step == total):
      log.units(step, host["unit_mask_used"], host["unit_score"], host["unit_gnmr"],
                host["unit_delta_gnmr"], host["unit_norm"])
    if "gap_measured" in host and bool(host["gap_measured"]):
      log.recovery_gap(step, host["unit_gap"], host["unit_gap_rec_norm"],
                       host["unit_mask_used"], config.gnmr.max_o)
    log.advance(step)
    return host

  last_host = None
  preempted = False
  with _Preemption() as preemption, sharding.activation_sharding(run.mesh):
    step = start
    while step < total:
      batch = device_batch(run, next(train_iter))
      state, metrics = run.train_step(state, batch)
      step += 1
      if pending is not None:
        last_host = handle(*pending)
      pending = (step, metrics)
      if bad_streak >= config.train.max_consecutive_nonfinite:
        guarded = config.optimizer.nonfinite != "none"
        if guarded:  # the guard kept NaN/Inf out of the params: this state is the last good one
          save(step, force=True)
        what = {"skip": "updates were skipped", "zero": "non-finite updates were zeroed",
                "none": "optimizer.nonfinite='none' let them into the parameters"}
        kept = (f"the checkpoint saved at step {step} holds the last good parameters" if guarded
                else f"the last checkpoint before them is at step {ckpt.latest_step()}")
        ckpt.close()
        log.close()
        raise FloatingPointError(
            f"{bad_streak} consecutive steps with a non-finite loss or gradient (up to step "
            f"{step - 1}, train.max_consecutive_nonfinite={config.train.max_consecutive_nonfinite}"
            f"); {what[config.optimizer.nonfinite]}, so {kept}. Lower optimizer.learning_rate or "
            f"check the data.")
      if config.train.eval_every and step % config.train.eval_every == 0 and step < total:
        last_host = handle(*pending)
        pending = None
        last_eval = evaluate(run, state)
        log.eval(step, last_eval)
        t_last, steps_since_log = time.perf_counter(), 0
      if config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
        save(step)
      if preemption.requested or (stop_at is not None and step >= stop_at and step < total):
        preempted = True
        break
    if pending is not None:
      last_host = handle(*pending)
    if not preempted and (last_eval is None or step % max(config.train.eval_every, 1) or
                          step == total):
      last_eval = evaluate(run, state)
      log.eval(step, last_eval)
    save(step, force=True)
  ckpt.close()

  summary = {"workdir": workdir, "step": int(step), "preempted": preempted,
             "resumed_from_step": int(start),
             "corrupted_checkpoints": [[int(s), r] for s, r in ckpt.corrupted],
             "seeds": {"train": int(config.train.seed), "data": int(config.data.seed),
                       "init_perturbation": float(config.train.get("init_perturbation", 0.0))},
             "precision_mode": config.precision.mode,
             "low_cost_path": config.precision.low_cost_path,
             "num_params": int(sum(x.size for x in jax.tree_util.tree_leaves(state.params))),
             "unigram_perplexity": float(run.data.unigram_perplexity),
             "tokens_per_s": (timed_steps * tokens_per_step / timed_seconds) if timed_seconds else float("nan"),
             "side_buffer_dropped": dropped_total}
  if last_eval is not None:
    summary.update(last_eval)
  if last_host is not None and "num_units" in last_host:
    unit_steps = max(int(last_host["num_units"]) * int(step), 1)
    # active_unit_steps sums the masks produced at steps 1..T, used at steps 2..T+1 (step 1
    # uses the initial, empty mask): the last one was used by no step of this run.
    used_unit_steps = int(last_host["active_unit_steps"]) - int(last_host["num_active"])
    summary.update(
        num_units=int(last_host["num_units"]),
        recovered_unit_steps_pct=100.0 * used_unit_steps / unit_steps,
        threshold_exceedance_pct=100.0 * int(last_host["risky_unit_steps"]) / unit_steps)
  if is_main and config.logging.plots and not preempted:
    from gnmr_jax import plots  # pylint: disable=g-import-not-at-top
    summary["plots"] = plots.plot_run(workdir)
  log.summary(summary)
  log.close()
  return summary


def format_summary(summary: dict) -> str:
  """The human summary printed at the end of train.py."""
  lines = [f"run summary ({summary['workdir']})",
           f"  steps                     {summary['step']}" +
           ("  (preempted: checkpoint saved)" if summary.get("preempted") else ""),
           f"  precision                 {summary['precision_mode']} / {summary['low_cost_path']}",
           *([f"  resumed from step         {summary['resumed_from_step']}"]
             if summary.get("resumed_from_step") else []),
           *[f"  corrupted checkpoint      step {s} skipped ({r[:120]})"
             for s, r in summary.get("corrupted_checkpoints", [])],
           f"  parameters                {summary['num_params']:,}"]
  if "eval_perplexity" in summary:
    lines.append(f"  validation perplexity     {summary['eval_perplexity']:.3f} "
                 f"(loss {summary['eval_loss']:.4f} nats/token; unigram baseline "
                 f"{summary['unigram_perplexity']:.2f})")
  if "recovered_unit_steps_pct" in summary:
    # In a static mode the controller only measures: nothing ran on the recovery path.
    label = ("recovered unit-steps     " if summary["precision_mode"] == "gnmr"
             else "would-recover unit-steps ")
    lines.append(f"  {label} {summary['recovered_unit_steps_pct']:.3f}% of "
                 f"{summary['num_units']} units x {summary['step']} steps "
                 f"(threshold exceedance {summary['threshold_exceedance_pct']:.3f}%)")
  lines.append(f"  tokens/s                  {summary['tokens_per_s']:.0f}")
  if summary.get("side_buffer_dropped"):
    lines.append(f"  WARNING: {summary['side_buffer_dropped']} recoveries found the side buffer full "
                 "and ran the low-cost path (precision.side_buffer_units < recovered units)")
  for name, path in (summary.get("plots") or {}).items():
    lines.append(f"  plot {name:20s} {path}")
  return "\n".join(lines)
