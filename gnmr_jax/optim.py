"""The optimizer chain built from config: chain(gnmr, guard(chain(clip, adamw)))."""

from __future__ import annotations

import ml_collections
import optax

from gnmr_jax.controller import gnmr


def learning_rate_schedule(opt: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to min_lr_ratio * peak at total_steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.learning_rate, warmup_steps=opt.warmup_steps,
      decay_steps=max(total_steps, opt.warmup_steps + 1),
      end_value=opt.learning_rate * opt.min_lr_ratio)


def controller_from_config(g: ml_collections.ConfigDict) -> optax.GradientTransformationExtraArgs:
  """gnmr_jax.gnmr(...) with the fields of config.gnmr."""
  return gnmr(alpha=g.alpha, beta=g.beta, delta=g.delta, max_o=g.max_o, t_lock=g.t_lock,
              warmup=g.warmup, units=g.units or None, layer_axis=g.layer_axis or None)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """optax.chain(gnmr, apply_if_finite(chain(clip, adamw))) from config.

  The controller comes first so it sees raw gradients, including non-finite
  ones (it ranks those units first and keeps them out of its history); the
  guard then skips the parameter update of a non-finite step, so NaN/Inf never
  reaches the parameters.
  """
  opt = config.optimizer
  schedule = learning_rate_schedule(opt, config.train.steps)
  inner = []
  if opt.grad_clip > 0:
    inner.append(optax.clip_by_global_norm(opt.grad_clip))
  inner.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay))
  update = optax.chain(*inner)
  if opt.nonfinite == "skip":
    update = optax.apply_if_finite(update, max_consecutive_errors=2**30)
  parts = [controller_from_config(config.gnmr)] if config.gnmr.enabled else []
  return optax.chain(*parts, update)
