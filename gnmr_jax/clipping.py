"""Gradient-spike clipping baselines the paper does not give: ZClip and AdaGC.

* :func:`zclip`: ZClip-style z-score clipping of the global gradient norm
  (Kumar et al., 2025): an EMA of the norm's mean and variance; a norm whose
  z-score exceeds ``z_threshold`` is scaled down to ``mean + z_threshold * std``.
* :func:`adagc`: AdaGC-style per-tensor adaptive clipping (Wang et al., 2025):
  each leaf is clipped to ``ratio`` times an EMA of its own past (clipped) norms.

Same-budget random recovery is a controller: :func:`gnmr_jax.control.research.random`.

The GNMR ablations need no code: score only = ``beta`` huge, dGNMR only =
``alpha`` huge, no lock = ``t_lock=0``, and global clipping is
``optax.clip_by_global_norm``.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from gnmr_jax import clipping
  >>> tx = optax.chain(clipping.zclip(z_threshold=2.5, warmup=5), optax.adamw(1e-3))
  >>> state = tx.init({'w': jnp.ones((2, 2))})
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gnmr_jax.control import checks as _checks


_check_fraction = _checks.check_fraction
_check_positive = _checks.check_positive
_check_int = _checks.check_int


def _scale_tree(tree, factor):
  return jax.tree_util.tree_map(lambda g: (g * factor.astype(g.dtype)).astype(g.dtype), tree)


# --- ZClip ---------------------------------------------------------------------------------


class ZClipState(NamedTuple):
  """State of :func:`zclip`."""
  count: jax.Array      # int32 []: finite steps seen
  mean: jax.Array       # float32 []: EMA of the (clipped) global gradient norm
  var: jax.Array        # float32 []: EMA of its squared deviation
  num_clipped: jax.Array  # int32 []: cumulative number of clipped steps


def zclip(z_threshold: float = 2.5, ema_decay: float = 0.97, warmup: int = 25,
          eps: float = 1e-6) -> optax.GradientTransformation:
  r"""ZClip-style adaptive clipping of the global gradient norm by its z-score.

  With :math:`n_t = \lVert g_t \rVert_2` (all leaves), running mean :math:`\mu`
  and variance :math:`v`:

  * steps :math:`t \le` ``warmup``: no clipping; :math:`\mu, v` are the plain
    mean and (population) variance of :math:`n_1..n_t`;
  * afterwards :math:`z = (n_t - \mu) / \sqrt{v + \epsilon}`; if
    :math:`z > z_{thr}` the gradient is scaled to norm
    :math:`c_t = \mu + z_{thr}\sqrt{v + \epsilon}`, else :math:`c_t = n_t`; then
    :math:`\mu \leftarrow d\mu + (1-d)c_t`,
    :math:`v \leftarrow d v + (1-d)(c_t - \mu_{new})^2` with :math:`d` = ``ema_decay``.

  A non-finite norm passes the gradient through unchanged and leaves the
  statistics alone (a later ``apply_if_finite`` skips the step).

  Args:
    z_threshold: z-score above which the norm is clipped (> 0).
    ema_decay: EMA decay of the mean and variance, in [0, 1).
    warmup: steps that only collect statistics (>= 1).
    eps: added to the variance before the square root (> 0).

  Returns:
    An ``optax.GradientTransformation`` with a :class:`ZClipState`.
  """
  _check_positive("zclip: z_threshold", z_threshold)
  _check_fraction("zclip: ema_decay", ema_decay)
  _check_int("zclip: warmup", warmup, 1)
  _check_positive("zclip: eps", eps)

  def init_fn(params):
    del params
    return ZClipState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32),
                      jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates).astype(jnp.float32)
    finite = jnp.isfinite(norm)
    count = state.count + finite.astype(jnp.int32)
    in_warmup = count <= warmup
    std = jnp.sqrt(state.var + eps)
    z = (norm - state.mean) / std
    clip = finite & ~in_warmup & (z > z_threshold)
    clipped_norm = jnp.where(clip, state.mean + z_threshold * std, norm)
    factor = jnp.where(clip, clipped_norm / jnp.where(norm > 0, norm, 1.0), 1.0)
    # Warmup: exact running mean and population variance (Welford).
    n = jnp.maximum(count, 1).astype(jnp.float32)
    w_mean = state.mean + (norm - state.mean) / n
    w_var = state.var + ((norm - state.mean) * (norm - w_mean) - state.var) / n
    e_mean = ema_decay * state.mean + (1 - ema_decay) * clipped_norm
    e_var = ema_decay * state.var + (1 - ema_decay) * jnp.square(clipped_norm - e_mean)
    mean = jnp.where(finite, jnp.where(in_warmup, w_mean, e_mean), state.mean)
    var = jnp.where(finite, jnp.where(in_warmup, w_var, e_var), state.var)
    new_state = ZClipState(count, mean.astype(jnp.float32), var.astype(jnp.float32),
                           state.num_clipped + clip.astype(jnp.int32))
    return _scale_tree(updates, factor), new_state

  return optax.GradientTransformation(init_fn, update_fn)


# --- AdaGC ---------------------------------------------------------------------------------


class AdaGCState(NamedTuple):
  """State of :func:`adagc`."""
  count: jax.Array      # int32 []: finite steps seen
  ema_norm: object      # float32 [] per leaf: EMA of the leaf's (clipped) gradient norm
  num_clipped: jax.Array  # int32 []: cumulative number of (leaf, step) clips


def adagc(ratio: float = 1.05, ema_decay: float = 0.98, warmup: int = 25,
          warmup_global_clip: float = 1.0) -> optax.GradientTransformation:
  r"""AdaGC-style per-tensor adaptive clipping against each tensor's own norm history.

  For every leaf :math:`i` with :math:`n_{i,t} = \lVert g_{i,t} \rVert_2` and
  EMA :math:`\gamma_i`:

  * steps :math:`t \le` ``warmup``: the whole gradient is clipped to global norm
    ``warmup_global_clip`` (0 disables that) and :math:`\gamma_i` is the plain
    mean of the leaf's post-clip norms so far;
  * afterwards :math:`\hat g_i = g_i \min(1, \lambda\gamma_i / n_{i,t})` with
    :math:`\lambda` = ``ratio``, and
    :math:`\gamma_i \leftarrow d\gamma_i + (1-d)\lVert \hat g_i \rVert`.

  A step with any non-finite gradient passes through unchanged and leaves the
  statistics alone.

  Args:
    ratio: :math:`\lambda`, the allowed factor over the EMA norm (> 0).
    ema_decay: EMA decay :math:`d`, in [0, 1).
    warmup: steps of global clipping while the EMAs form (>= 1).
    warmup_global_clip: global-norm clip during warmup (>= 0, 0 = none).

  Returns:
    An ``optax.GradientTransformation`` with an :class:`AdaGCState`.
  """
  _check_positive("adagc: ratio", ratio)
  _check_fraction("adagc: ema_decay", ema_decay)
  _check_int("adagc: warmup", warmup, 1)
  if isinstance(warmup_global_clip, bool) or not isinstance(
      warmup_global_clip, numbers.Real) or not 0 <= warmup_global_clip < float("inf"):
    raise ValueError(f"adagc: warmup_global_clip must be a finite float >= 0, "
                     f"got {warmup_global_clip!r}.")

  def leaf_norm(g):
    return jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))

  def init_fn(params):
    return AdaGCState(jnp.zeros((), jnp.int32),
                      jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.float32), params),
                      jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    norms = jax.tree_util.tree_map(leaf_norm, updates)
    global_norm = jnp.sqrt(sum(jnp.square(n) for n in jax.tree_util.tree_leaves(norms)))
    finite = jnp.isfinite(global_norm)
    count = state.count + finite.astype(jnp.int32)
    in_warmup = count <= warmup
    if warmup_global_clip > 0:
      warm_factor = jnp.minimum(1.0, warmup_global_clip / jnp.where(
          global_norm > 0, global_norm, 1.0))
    else:
      warm_factor = jnp.float32(1.0)
    n = jnp.maximum(count, 1).astype(jnp.float32)

    def per_leaf(g, norm, ema):
      limit = ratio * ema
      adaptive = jnp.where(norm > limit, limit / jnp.where(norm > 0, norm, 1.0), 1.0)
      factor = jnp.where(finite, jnp.where(in_warmup, warm_factor, adaptive), 1.0)
      clipped = norm * factor
      new_ema = jnp.where(in_warmup, ema + (clipped - ema) / n,
                          ema_decay * ema + (1 - ema_decay) * clipped)
      new_ema = jnp.where(finite, new_ema, ema).astype(jnp.float32)
      was_clipped = finite & ~in_warmup & (norm > limit)
      return (g * factor.astype(g.dtype)).astype(g.dtype), new_ema, was_clipped

    out = jax.tree_util.tree_map(per_leaf, updates, norms, state.ema_norm)
    treedef = jax.tree_util.tree_structure(updates)
    triples = treedef.flatten_up_to(out)
    new_updates = treedef.unflatten([t[0] for t in triples])
    new_ema = treedef.unflatten([t[1] for t in triples])
    clips = sum((t[2].astype(jnp.int32) for t in triples), jnp.zeros((), jnp.int32))
    return new_updates, AdaGCState(count, new_ema, state.num_clipped + clips)

  return optax.GradientTransformation(init_fn, update_fn)
