"""The GNMR controller: an optax transform that outputs a per-unit recovery mask.

GNMR (Gradient Norm-to-Mean Ratio, arXiv 2606.00539) watches every recoverable
unit u (a projection matrix, or one layer's slice of a layer-stacked matrix) and
picks, under a hard budget, the few that run the high-fidelity recovery path on
the next step. At step t = 1, 2, ...:

  n_t      = ||g_t||_F in float32
  GNMR_t   = n_t / mean(n_1 .. n_{t-1})                (1 with no history)
  dGNMR_t  = GNMR_t / mean(GNMR_{t-1} .. GNMR_{t-delta}) (fewer while fewer exist; 1 with none)
  risky    = GNMR_t > alpha_t  or  dGNMR_t > beta_t  or  n_t not finite
  r        = max(GNMR_t / alpha_t, dGNMR_t / beta_t)     (+inf for a non-finite norm)
  cand     = risky or lock > 0
  mask     = top max_o candidates by r (ties: first unit in tree order)
  lock     = t_lock if selected and risky; lock - 1 if calm and lock > 0; else unchanged

Edge rules (this project's reading of the paper):
  * Only finite values enter the statistics: a non-finite norm is added neither
    to the running mean nor to the window, and a GNMR that is +inf (a non-zero
    norm after an all-zero history) is not added to the window. The history
    therefore stays finite whatever the gradients do.
  * Ratios with a zero denominator: 0/0 = 1 (calm), x/0 = +inf for x > 0.
  * For t <= warmup the statistics accumulate but the mask stays all False and
    no lock is set.
  * The mask computed at step t is the recovery mask for step t + 1. A single
    isolated spike at step t, with no competition for the budget, gives a mask
    that is True at steps t .. t + t_lock (t_lock + 1 steps).
  * alpha and beta may be optax schedules; they are evaluated at the number of
    updates done before this one (0 on the first update), like optax schedules.
  * ``update(..., overflow=tree)`` (a params-shaped bool tree, per unit): units whose
    low-cost path overflowed this step (delayed scaling: an amax past its scale's range
    saturated its codes; ``gnmr_jax.model.amax_saturation_units`` > 1) are risky too, with a
    score of at least 1 (a threshold's worth), so they compete for the budget like an alarm.

The transform passes updates through unchanged, so it chains anywhere; put it
first so that it sees the raw gradients.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from gnmr_jax.control import checks as _checks
from gnmr_jax.control import units as units_lib

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]


class GNMRTelemetry(NamedTuple):
  """Per-step counts, cheap to fetch for logging (all int32 scalars).

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=4, max_o=2, t_lock=1)
    >>> telemetry = tx.init({'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}).telemetry
    >>> {name: int(count) for name, count in telemetry._asdict().items()}['num_units']
    2
  """
  num_units: jax.Array        # number of recoverable units (constant)
  num_risky: jax.Array        # units over a threshold (or non-finite) this step
  num_candidates: jax.Array   # risky or locked units this step
  num_active: jax.Array       # units in the mask for the next step (<= max_o)
  num_locked: jax.Array       # units with lock > 0 after this step
  num_nonfinite: jax.Array    # units whose gradient norm was NaN/Inf this step
  active_unit_steps: jax.Array  # cumulative sum of num_active over all steps
  risky_unit_steps: jax.Array   # cumulative sum of num_risky over all steps


class GNMRState(NamedTuple):
  """State of :func:`gnmr`.

  Per-unit fields are :class:`gnmr_jax.control.UnitValues`: one array of shape [N] over
  the N units (``window``: [N, delta]) that reads like a tree mirroring the params, each
  leaf of shape () or (L,) for layer-stacked leaves (``window`` adds a trailing (delta,)
  axis) and scalar False/0 at leaves that are not recoverable units.
  :func:`gnmr_jax.controller_state` gives them as those trees.

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=3, max_o=1, t_lock=2)
    >>> state = tx.init({'w': jnp.ones((4, 4)), 'b': jnp.zeros(4)})
    >>> state.window['w'].shape, state.window['b'].shape, int(state.telemetry.num_units)
    ((3,), (), 1)
    >>> state.window.values.shape  # what is stored: one row per unit
    (1, 3)
  """
  count: jax.Array        # int32 []: number of updates done
  mask: Any               # bool: recovery mask for the next step
  lock: Any               # int32: remaining lock steps
  gnmr: Any               # float32: GNMR_t of the last step (+inf for non-finite norms)
  delta_gnmr: Any         # float32: dGNMR_t of the last step
  score: Any              # float32: risk score r of the last step
  risky: Any              # bool: over a threshold (or non-finite) at the last step
  norm: Any               # float32: gradient norm of the last step
  norm_sum: Any           # float32: sum of all finite past norms
  norm_count: Any         # int32: number of finite past norms
  window: Any             # float32 [..., delta]: ring buffer of the last finite GNMR values
  window_count: Any       # int32: number of GNMR values ever written to the window
  telemetry: GNMRTelemetry


def _safe_ratio(num, den):
  """num / den for num >= 0 with 0/0 = 1 and x/0 = +inf."""
  safe_den = jnp.where(den > 0, den, 1.0)
  return jnp.where(den > 0, num / safe_den,
                   jnp.where(num > 0, jnp.inf, 1.0)).astype(jnp.float32)


def _eval(value, count):
  if callable(value):
    return jnp.asarray(value(count), jnp.float32)
  return jnp.asarray(value, jnp.float32)


def is_params_placeholder(params) -> bool:
  """Whether ``params`` is the leafless stand-in that optax.tree_map_params passes to init."""
  return (type(params).__name__ == "_ParamsPlaceholder" and
          type(params).__module__.startswith("optax.") and
          not jax.tree_util.tree_leaves(params))


def _describe_selector(selector) -> str:
  if selector is None:
    return "None: every leaf with ndim >= 2"
  if isinstance(selector, str):
    return f"regex {selector!r}"
  return f"callable {getattr(selector, '__name__', type(selector).__name__)}"


def _zero():  # a fresh buffer each time, so the state can be donated
  return jnp.zeros((), jnp.int32)


def _placeholder_state() -> GNMRState:
  """optax.tree_map_params calls init with one leafless placeholder and treats every state field
  equal to it as a params tree. The per-unit fields are not params trees (their leaves are () or
  (L,)), so they are plain leaves here: tree_map_params hands them to `transform_non_params`."""
  return GNMRState(_zero(), *(_zero() for _ in range(11)),
                   telemetry=GNMRTelemetry(*(_zero() for _ in range(8))))


def _init_state(layout, delta: int) -> GNMRState:
  num_units = layout.num_units

  def per_unit(dtype, trailing=()):
    return layout.values(jnp.zeros((num_units,) + tuple(trailing), dtype))

  return GNMRState(
      count=_zero(), mask=per_unit(jnp.bool_), lock=per_unit(jnp.int32),
      gnmr=per_unit(jnp.float32), delta_gnmr=per_unit(jnp.float32),
      score=per_unit(jnp.float32), risky=per_unit(jnp.bool_),
      norm=per_unit(jnp.float32), norm_sum=per_unit(jnp.float32),
      norm_count=per_unit(jnp.int32), window=per_unit(jnp.float32, (delta,)),
      window_count=per_unit(jnp.int32),
      telemetry=GNMRTelemetry(jnp.asarray(num_units, jnp.int32), *(_zero() for _ in range(7))))


def _held_layout(layout, state):
  """The layout held in the state, after a static check that init and this update chose the
  same units (e.g. Flax NNX inits with Variable boxes and updates with bare arrays)."""
  held = units_lib.unbox(state.window)
  if not isinstance(held, units_lib.UnitValues):
    raise ValueError(
        f"gnmr: the state's per-unit fields are {type(held).__name__}, not UnitValues: a "
        f"state from another gnmr_jax version (per-unit trees) or one built by hand cannot "
        f"be updated; start from `init` (checkpoints of the old layout are refused).")
  if held.layout.unit_shapes() != layout.unit_shapes():
    got, want = held.layout, layout
    diffs = [f"{u.path!r}: update {u.unit_shape if u.is_unit else 'not a unit'}, state "
             f"{h.unit_shape if h.is_unit else 'not a unit'}"
             for u, h in zip(want, got) if (u.is_unit, u.unit_shape) != (h.is_unit,
                                                                           h.unit_shape)][:3]
    raise ValueError(
        f"gnmr: the update's unit layout differs from the one at init ({len(want)} leaves "
        f"with {want.num_units} units in the update, {len(got)} leaves with "
        f"{got.num_units} units in the state; unit shapes differ at {diffs}). The gradients "
        f"must have the structure of the params given to init.")
  return held.layout


class _Risk(NamedTuple):
  """One step's statistics, [N] per unit."""
  norm: jax.Array
  finite: jax.Array
  ratio: jax.Array        # GNMR_t
  delta_ratio: jax.Array  # dGNMR_t
  risky: jax.Array
  score: jax.Array


def _risk(layout, state: GNMRState, norm, alpha_t, beta_t, delta: int, overflowed) -> _Risk:
  """GNMR_t, dGNMR_t, the alarm and the score from this step's norms and the history."""
  norm_sum, norm_count = layout.flat(state.norm_sum), layout.flat(state.norm_count)
  window = layout.flat(state.window, trailing=1)
  window_count = layout.flat(state.window_count)
  finite = jnp.isfinite(norm)
  hist_mean = norm_sum / jnp.maximum(norm_count, 1).astype(jnp.float32)
  ratio = _safe_ratio(jnp.where(finite, norm, 0.0), hist_mean)
  ratio = jnp.where(norm_count > 0, ratio, 1.0)
  ratio = jnp.where(finite, ratio, jnp.inf)
  window_len = jnp.minimum(window_count, delta)
  window_mean = jnp.sum(window, axis=-1) / jnp.maximum(window_len, 1).astype(jnp.float32)
  delta_ratio = _safe_ratio(jnp.where(finite, ratio, 0.0), window_mean)
  delta_ratio = jnp.where(window_len > 0, delta_ratio, 1.0)
  delta_ratio = jnp.where(finite, delta_ratio, jnp.inf)

  risky = (ratio > alpha_t) | (delta_ratio > beta_t) | ~finite
  score = jnp.where(finite, jnp.maximum(ratio / alpha_t, delta_ratio / beta_t), jnp.inf)
  # An infinite threshold never scores (research.saturation): inf / inf is no risk, not NaN,
  # which would rank an overflowed or locked unit below every other.
  score = jnp.where(jnp.isnan(score), 0.0, score)
  if overflowed is not None:  # see "Edge rules": a saturated low-cost step is an alarm
    risky = risky | overflowed
    score = jnp.where(overflowed, jnp.maximum(score, 1.0), score)
  return _Risk(norm, finite, ratio, delta_ratio, risky, score)


def _next_state(layout, state: GNMRState, risk: _Risk, candidate, selected, new_lock,
                delta: int) -> GNMRState:
  """The state after a step: the history, the window, the mask, the lock and the counts."""
  norm_sum, norm_count = layout.flat(state.norm_sum), layout.flat(state.norm_count)
  window = layout.flat(state.window, trailing=1)
  window_count = layout.flat(state.window_count)
  # Only finite values enter the history (see "Edge rules" above).
  new_norm_sum = norm_sum + jnp.where(risk.finite, risk.norm, 0.0)
  new_norm_count = norm_count + risk.finite.astype(jnp.int32)
  add_to_window = jnp.isfinite(risk.ratio)
  slot = jax.nn.one_hot(window_count % delta, delta, dtype=jnp.bool_) & add_to_window[:, None]
  new_window = jnp.where(slot, risk.ratio[:, None], window)
  new_window_count = window_count + add_to_window.astype(jnp.int32)

  def count(x):
    return jnp.sum(x, dtype=jnp.int32)

  tel = state.telemetry
  num_active, num_risky = count(selected), count(risk.risky)
  telemetry = tel._replace(
      num_risky=num_risky, num_candidates=count(candidate), num_active=num_active,
      num_locked=count(new_lock > 0), num_nonfinite=count(~risk.finite),
      active_unit_steps=tel.active_unit_steps + num_active,
      risky_unit_steps=tel.risky_unit_steps + num_risky)

  def back(vec, dtype):
    return layout.values(vec.astype(dtype))

  return GNMRState(
      count=state.count + 1, mask=back(selected, jnp.bool_), lock=back(new_lock, jnp.int32),
      gnmr=back(risk.ratio, jnp.float32), delta_gnmr=back(risk.delta_ratio, jnp.float32),
      score=back(risk.score, jnp.float32), risky=back(risk.risky, jnp.bool_),
      norm=back(risk.norm, jnp.float32), norm_sum=back(new_norm_sum, jnp.float32),
      norm_count=back(new_norm_count, jnp.int32), window=back(new_window, jnp.float32),
      window_count=back(new_window_count, jnp.int32), telemetry=telemetry)


def gnmr(*, alpha: ScalarOrSchedule, beta: ScalarOrSchedule, delta: int, max_o: int,
         t_lock: int, warmup: int = 0, units=None,
         layer_axis=None) -> optax.GradientTransformationExtraArgs:
  """GNMR runtime stability controller (see the module docstring for the rules).

  Args:
    alpha: threshold on GNMR_t (float > 0, a jax/numpy real scalar > 0, or an
      optax schedule of the step).
    beta: threshold on dGNMR_t (same forms as ``alpha``).
    delta: length of the short window of past GNMR values for dGNMR (>= 1).
    max_o: hard cap on the number of units in the recovery mask (>= 0).
    t_lock: lock length: a unit selected while risky stays a candidate for
      t_lock more steps (>= 0).
    warmup: number of first steps during which statistics accumulate but the
      mask stays all False (>= 0).
    units: which leaves are recoverable: None (every leaf with ndim >= 2), a
      regex searched in the '/'-joined key path (e.g.
      ``r'(attn|mlp)/\\w+/kernel'``), or a callable ``(path, leaf) -> bool``.
      Flax boxes (``nn.Partitioned``, ``nnx.Variable``) are not part of the
      path and callables get the array inside them.
    layer_axis: for layer-stacked leaves: None, a regex (matching leaves are
      split along axis 0), or a callable ``(path, leaf) -> int | None``. Each
      slice along that axis is its own unit.

  Only ``alpha`` and ``beta`` may be injected with ``optax.inject_hyperparams``
  (changing them mid-run takes effect at the next update); ``delta``,
  ``max_o``, ``t_lock``, ``warmup``, ``units`` and ``layer_axis`` set shapes or
  Python control flow and must stay static:
  ``optax.inject_hyperparams(gnmr, static_args=('delta', 'max_o', 't_lock', 'warmup'))``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that passes updates through
    unchanged and keeps a :class:`GNMRState`. Its per-unit state leaves are
    plain arrays (no Flax boxes), so the partition specs Flax derives for
    them are replicated, and ``optax.tree_map_params`` treats them as
    non-parameter fields.

  Raises:
    ValueError: for invalid arguments (at construction); at init, when
      ``units`` (regex, callable or None) selects no leaf; at trace time of
      update, when the gradients' unit layout differs from the one at init.

  Example:
    >>> import jax.numpy as jnp, optax, gnmr_jax
    >>> tx = optax.chain(gnmr_jax.gnmr(alpha=3.0, beta=2.0, delta=4, max_o=1, t_lock=2),
    ...                  optax.adamw(1e-3))
    >>> params = {'w': jnp.ones((4, 4)), 'b': jnp.zeros(4)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.ones((4, 4)), 'b': jnp.ones(4)}, state, params)
    >>> bool(gnmr_jax.recovery_mask(state)['w']), gnmr_jax.recovery_mask(state)['b'].dtype
    (False, dtype('bool'))
  """
  _checks.check_positive_or_schedule("gnmr: `alpha`", alpha)
  _checks.check_positive_or_schedule("gnmr: `beta`", beta)
  for name, value, minimum in (("delta", delta, 1), ("max_o", max_o, 0), ("t_lock", t_lock, 0),
                               ("warmup", warmup, 0)):
    _checks.check_int(f"gnmr: `{name}`", value, minimum, _checks.STATIC_HINT)
  unit_selector = units_lib.compile_selector(units, "units")
  axis_selector = units_lib.compile_selector(layer_axis, "layer_axis")

  def init_fn(params):
    if is_params_placeholder(params):
      return _placeholder_state()
    layout = units_lib.resolve_units(params, unit_selector, axis_selector)
    if layout.num_units == 0:
      raise ValueError(f"gnmr: `units` ({_describe_selector(units)}) selects no leaf, so the "
                       f"controller would never recover anything; leaf paths are e.g. "
                       f"{[u.path for u in layout[:5]]}.")
    return _init_state(layout, delta)

  def update_fn(updates, state, params=None, overflow=None, **extra_args):
    del params, extra_args
    # The rows follow the layout held in the state (made at init), so the state's pytree
    # structure is the same after every update (jit caches, scan carries, donation).
    layout = _held_layout(units_lib.resolve_units(updates, unit_selector, axis_selector), state)
    risk = _risk(layout, state, layout.norms(updates), _eval(alpha, state.count),
                 _eval(beta, state.count), delta,
                 None if overflow is None else layout.flat(overflow).astype(jnp.bool_))
    lock = layout.flat(state.lock)
    candidate = risk.risky | (lock > 0)
    # Top max_o candidates by score; a stable sort keeps tree order among ties.
    order = jnp.argsort(jnp.where(candidate, -risk.score, jnp.inf), stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    step = state.count + 1
    selected = candidate & (rank < max_o) & (step > warmup)
    new_lock = jnp.where(selected & risk.risky, t_lock,
                         jnp.where(~risk.risky & (lock > 0), lock - 1, lock)).astype(jnp.int32)
    return updates, _next_state(layout, state, risk, candidate, selected, new_lock, delta)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
