"""The training loop: `train_and_evaluate(config, workdir)`, used by train.py and the notebooks.

`build` maps a config to objects (data, policy, model, optimizer chain, mesh, shardings) and
jits the module-level steps of gnmr_jax/train_step.py once, with donated state: forward/
backward with the recovery mask from the optimizer state, optax.chain(controller,
guard(clip, adamw)). The loop fetches metrics one step late so the host never waits on the
device; checkpoints hold params, optimizer + controller state, the RNG and the data iterator
position, so a reused --workdir resumes exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from gnmr_jax import attention as attention_lib
from gnmr_jax import checkpointing, metrics_log, sharding
from gnmr_jax import faults as faults_lib
from gnmr_jax.config import validate_config
from gnmr_jax.control import config as control_config
from gnmr_jax.control import recovery_gap as gap_lib
from gnmr_jax.control import units as units_lib
from gnmr_jax.data import make_data
from gnmr_jax.metrics_log import format_summary as format_summary  # public here too
from gnmr_jax.model import Transformer, init_amax_history
from gnmr_jax.model_configs import static_scan_unroll
from gnmr_jax.optim import learning_rate_schedule, make_optimizer
from gnmr_jax.precision import make_policy, native_microscaling, recovery_policy
from gnmr_jax.precision import scaling as scaling_lib
from gnmr_jax.train_step import StepSpec as StepSpec
from gnmr_jax.train_step import TrainState as TrainState
from gnmr_jax.train_step import cross_entropy as cross_entropy
from gnmr_jax import train_step as step_lib


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
  spec: Optional[StepSpec] = None  # what train_step / eval_step were jitted with
  task: Any = None      # the task replacing the language-model objective, or None
  abstract_state: Any = None  # init_state's output as ShapeDtypeStructs with state_shardings


VOCAB_MULTIPLE = 64


def build(config: ml_collections.ConfigDict, *, data=None, devices=None,
          make_tx=None, task=None, mesh: jax.sharding.Mesh | None = None) -> Run:
  """Validates the config and builds data, policy, model, optimizer, mesh and jitted steps.

  The model's vocabulary is the tokenizer's, padded up to a multiple of 64 so it
  divides over tensor-parallel meshes (the padded ids never occur in the data).
  `devices` restricts the mesh (default: all devices). `make_tx(config)` replaces
  gnmr_jax.optim.make_optimizer (experiments with baseline transforms); the train step
  reads the recovery mask from whatever GNMRState the chain holds. `task` replaces the
  language-model objective and state (e.g. gnmr_jax.lora.LoraTask): an object with
  `init_state(rng, *, spec)`, `train_step(state, batch, *, spec)`, `eval_step(state, batch,
  *, spec)`, `trainable(state)` and `summary_fields(run, state, *, final)`; its state is
  replicated over the mesh.
  `mesh` replaces the one `config.mesh` describes: a `jax.sharding.Mesh` with axes
  ('data', 'fsdp', 'tensor'), explicit or auto (e.g. `jax.make_mesh((2, 2, 2),
  sharding.MESH_AXES)`); `run.config.mesh` then describes it.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  if config.gnmr.get("t_lock", 0) is None:  # the priority's default, recorded as resolved
    config.gnmr.t_lock = control_config.t_lock_of(config.gnmr)
  if mesh is not None:
    if devices is not None:
      raise ValueError("build: pass devices= or mesh=, not both (the mesh holds its devices).")
    sharding.check_mesh(mesh, exact=True)
    config.mesh = sharding.mesh_config_of(mesh)
    devices = list(mesh.devices.flat)
  validate_config(config, len(devices) if devices is not None else jax.device_count())
  mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh, devices)
  # 'auto' microscaling GEMMs and scaling recipe resolved for the mesh's devices (compile-only
  # ones included), and recorded: every policy built from this config below, and run.config,
  # say which.
  device = mesh.devices.flat[0]
  config.precision = scaling_lib.resolved_config(
      native_microscaling.resolved_config(config.precision, device), device)
  policy = make_policy(config.precision, device=device,
                       max_recovered=config.gnmr.max_o if config.gnmr.enabled else None)
  if data is None:
    data = make_data(config.data, jax.process_index(), jax.process_count())
  elif hasattr(data, "for_config"):  # prebuilt: this run's seed, or a ValueError on a mismatch
    data = data.for_config(config.data)
  model_config = _model_config_for(config, data.vocab_size, policy, device)
  accum_steps = int(config.train.get("grad_accum_steps", 1))
  # Each micro-batch splits over the batch axes as the whole batch would (grad_accumulation.py).
  sharding.check_model_fits_mesh(model_config, mesh, config.data.batch_size // accum_steps,
                                 batch_field=("micro-batch data.batch_size / "
                                              "train.grad_accum_steps" if accum_steps > 1
                                              else "batch_size"))
  model = Transformer(model_config, policy)
  tx = (make_tx or make_optimizer)(config)
  seq_len = config.data.seq_len
  replicated = sharding.replicated(mesh)

  state_of = _state_maker(tx, model_config, policy,
                          float(config.train.get("init_perturbation", 0.0)))

  def init_state(rng):
    return state_of(sharding.init_unboxed(model, rng, jnp.zeros((1, seq_len), jnp.int32)), rng)

  # An abstract key: nothing concrete is created under the mesh, whose devices may be a
  # topology's that cannot run (gnmr_jax.aot compiles for accelerators on a CPU host).
  abstract_key = jax.eval_shape(lambda: jax.random.key(0))
  with sharding.activation_sharding(mesh):
    # one abstract init of the model gives p's shapes and its shardings
    abstract_params, param_sh = sharding.abstract_params_and_shardings(
        model, mesh, tokens_shape=(1, seq_len))
    abstract = jax.eval_shape(state_of, abstract_params, abstract_key)  # the LM state
  layout = units_lib.layout_of(abstract.params, config.gnmr.units or None,
                               config.gnmr.layer_axis or None)
  injector = faults_lib.make_injector(config, layout)
  probe, recovery_model, swap_model = _gap_probe(config, model_config, policy, device)
  spec = StepSpec(model=model, tx=tx, routed=policy.routed,
                  layout=layout if config.gnmr.enabled else None,
                  schedule=learning_rate_schedule(config.optimizer, config.train.steps),
                  injector=injector, probe=probe, recovery_model=recovery_model,
                  swap_model=swap_model, grad_accum_steps=accum_steps)
  if task is None:  # the language-model objective: sharded params and optimizer state
    state_sh = _lm_state_shardings(abstract, param_sh, replicated)
    train_fn, eval_fn = step_lib.train_step, step_lib.eval_step
  else:
    init_state, abstract = _task_init(task, spec, mesh, abstract_key, accum_steps)
    state_sh = jax.tree_util.tree_map(lambda _: replicated, abstract)
    train_fn, eval_fn = task.train_step, task.eval_step
  batch_sh = sharding.batch_sharding(mesh)
  train_step = jax.jit(functools.partial(train_fn, spec=spec),
                       in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                       donate_argnums=0)
  eval_step = jax.jit(functools.partial(eval_fn, spec=spec),
                      in_shardings=(state_sh, batch_sh), out_shardings=replicated)
  init_fn = jax.jit(init_state, out_shardings=state_sh)
  return Run(config=config, model_config=model_config, data=data, policy=policy, model=model,
             tx=tx, mesh=mesh, state_shardings=state_sh, batch_sharding=batch_sh,
             init_state=init_fn, train_step=train_step, eval_step=eval_step,
             unit_names=layout.names() if config.gnmr.enabled else [], faults=injector,
             spec=spec, task=task,
             abstract_state=checkpointing.abstract_like(abstract, state_sh))


