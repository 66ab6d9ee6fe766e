"""The optimizer chain built from config: chain(gnmr, guard(chain(clip, adamw)))."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from gnmr_jax import control
from gnmr_jax.control import units as units_lib


SCHEDULES = ("cosine", "wsd")


def learning_rate_schedule(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then (``opt.schedule``):

  - ``'cosine'``: cosine decay to min_lr_ratio * peak at total_steps (the default);
  - ``'wsd'``: warmup-stable-decay: the peak until the last ``opt.decay_fraction`` of the steps
    (rounded, at least one), then linear decay to min_lr_ratio * peak at total_steps.
  """
  kind = opt.get("schedule", "cosine")  # configs written before the field: cosine
  peak, end = opt.learning_rate, opt.learning_rate * opt.min_lr_ratio
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=opt.warmup_steps,
        decay_steps=max(total_steps, opt.warmup_steps + 1), end_value=end)
  if kind != "wsd":
    raise ValueError(f"config.optimizer.schedule must be one of {list(SCHEDULES)}, got {kind!r}.")
  decay = max(1, round(total_steps * opt.decay_fraction))
  stable_end = max(total_steps - decay, opt.warmup_steps)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, max(opt.warmup_steps, 1)), optax.constant_schedule(peak),
       optax.linear_schedule(peak, end, max(total_steps - stable_end, 1))],
      boundaries=[opt.warmup_steps, stable_end])


class ZeroNonfiniteState(NamedTuple):
  """State of :func:`zero_nonfinite_units`."""
  inner_state: Any
  num_zeroed: jax.Array    # int32 []: units (and non-unit leaves) zeroed at the last step
  total_zeroed: jax.Array  # int32 []: cumulative count over all steps


def zero_nonfinite_units(inner: optax.GradientTransformation, units=None,
                         layer_axis=None) -> optax.GradientTransformationExtraArgs:
  """Runs `inner` with every non-finite unit's gradient replaced by zeros, then zeroes that
  unit's update; the other units update normally.

  Granularity: one recoverable unit (a leaf, or one layer's slice of a layer-stacked leaf,
  selected like :func:`gnmr_jax.gnmr`'s `units` / `layer_axis`); other leaves as a whole. NaN and
  Inf therefore reach neither the parameters nor `inner`'s state (AdamW's moments see a zero
  gradient for that unit: finite, decayed by b1 / b2 for one step), and a global-norm clip
  inside `inner` sees only the finite units.

  Args:
    inner: the transform to guard (e.g. chain(clip, adamw)).
    units: regex / callable / None selecting recoverable leaves (None: ndim >= 2).
    layer_axis: regex / callable / None for layer-stacked leaves.

  Returns:
    A transform with state :class:`ZeroNonfiniteState`.
  """
  unit_selector = units_lib.compile_selector(units, "units")
  axis_selector = units_lib.compile_selector(layer_axis, "layer_axis")

  def init_fn(params):
    return ZeroNonfiniteState(inner.init(params), jnp.zeros((), jnp.int32),
                              jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    layout = units_lib.resolve_units(updates, unit_selector, axis_selector)
    finite, num_bad = [], jnp.zeros((), jnp.int32)
    for leaf, info in zip(leaves, layout):
      if info.is_unit and info.layer_axis is not None:
        axes = tuple(a for a in range(leaf.ndim) if a != info.layer_axis)
        ok = jnp.all(jnp.isfinite(leaf), axis=axes, keepdims=True)
      else:
        ok = jnp.all(jnp.isfinite(leaf))
      num_bad = num_bad + jnp.sum(~ok, dtype=jnp.int32)
      finite.append(ok)
    clean = [jnp.where(ok, leaf, jnp.zeros((), leaf.dtype)) for leaf, ok in zip(leaves, finite)]
    new_updates, inner_state = inner.update(jax.tree_util.tree_unflatten(treedef, clean),
                                            state.inner_state, params, **extra_args)
    out = [jnp.where(ok, u, jnp.zeros((), u.dtype))
           for u, ok in zip(jax.tree_util.tree_leaves(new_updates), finite)]
    return jax.tree_util.tree_unflatten(treedef, out), ZeroNonfiniteState(
        inner_state, num_bad, state.total_zeroed + num_bad)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skip_nonfinite(inner: optax.GradientTransformation,
                   max_consecutive_errors: int = 2**30) -> optax.GradientTransformationExtraArgs:
  """``optax.apply_if_finite(inner, max_consecutive_errors)`` with its state and results, bit
  for bit, without its ``lax.cond``: ``inner`` runs every step and a select keeps the old state
  (and zero updates) where the step is not finite.

  Why: a donated optimizer state passed through a conditional is copied (one branch returns it
  as it is, the other anew), and the select fuses into the update, which then writes in place:
  compiled for a TPU v6e, llama:1b's train step holds 20.62 GB of temporaries under
  ``apply_if_finite`` and 8.17 GB under this (benchmarks/aot_fit.py; the same without a guard).
  The price is ``inner``'s elementwise work on a skipped step, which a run skips rarely.
  """
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True, jnp.bool_),
        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update(updates, state, params=None, **extra_args):
    finite = jnp.array(True)
    for leaf in jax.tree_util.tree_leaves(updates):
      finite &= jnp.all(jnp.isfinite(leaf))
    notfinite_count = jnp.where(finite, jnp.zeros([], jnp.int32),
                                optax.safe_increment(state.notfinite_count))
    apply = finite | (notfinite_count > max_consecutive_errors)
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    new_updates = jax.tree_util.tree_map(lambda u: jnp.where(apply, u, jnp.zeros_like(u)),
                                         new_updates)
    new_inner = jax.tree_util.tree_map(lambda new, old: jnp.where(apply, new, old), new_inner,
                                       state.inner_state)
    return new_updates, optax.ApplyIfFiniteState(
        notfinite_count=notfinite_count, last_finite=finite,
        total_notfinite=jnp.where(finite, state.total_notfinite,
                                  optax.safe_increment(state.total_notfinite)),
        inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(config: ml_collections.ConfigDict,
                   pre_update=()) -> optax.GradientTransformation:
  """optax.chain(gnmr, skip_nonfinite(chain(clip, adamw))) from config.

  The controller comes first so it sees raw gradients, including non-finite
  ones (it ranks those units first and keeps them out of its history); the
  guard then skips the parameter update of a non-finite step, so NaN/Inf never
  reaches the parameters. With nonfinite='zero' the guard is
  :func:`zero_nonfinite_units` instead: only the non-finite units' updates are zeroed.
  `pre_update` transforms (e.g. gnmr_jax.clipping.zclip()) run inside the guard, after the
  global clip and before AdamW.
  """
  opt = config.optimizer
  schedule = learning_rate_schedule(opt, config.train.steps)
  inner = []
  if opt.grad_clip > 0:
    inner.append(optax.clip_by_global_norm(opt.grad_clip))
  inner.extend(pre_update)
  inner.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay))
  update = optax.chain(*inner)
  if opt.nonfinite == "skip":
    update = skip_nonfinite(update)
  elif opt.nonfinite == "zero":
    update = zero_nonfinite_units(update, config.gnmr.units or None,
                                  config.gnmr.layer_axis or None)
  parts = [control.from_config(config.gnmr, config.train.seed)] if config.gnmr.enabled else []
  return optax.chain(*parts, update)
