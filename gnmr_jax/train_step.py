"""The train and eval steps, as module-level functions of (state, batch) and a static spec.

``train_step(state, batch, spec=spec)`` runs forward and backward with the recovery mask
read from the optimizer state, measures the recovery gap on the probe's steps, updates the
params through the optax chain (controller first) and returns the new state and the step's
metrics. ``build`` in gnmr_jax/train_loop.py jits it once per run with
``functools.partial(train_step, spec=spec)`` and donated state; tests and notebooks can
call it directly, without the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from gnmr_jax import grad_accumulation as accumulation
from gnmr_jax.control import recovery_gap as gap_lib
from gnmr_jax.control import state as control_state
from gnmr_jax.control.priorities import PriorityState, noise_fraction
from gnmr_jax.control.units import UnitLayout
from gnmr_jax.model import amax_saturation_units
from gnmr_jax.precision import amax_history as amax_history_lib


class TrainState(NamedTuple):
  step: jax.Array       # int32 []
  params: Any           # float32 params tree (unboxed 'params' collection)
  opt_state: Any        # optax state, GNMRState inside
  rng: jax.Array        # uint32 [2]: raw key data, for any stochastic part of the step
  # Delayed scaling (precision.scaling='delayed'): the projections' amax histories,
  # model.init_amax_history's tree of float32[L, 3, H]; None otherwise.
  amax_history: Any = None


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What a step needs besides its state and batch (static: fixed for a run).

  Attributes:
    model: the routed Flax model, ``model.apply({'params': p}, inputs, recovery_mask=mask)``.
    tx: the optax chain (the controller first, when there is one).
    routed: whether the model routes units by the mask (precision.mode 'gnmr').
    layout: the controller's unit layout (None without a controller); flattens the per-unit
      metrics.
    schedule: the learning-rate schedule (logged).
    injector: a gnmr_jax.faults.FaultInjector (reliability tests) or None.
    probe: the recovery-gap :class:`GapProbe` or None.
    recovery_model: the model with every unit on the recovery path (the probe's g_rec).
    swap_model: the model routed with per-unit residual slots (the 'swapped' pass of a
      routed step, which may recover any number of units), or None.
    grad_accum_steps: micro-batches per step (config.train.grad_accum_steps;
      gnmr_jax/grad_accumulation.py): each runs forward and backward under the step's mask, the
      controller and the optimizer see their summed gradient once.
  """
  model: Any
  tx: optax.GradientTransformation
  routed: bool
  layout: Optional[UnitLayout]
  schedule: Callable[[jax.Array], jax.Array]
  injector: Any = None
  probe: Optional[gap_lib.GapProbe] = None
  recovery_model: Any = None
  swap_model: Any = None
  grad_accum_steps: int = 1


def cross_entropy(logits_BxSxV, targets_BxS):
  """Mean next-token cross-entropy in nats (float32), its sum and the token count, from logits.

  The steps below do not materialise the logits: the model fuses its head with the loss
  (``model.apply(..., targets=targets)``, gnmr_jax/loss.py). This is the same loss for code
  that has logits.
  """
  losses = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, targets_BxS)
  return jnp.mean(losses), jnp.sum(losses), targets_BxS.size


def _model_loss_sum(model, params, batch, mask, amax_history=None, **apply_kwargs):
  """(the sum of the batch's token cross-entropies, float32, and the token count), through the
  model's fused head and loss (float32 [B, S, V] logits never exist); apply_kwargs go to
  ``model.apply`` (``mutable=...`` makes the first value a (sum, variables) pair)."""
  targets = batch["targets"]
  if amax_history is not None:
    apply_kwargs["amax_history"] = amax_history
  out = model.apply({"params": params}, batch["inputs"], recovery_mask=mask, targets=targets,
                    **apply_kwargs)
  return out, targets.size


def gradient_passes(spec: StepSpec, params, batch, amax_history=None) -> gap_lib.GradientPasses:
  """The probe's gradient passes of the step's model on (params, batch), accumulated over the
  step's micro-batches; a delayed-scaling run's passes scale from the step's histories (and
  leave them as they are)."""
  def grads(model, mask, data=batch):
    count = data["targets"].size  # every micro-batch's loss sum over the whole count

    def micro_grads(micro):
      return jax.grad(
          lambda p: _model_loss_sum(model, p, micro, mask, amax_history)[0] / count)(params)

    return accumulation.over_micro_batches(micro_grads, data, spec.grad_accum_steps,
                                           optax.tree.add)

  return gap_lib.GradientPasses(
      low_cost=lambda: grads(spec.model, None),
      recovered=lambda: grads(spec.recovery_model, None),
      routed=lambda mask: grads(spec.swap_model or spec.model, mask),
      recovered_halves=lambda: tuple(grads(spec.recovery_model, None, half)
                                     for half in gap_lib.split_batch(batch)))


def _mask_of(spec: StepSpec, opt_state):
  """(the controller's state with flat per-unit fields, or None; the mask tree for the model,
  or None when the step is not routed)."""
  ctl = control_state.maybe_controller_state(opt_state, flat=True)
  if not spec.routed or ctl is None:
    return ctl, None
  return ctl, control_state.maybe_controller_state(opt_state).mask


def _combine_micro_batches(acc, new):
  """Sums a micro-batch's ((loss, dropped), (grads, _)) into the step's; the amax histories
  combine by max (each micro-batch pushed its own observation onto the same history, and the
  whole batch's amax is the largest; a non-finite one, as a NaN tensor's +inf, wins as it
  would in the whole batch and is settled after)."""
  (loss, dropped), (grads, history) = acc
  (new_loss, new_dropped), (new_grads, new_history) = new
  return ((loss + new_loss, dropped + new_dropped),
          (optax.tree.add(grads, new_grads),
           jax.tree_util.tree_map(jnp.maximum, history, new_history)))