def _lm_state_shardings(abstract, param_sh, replicated) -> TrainState:
  """The language-model state's shardings: the params' and their optimizer state's, the rest
  replicated (the amax histories are a few floats per unit: every device keeps them all)."""
  return TrainState(
      step=replicated, params=param_sh,
      opt_state=sharding.opt_state_shardings(abstract.opt_state, abstract.params, param_sh,
                                             replicated),
      rng=replicated,
      amax_history=jax.tree_util.tree_map(lambda _: replicated, abstract.amax_history))


def _task_init(task, spec, mesh, abstract_key, accum_steps: int):
  """(init_state(rng), its abstract state) of a `task` that replaces the LM objective."""
  if accum_steps > 1:  # a task's step is its own: it would ignore the micro-batches
    raise ValueError(f"config.train.grad_accum_steps={accum_steps}: the task "
                     f"{type(task).__name__} runs its own train step, which does not "
                     f"accumulate; use grad_accum_steps=1 (or a smaller data.batch_size).")
  init_state = functools.partial(task.init_state, spec=spec)
  with sharding.activation_sharding(mesh):
    return init_state, jax.eval_shape(init_state, abstract_key)


def _model_config_for(config, vocab_size: int, policy, device) -> ml_collections.ConfigDict:
  """The model's config as built for `device`: the vocabulary padded to VOCAB_MULTIPLE, 'auto'
  attention (cuDNN / splash / XLA) and the layer layout resolved; both recorded in
  `config.model` too."""
  model_config = ml_collections.ConfigDict(config.model.to_dict())
  model_config.vocab_size = -(-int(vocab_size) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  model_config.attention = attention_lib.resolve(
      model_config.attention, device, seq_len=config.data.seq_len,
      head_dim=model_config.d_model // model_config.num_heads, dtype=model_config.dtype)
  config.model.attention = model_config.attention
  if policy.routed:
    model_config.scan_unroll = policy.scan_unroll(model_config.num_layers, device.platform)
  else:  # the static step's layer layout per backend (model_configs.static_scan_unroll)
    model_config.scan_unroll = static_scan_unroll(model_config, device.platform)
  config.model.scan_unroll = model_config.scan_unroll
  return model_config


def _state_maker(tx, model_config, policy, perturbation: float):
  """`state_of(params, rng)`: the TrainState around `params`; with `perturbation`, each param
  times (1 + perturbation * z) (the noise floor of a seed: the same init but for ~one
  rounding)."""

  def state_of(params, rng):
    if perturbation:
      keys = jax.random.split(jax.random.fold_in(rng, 2), len(jax.tree_util.tree_leaves(params)))
      params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), [
          p * (1 + perturbation * jax.random.normal(k, p.shape, p.dtype))
          for p, k in zip(jax.tree_util.tree_leaves(params), keys)])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.fold_in(rng, 1)),
                      amax_history=(init_amax_history(model_config, policy.amax_history_length)
                                    if policy.takes_history else None))

  return state_of


def _gap_probe(config, model_config, policy, device):
  """(GapProbe, recovery model, swap model) of config.diagnostics, or Nones when not measured.

  The gap is logged per controller unit: no controller, no measurement. The first measured
  step 0 means the first step at which the controller selects (warmup + 1): before it the mask
  is empty and no priority reads the gap.
  """
  diagnostics = config.get("diagnostics") or ml_collections.ConfigDict()
  every = diagnostics.get("recovery_gap_every", 0) if config.gnmr.enabled else 0
  if not every:
    return None, None, None
  measuring_pass = diagnostics.get("recovery_gap_pass", "recovery")
  probe = gap_lib.GapProbe(
      every=every, start=diagnostics.get("recovery_gap_start", 0) or config.gnmr.warmup + 1,
      measuring_pass=measuring_pass, units=config.gnmr.units or None,
      layer_axis=config.gnmr.layer_axis or None,
      split_halves=diagnostics.get("recovery_gap_split", False))
  # The same params with every projection on the recovery path (no conds).
  recovery_model = Transformer(model_config, recovery_policy(config.precision, device))
  swap_model = None
  if policy.routed and measuring_pass == "swapped":  # per-unit slots: any number recovered
    swap_precision = ml_collections.ConfigDict(config.precision.to_dict())
    swap_precision.recovery_storage = "per_unit"
    swap_model = Transformer(model_config, make_policy(swap_precision, device=device))
  return probe, recovery_model, swap_model


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