def loss_and_grads(spec: StepSpec, state: TrainState, batch: dict, ctl, mask):
  """((mean token loss, side-buffer drops), (float32 gradients, next amax histories or None))
  of the step's batch: one forward and backward, or one per micro-batch summed
  (spec.grad_accum_steps), every micro-batch under ``mask``."""
  injector = spec.injector
  step_number = state.step + 1  # 1-based, as logged
  count = batch["targets"].size

  def loss_fn(params, amax_history, micro):
    if injector is not None:  # reliability tests only (config.faults)
      params = injector.corrupt_params(params, step_number,
                                       spec.layout.flat(ctl.mask) if mask is not None else None)
    (total, sown), _ = _model_loss_sum(spec.model, params, micro, mask, amax_history,
                                       mutable=["intermediates"])
    loss = total / count
    if injector is not None:  # a factor (NaN or 1): the same on every micro-batch's share
      loss = injector.corrupt_loss(loss, step_number)
    # Recoveries the side buffer had no room for (0 with the controller's mask).
    dropped = sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(
        sown.get("intermediates", {}).get("side_buffer_dropped", ())))
    return loss, jnp.asarray(dropped, jnp.int32)

  # Delayed scaling: the gradient of the amax histories is the next histories (every projection
  # pushed what it observed; amax_history.py).
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
  (loss, dropped), (grads, amax_history) = accumulation.over_micro_batches(
      lambda micro: grad_fn(state.params, state.amax_history, micro), batch,
      spec.grad_accum_steps, _combine_micro_batches)
  if amax_history is not None:
    amax_history = jax.tree_util.tree_map(amax_history_lib.settle, amax_history)
  return (loss, dropped), (grads, amax_history)


def train_step(state: TrainState, batch: dict, *, spec: StepSpec):
  """One training step: (state, batch) -> (new state, metrics of this step)."""
  ctl, mask = _mask_of(spec, state.opt_state)
  injector = spec.injector
  step_number = state.step + 1  # 1-based, as logged
  (loss, dropped), (grads, amax_history) = loss_and_grads(spec, state, batch, ctl, mask)
  if injector is not None:
    grads = injector.corrupt_grads(grads, step_number)
  extra, saturation = {}, None
  if amax_history is not None:
    # Delayed scaling: a unit whose amax outgrew its scale's range saturated this step; the
    # controller reads it as risk (control/paper.py, "Edge rules") and the log shows it.
    saturation = amax_saturation_units(state.params, state.amax_history, amax_history)
    if ctl is not None:
      extra["overflow"] = jax.tree_util.tree_map(lambda s: s > 1, saturation)
  if spec.probe is not None:  # one extra forward+backward on the measured steps only
    gap_measured, extra["recovery_gap"] = spec.probe(
        step_number, gradient_passes(spec, state.params, batch, state.amax_history),
        state.params, mask, grads)
  updates, opt_state = spec.tx.update(grads, state.opt_state, state.params, **extra)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  metrics = {"loss": loss, "grad_norm": grad_norm,
             "learning_rate": spec.schedule(state.step),
             "nonfinite": ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm)),
             "side_buffer_dropped": dropped}
  new_ctl = control_state.maybe_controller_state(opt_state, flat=True)
  if new_ctl is not None:
    metrics.update(controller_metrics(spec.layout, ctl, new_ctl))
    priority_states = control_state.find_states(opt_state, PriorityState)
    if len(priority_states) == 1:  # the noise fraction of the measurements so far
      found = priority_states[0]
      metrics["unit_noise_fraction"] = noise_fraction(spec.layout.flat(found.noise_sq),
                                                      spec.layout.flat(found.rec_sq))
  if saturation is not None and spec.layout is not None:
    metrics["unit_saturation"] = spec.layout.flat(saturation)
  if spec.probe is not None:
    gap = extra["recovery_gap"]
    metrics.update(gap_measured=gap_measured, unit_gap=spec.layout.flat(gap.gap),
                   unit_gap_rec_norm=spec.layout.flat(gap.rec_norm))
    if gap.signal_sq is not None:
      metrics.update(unit_gap_signal_sq=spec.layout.flat(gap.signal_sq),
                     unit_gap_sampling_sq=spec.layout.flat(gap.sampling_sq))
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng,
                         amax_history=amax_history)
  return new_state, metrics


def controller_metrics(layout: UnitLayout, ctl, new_ctl) -> dict:
  """The controller's telemetry and per-unit vectors of a step (``ctl``: the state the step
  read its mask from; ``new_ctl``: the state after the update)."""
  select = layout.flat
  tel = new_ctl.telemetry
  return dict(num_units=tel.num_units, num_risky=tel.num_risky,
              num_candidates=tel.num_candidates, num_active=tel.num_active,
              num_locked=tel.num_locked, num_nonfinite_units=tel.num_nonfinite,
              active_unit_steps=tel.active_unit_steps, risky_unit_steps=tel.risky_unit_steps,
              # Recovery mask used by *this* step, and the per-unit scores it produced.
              unit_mask_used=select(ctl.mask), unit_mask_next=select(new_ctl.mask),
              unit_score=select(new_ctl.score), unit_gnmr=select(new_ctl.gnmr),
              unit_delta_gnmr=select(new_ctl.delta_gnmr), unit_norm=select(new_ctl.norm))


def eval_step(state: TrainState, batch: dict, *, spec: StepSpec):
  """(state, batch) -> (sum of token losses, token count), with the mask of the next step."""
  _, mask = _mask_of(spec, state.opt_state)
  total, count = _model_loss_sum(spec.model, state.params, batch, mask, state.amax_history)
  return total, jnp.float32(count)