def _restore_or_init(run, ckpt, fingerprint: dict, train_iter):
  """(start step, state, a task's fields before training): the latest checkpoint of this config
  (its data iterator's position restored into `train_iter`), or a fresh init at step 0."""
  with sharding.activation_sharding(run.mesh):
    restored = ckpt.restore(run.abstract_state, fingerprint)
    if restored is not None:
      start, state, data_state = restored
      train_iter.set_state(data_state)
      return start, state, {}
    state = run.init_state(jax.random.key(run.config.train.seed))
    # e.g. the base model's scores before fine-tuning
    task_fields = {} if run.task is None else run.task.summary_fields(run, state, final=False)
    return 0, state, task_fields


def _nonfinite_streak(config, bad_streak: int, step: int, guarded: bool,
                      latest_step) -> FloatingPointError:
  """The error that stops a run after too many non-finite steps, naming what was kept."""
  what = {"skip": "updates were skipped", "zero": "non-finite updates were zeroed",
          "none": "optimizer.nonfinite='none' let them into the parameters"}
  kept = (f"the checkpoint saved at step {step} holds the last good parameters" if guarded
          else f"the last checkpoint before them is at step {latest_step}")
  return FloatingPointError(
      f"{bad_streak} consecutive steps with a non-finite loss or gradient (up to step "
      f"{step - 1}, train.max_consecutive_nonfinite={config.train.max_consecutive_nonfinite}"
      f"); {what[config.optimizer.nonfinite]}, so {kept}. Lower optimizer.learning_rate or "
      f"check the data.")


def _summary(run, state, stats, *, workdir: str, step: int, start: int, preempted: bool,
             corrupted, last_eval, task_fields) -> dict:
  """The run's summary: where it stopped, its seeds and precision, the last eval, a task's
  fields, and the controller's spend (recovered unit-steps, threshold exceedance,
  saturation) from the last logged step."""
  config, task = run.config, run.task
  summary = {"workdir": workdir, "step": int(step), "preempted": preempted,
             "resumed_from_step": int(start),
             "corrupted_checkpoints": [[int(s), r] for s, r in corrupted],
             "seeds": {"train": int(config.train.seed), "data": int(config.data.seed),
                       "init_perturbation": float(config.train.get("init_perturbation", 0.0))},
             "precision_mode": config.precision.mode,
             "low_cost_path": config.precision.low_cost_path,
             "num_params": int(sum(x.size for x in jax.tree_util.tree_leaves(
                 state.params if task is None else task.trainable(state)))),
             "unigram_perplexity": float(run.data.unigram_perplexity),
             "tokens_per_s": stats.tokens_per_s,
             "side_buffer_dropped": stats.dropped_total}
  if last_eval is not None:
    summary.update(last_eval)
  if task is not None:
    with sharding.activation_sharding(run.mesh):
      summary.update(task_fields, **task.summary_fields(run, state, final=True))
  last_host = stats.last
  if last_host is not None and "num_units" in last_host:
    unit_steps = max(int(last_host["num_units"]) * int(step), 1)
    # active_unit_steps sums the masks produced at steps 1..T, used at steps 2..T+1 (step 1
    # uses the initial, empty mask): the last one was used by no step of this run.
    used_unit_steps = int(last_host["active_unit_steps"]) - int(last_host["num_active"])
    summary.update(
        num_units=int(last_host["num_units"]),
        recovered_unit_steps_pct=100.0 * used_unit_steps / unit_steps,
        threshold_exceedance_pct=100.0 * int(last_host["risky_unit_steps"]) / unit_steps)
  if stats.saturation_unit_steps:  # of the steps this process ran (a resumed run: since then)
    summary["saturated_per_1000_unit_steps"] = (
        1000.0 * stats.saturated_unit_steps / stats.saturation_unit_steps)
  return summary


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, data=None,
                       devices=None, stop_at: Optional[int] = None, make_tx=None,
                       task=None, mesh: Optional[jax.sharding.Mesh] = None) -> dict:
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
    task: optional task replacing the language-model objective and state (`build`), e.g.
      gnmr_jax.lora.LoraTask: LoRA fine-tuning through this same loop.
    mesh: optional mesh of your own replacing `config.mesh` (see `build`).

  Returns:
    A dict with final eval loss/perplexity, the unigram baseline, recovered
    unit-steps %, threshold exceedance %, tokens/s and file paths.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  run = build(config, data=data, devices=devices, make_tx=make_tx, task=task, mesh=mesh)
  config = run.config
  is_main = jax.process_index() == 0
  ckpt = checkpointing.Checkpointer(workdir, config.checkpoint.max_to_keep)
  fingerprint = checkpointing.config_fingerprint(config, run.data.vocab_size)
  train_iter = run.data.train_iterator()
  start, state, task_fields = _restore_or_init(run, ckpt, fingerprint, train_iter)
  total = config.train.steps
  if is_main:
    metrics_log.truncate_logs(workdir, start)
  log = metrics_log.MetricsLogger(
      workdir, total, tensorboard=config.logging.tensorboard,
      progress_bar=config.logging.progress_bar, unit_names=run.unit_names, start_step=start,
      enabled=is_main)
  stats = metrics_log.StepStats(
      log, start=start, total=total,
      tokens_per_step=config.data.batch_size * config.data.seq_len,
      log_every=config.logging.log_every, unit_log_every=config.logging.unit_log_every,
      max_o=config.gnmr.max_o)
  pending = None  # (step, device metrics) fetched one step late
  last_eval = None

  def save(step, force=False):
    if ckpt.latest_step() == step:
      return
    meta = {"fingerprint": fingerprint, "step": int(step)}
    ckpt.save(step, state, train_iter.get_state(), meta, force=force)

  preempted = False
  with _Preemption() as preemption, sharding.activation_sharding(run.mesh):
    step = start
    while step < total:
      batch = device_batch(run, next(train_iter))
      state, metrics = run.train_step(state, batch)
      step += 1
      if pending is not None:
        stats.observe(*pending)
      pending = (step, metrics)
      bad_streak = stats.bad_streak
      if bad_streak >= config.train.max_consecutive_nonfinite:
        guarded = config.optimizer.nonfinite != "none"
        if guarded:  # the guard kept NaN/Inf out of the params: this state is the last good one
          save(step, force=True)
        latest = ckpt.latest_step()
        ckpt.close()
        log.close()
        raise _nonfinite_streak(config, bad_streak, step, guarded, latest)
      if config.train.eval_every and step % config.train.eval_every == 0 and step < total:
        stats.observe(*pending)
        pending = None
        last_eval = evaluate(run, state)
        log.eval(step, last_eval)
        stats.restart_timer()
      if config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
        save(step)
      if preemption.requested or (stop_at is not None and step >= stop_at and step < total):
        preempted = True
        break
    if pending is not None:
      stats.observe(*pending)
    if not preempted and (last_eval is None or step % max(config.train.eval_every, 1) or
                          step == total):
      last_eval = evaluate(run, state)
      log.eval(step, last_eval)
    save(step, force=True)
  ckpt.close()

  summary = _summary(run, state, stats, workdir=workdir, step=step, start=start,
                     preempted=preempted, corrupted=ckpt.corrupted, last_eval=last_eval,
                     task_fields=task_fields)
  if is_main and config.logging.plots and not preempted:
    from gnmr_jax import plots  # pylint: disable=g-import-not-at-top
    summary["plots"] = plots.plot_run(workdir)
  log.summary(summary)
  log.close()
  return summary
