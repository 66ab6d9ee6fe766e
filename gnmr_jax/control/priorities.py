"""The engine of the budgeted controllers: units ranked by other signals than the paper's score.

:func:`gnmr_jax.gnmr` is the paper's rule and stays exactly that. :func:`budgeted` keeps its
budget (``max_o`` units per step), its warmup and a lock, but ranks the units by one of these
priorities (each has its constructor, which checks its own arguments:
:mod:`gnmr_jax.control.recommended` for 'norm' and the static recipes,
:mod:`gnmr_jax.control.research` for the others; ``config.gnmr.priority`` names them for
:func:`gnmr_jax.control.from_config`):

  'norm'    the raw gradient-norm level ||g_u(t)||: the units with the largest
            gradients run the recovery path at t + 1. Free: the controller
            computes the norms anyway.
  'gap'     a measured recovery gap e_u (control/recovery_gap.py: u's low-cost
            against its recovery gradient), passed in by the train step every K
            steps (``recovery_gap=`` extra argument, a RecoveryGap); each unit
            keeps the estimate est <- gap_decay * est + (1 - gap_decay) * e_u (the
            first measurement is taken as is), updated where the measurement is
            ``valid``: every unit with the 'uniform' and 'swapped' measuring passes;
            with the 'recovery' pass (the default) only the units outside the mask, so
            the units a measurement selects keep that estimate while they stay
            selected (in practice the set picked by the first measurement).
  'relgap'  the norm level scaled by a measured *relative* gap: ||g_u(t)|| * r_u with
            r_u the estimate (as for 'gap') of e_u / ||g_rec,u|| from the measurements
            (1 before u's first one). Meant to age better than a stale absolute gap
            if the relative error of a unit's path moved slowly; on the CPU scenario
            model it did not (RESULTS.md, "Selection": it ranked like 'norm' and closed
            no more of the loss gap).
  'oracle'  'gap' with ``gap_decay=0``: the last measurement alone. Measured at
            every step it is the lagged oracle (top-max_o by e_u(t), used at
            t + 1), a baseline rather than a deployable controller.
  'hybrid'  GNMR's transient risk wins the budget first (units over alpha_t or
            beta_t, ranked by the paper's score r), the norm level fills it.
  'random'  max_o units drawn uniformly at random (the same-budget baseline).
  'noise'   the quantization-noise fraction pi_u = EMA(e_u^2) / EMA(||g_rec,u||^2) of the
            measurements (``gap_decay`` weighs the old EMA; constant between them), and
            a budget that is a cap: a unit is a candidate when pi_u > ``noise_upper`` (1/3:
            FP4 All the Way's sqrt(3) rule per tensor), stays one while in the mask and
            pi_u >= ``noise_lower`` (hysteresis) or locked, and the paper's alarm (risky
            by alpha_t/beta_t, or non-finite) makes a unit a candidate whatever its pi_u.
            Candidates only, at most max_o: the mask may be empty. Alarmed units rank
            first (by the paper's score); the others by pi_u, or with
            ``noise_rank='norm'`` by the gradient-norm level (pi_u then decides whether a
            unit is recovered, the norm level which). With ``noise_gate='any'`` every unit
            is a candidate while any unit's pi_u is over the threshold.
  'fixed'   a static set: the units whose name matches a regex (``fixed_pattern``; at most
            max_o of them) run the recovery path at every step after warmup; no signal,
            no lock. A set chosen in hindsight, or a practitioner's static recipe.
  'last_blocks'  NVIDIA's NVFP4 recipe: every unit of the last ``last_blocks`` layers (of
            each layer-stacked leaf) on the recovery path for the whole run after warmup.
  'late_switch'  a global late switch ("FP4 All the Way"): every unit on the recovery path
            from step ``switch_step`` on (max_o must cover every unit).

Rules shared by every priority ('noise', static recipes: see above), for the mask of step t + 1:

  tier     = 3 if n_t is not finite (not for 'random', which stays uniform); 'hybrid'
             only: 2 if risky by the paper's rule (then ranked by the paper's score r);
             1 if lock > 0; else 0
  mask     = the max_o units first by tier, then by priority (ties: tree order)
  lock     = t_lock for a unit that enters the mask (not in the mask of step t),
             lock - 1 for a locked unit, else 0

so a unit that enters the mask stays in it for at least t_lock + 1 steps (unless
non-finite units, or for 'hybrid' risky ones, take its place), the active set does not
thrash between units of nearly equal priority, and a non-finite gradient is recovered at once. Every unit
is a candidate (these priorities are persistent signals, not alarms), so the mask
holds min(max_o, N) units every step after warmup ('fixed': its set).

The state is a :class:`PriorityState` holding a :class:`gnmr_jax.GNMRState` (the
paper's statistics, computed as by ``gnmr(max_o=0)`` for telemetry and for the
hybrid's transient risk) whose ``mask``, ``lock`` and budget counts are this
controller's, so :func:`gnmr_jax.recovery_mask` and the train loop read it unchanged.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from gnmr_jax.control import checks as _checks
from gnmr_jax.control import paper as gnmr_lib
from gnmr_jax.control import units as units_lib

BUDGETED_PRIORITIES = ("norm", "gap", "relgap", "oracle", "hybrid", "random", "fixed",
                       "last_blocks", "late_switch", "noise")
# Static recipes: a set fixed in advance (and, for 'late_switch', a step), no signal, no lock.
STATIC_PRIORITIES = ("fixed", "last_blocks", "late_switch")
NOISE_RANKS = ("pi", "norm")  # 'noise': how candidates beyond the alarm are ranked
NOISE_GATES = ("unit", "any")  # 'noise': a unit's own pi, or any unit's, makes candidates
# Priorities that need a measured recovery gap from the train step.
GAP_PRIORITIES = ("gap", "relgap", "oracle", "noise")
# The paper's thresholds, window and lock: the budgeted controllers' defaults (alpha, beta and
# delta only feed the telemetry statistics, but for 'hybrid' and 'noise', whose alarm they set).
PAPER_ALPHA, PAPER_BETA, PAPER_DELTA, PAPER_T_LOCK = 2.0, 1.5, 8, 5


class PriorityState(NamedTuple):
  """State of :func:`budgeted` (per-unit fields are UnitValues, like GNMRState's)."""
  controller: gnmr_lib.GNMRState  # paper statistics; mask/lock/budget counts are ours
  gap: Any          # float32: recovery-gap estimate per unit (0 before the first measurement;
                    # 'relgap': of e_u / ||g_rec,u||)
  gap_count: Any    # int32: valid measurements folded into `gap`
  value: Any        # float32: the priority each unit was ranked by at the last step ('random':
                    # its draw; static recipes: 1 in the set, else 0)
  noise_sq: Any     # float32: EMA of e_u^2 over the measurements (every gap priority)
  rec_sq: Any       # float32: EMA of ||g_rec,u||^2; noise_sq / rec_sq is the noise fraction


def budgeted(priority: str, *, name: str, max_o: int, t_lock: int, warmup: int, alpha, beta,
             delta: int, units, layer_axis, gap_decay: float = 0.0, seed: int = 0,
             fixed_pattern: Optional[re.Pattern] = None, last_blocks: int = 0,
             switch_step: int = 0, noise_upper: float = 1 / 3, noise_lower: float = 1 / 6,
             noise_rank: str = "pi",
             noise_gate: str = "unit") -> optax.GradientTransformationExtraArgs:
  """The budgeted controller ranking units by ``priority`` (module docstring).

  The engine behind the constructors (:func:`gnmr_jax.norm_level`, :func:`gnmr_jax.fixed_set`,
  ..., :mod:`gnmr_jax.control.research`): each checks the arguments only its priority reads
  (``gap_decay``, ``seed``, ``fixed_pattern``, ``last_blocks``, ``switch_step``, ``noise_*``)
  and passes the others' defaults; this checks the shared ones, before any tracing.

  Args:
    priority: one of :data:`BUDGETED_PRIORITIES`.
    name: the constructor's name, for error messages.
    max_o: units recovered per step (>= 0; capped at the number of units).
    t_lock: steps a unit that enters the mask stays locked in (>= 0; static recipes: unused).
    warmup: first steps with an empty mask (>= 0).
    alpha, beta, delta: the paper's thresholds and window, for the GNMR statistics kept in
      the state (telemetry) and the alarm of 'hybrid' and 'noise'.
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.
    gap_decay: 'gap', 'relgap', 'noise': weight of the old estimate at each measurement.
    seed: 'random': seed of the draws.
    fixed_pattern: 'fixed': the compiled regex searched in the unit names.
    last_blocks: 'last_blocks': how many of the last layers.
    switch_step: 'late_switch': the first step run with every unit recovered.
    noise_upper, noise_lower, noise_rank, noise_gate: 'noise' (:func:`research.noise`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` passing updates through; its ``update``
    takes an optional ``recovery_gap=`` (a RecoveryGap) extra argument.

  Raises:
    ValueError: an unknown priority or an invalid shared argument, before any tracing; for the
      static recipes, at init, a set that is empty or larger than max_o.
  """
  if priority not in BUDGETED_PRIORITIES:
    raise ValueError(f"{name}: the priority must be one of {BUDGETED_PRIORITIES}, got "
                     f"{priority!r}.")
  for arg, value in (("max_o", max_o), ("t_lock", t_lock)):
    _checks.check_int(f"{name}: `{arg}`", value, 0, _checks.STATIC_HINT)
  # The paper's statistics without its selection (max_o=0 never selects or locks).
  inner = gnmr_lib.gnmr(alpha=alpha, beta=beta, delta=delta, max_o=0, t_lock=0,
                        warmup=warmup, units=units, layer_axis=layer_axis)
  unit_selector = units_lib.compile_selector(units, "units")
  axis_selector = units_lib.compile_selector(layer_axis, "layer_axis")

  def static_set(layout):
    """The static recipe's set as a bool [N] NumPy vector (names and shapes are static)."""
    if priority == "fixed":
      in_set = [fixed_pattern.search(unit) is not None for unit in layout.names()]
      what = f"the pattern {fixed_pattern.pattern!r}"
    elif priority == "last_blocks":
      in_set = []
      for info in layout:
        if info.is_unit:
          num_layers = info.unit_shape[0] if info.unit_shape else 1
          in_set.extend([info.layer_axis is not None and l >= num_layers - last_blocks
                         for l in range(num_layers)])
      what = f"the last {last_blocks} block(s) (units of layer-stacked leaves, see `layer_axis`)"
    else:  # late_switch
      in_set = [True] * layout.num_units
      what = "'late_switch' (every unit)"
    if not any(in_set) or sum(in_set) > max_o:
      raise ValueError(
          f"{name}: {what} selects {sum(in_set)} units; a static set must hold 1 to "
          f"max_o={max_o} (the recovery budget and side buffer). Unit names are e.g. "
          f"{layout.names()[:6]}.")
    return jnp.asarray(in_set)

  def init_fn(params):
    ctl = inner.init(params)
    if priority in STATIC_PRIORITIES and not gnmr_lib.is_params_placeholder(params):
      static_set(units_lib.resolve_units(params, unit_selector, axis_selector))
    return PriorityState(controller=ctl,
                         gap=jax.tree_util.tree_map(jnp.zeros_like, ctl.norm),
                         gap_count=jax.tree_util.tree_map(jnp.zeros_like, ctl.norm_count),
                         value=jax.tree_util.tree_map(jnp.zeros_like, ctl.norm),
                         noise_sq=jax.tree_util.tree_map(jnp.zeros_like, ctl.norm),
                         rec_sq=jax.tree_util.tree_map(jnp.zeros_like, ctl.norm))

  def update_fn(updates, state, params=None, recovery_gap=None, **extra_args):
    # The inner controller never selects; it gets no lock, so its candidate count stays the
    # paper's alarm count (risky units) instead of counting this controller's locks.
    lock_held = state.controller.lock
    inner_state = state.controller._replace(
        lock=jax.tree_util.tree_map(jnp.zeros_like, lock_held))
    updates, ctl = inner.update(updates, inner_state, params, **extra_args)
    # The layout held in the state (the inner update checked the gradients against it).
    layout = units_lib.unbox(ctl.window).layout
    num_units = layout.num_units
    flat = layout.flat
    step = ctl.count
    norm = flat(ctl.norm)
    prev_mask = flat(state.controller.mask)
    lock = flat(lock_held)
    gap, gap_count = flat(state.gap), flat(state.gap_count)
    noise_sq, rec_sq = flat(state.noise_sq), flat(state.rec_sq)

    if recovery_gap is not None:
      _check_gap_layout(recovery_gap, layout)
      measured = flat(recovery_gap.gap).astype(jnp.float32)
      if priority == "relgap":  # 0 / 0 = 0; a gap over a zero recovery gradient is not finite
        rec_norm = flat(recovery_gap.rec_norm).astype(jnp.float32)
        measured = jnp.where(measured == 0, 0.0, measured / jnp.where(measured == 0, 1.0,
                                                                       rec_norm))
      valid = flat(recovery_gap.valid) & jnp.isfinite(measured)

      def blend(old, new, ok):  # the first measurement is taken as is
        mixed = jnp.where(gap_count > 0, gap_decay * old + (1 - gap_decay) * new, new)
        return jnp.where(ok, mixed, old)

      gap_sq = jnp.square(flat(recovery_gap.gap).astype(jnp.float32))
      rec_norm_sq = jnp.square(flat(recovery_gap.rec_norm).astype(jnp.float32))
      valid_sq = valid & jnp.isfinite(gap_sq) & jnp.isfinite(rec_norm_sq)
      noise_sq, rec_sq = blend(noise_sq, gap_sq, valid_sq), blend(rec_sq, rec_norm_sq, valid_sq)
      gap = blend(gap, measured, valid)
      gap_count = gap_count + valid.astype(jnp.int32)

    finite = jnp.isfinite(norm)
    tier = jnp.where(lock > 0, 1, 0)
    if priority in ("norm", "hybrid", "relgap"):
      value = jnp.where(finite, norm, 0.0)
      if priority == "relgap":  # scaled by the relative gap once u has been measured
        value = value * jnp.where(gap_count > 0, gap, 1.0)
    elif priority == "noise":
      value = noise_fraction(noise_sq, rec_sq)
    elif priority in GAP_PRIORITIES:
      value = gap
    elif priority in STATIC_PRIORITIES:
      value = static_set(layout).astype(jnp.float32)
    else:  # random: the first max_o units of a fresh permutation get the top values
      order = jax.random.permutation(jax.random.fold_in(jax.random.key(seed), step), num_units)
      value = jnp.zeros((num_units,), jnp.float32).at[order].set(
          jnp.arange(num_units, 0, -1, dtype=jnp.float32))
    if priority == "hybrid":  # transient risk outranks locks and is ranked by the paper's score
      risky = flat(ctl.risky)
      tier = jnp.where(risky, 2, tier)
      value = jnp.where(risky, flat(ctl.score), value)
    if priority in STATIC_PRIORITIES:  # a static set: no ranking, no lock
      selected = (value > 0) & (step > warmup)
      if priority == "late_switch":  # the mask made at step t is used at step t + 1
        selected = selected & (step + 1 >= switch_step)
      new_lock = jnp.zeros((num_units,), jnp.int32)
    else:
      candidate = jnp.ones((num_units,), jnp.bool_)  # every unit, but for 'noise'
      if priority == "noise":  # the paper's alarm first (by its score); a cap, not a quota
        risky = flat(ctl.risky)
        above = (value > noise_upper) | (prev_mask & (value >= noise_lower))
        if noise_gate == "any":
          above = jnp.broadcast_to(jnp.any(above), above.shape)
        candidate = risky | (lock > 0) | above
        tier = jnp.where(risky, 2, tier)
        rank_by = value if noise_rank == "pi" else jnp.where(finite, norm, 0.0)
        value = jnp.where(risky, flat(ctl.score), rank_by)
      if priority != "random":
        tier = jnp.where(finite, tier, 3)
      # lexsort: the last key is the primary one; it is stable, so ties keep tree order.
      order = jnp.lexsort((-value, -tier, ~candidate))
      rank = jnp.zeros_like(order).at[order].set(jnp.arange(num_units, dtype=order.dtype))
      selected = candidate & (rank < max_o) & (step > warmup)
      new_lock = jnp.where(selected & ~prev_mask, t_lock,
                           jnp.where(lock > 0, lock - 1, 0)).astype(jnp.int32)

    num_active = jnp.sum(selected, dtype=jnp.int32)
    tel = ctl.telemetry  # num_risky / num_candidates stay the paper's alarm counts
    telemetry = tel._replace(
        num_active=num_active,
        num_locked=jnp.sum(new_lock > 0, dtype=jnp.int32),
        active_unit_steps=state.controller.telemetry.active_unit_steps + num_active)
    def back(vec, dtype):
      return layout.values(vec.astype(dtype))

    ctl = ctl._replace(mask=back(selected, jnp.bool_), lock=back(new_lock, jnp.int32),
                       telemetry=telemetry)
    return updates, PriorityState(controller=ctl, gap=back(gap, jnp.float32),
                                  gap_count=back(gap_count, jnp.int32),
                                  value=back(value, jnp.float32),
                                  noise_sq=back(noise_sq, jnp.float32),
                                  rec_sq=back(rec_sq, jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def noise_fraction(noise_sq, rec_sq):
  """pi = noise_sq / rec_sq elementwise, with 0/0 = 0 and x/0 = +inf (float32)."""
  noise_sq, rec_sq = jnp.asarray(noise_sq, jnp.float32), jnp.asarray(rec_sq, jnp.float32)
  return jnp.where(noise_sq == 0, 0.0, jnp.where(
      rec_sq > 0, noise_sq / jnp.where(rec_sq > 0, rec_sq, 1.0), jnp.inf)).astype(jnp.float32)


def _check_gap_layout(recovery_gap, layout) -> None:
  """A RecoveryGap measured with another unit layout than the controller's is refused: it
  would be folded into the wrong units (or fail to reshape deep inside the update)."""
  got = {units_lib.path_to_str(path): tuple(jnp.shape(leaf))
         for path, leaf in jax.tree_util.tree_flatten_with_path(
             units_lib.unbox(recovery_gap.gap))[0]}
  want = {u.path: u.unit_shape for u in layout}
  if got == want:
    return
  diffs = [f"{name}: RecoveryGap {got.get(name, 'no such leaf')}, controller "
           f"{want.get(name, 'no such leaf')}"
           for name in sorted(set(got) | set(want)) if got.get(name) != want.get(name)]
  raise ValueError(
      "the recovery_gap= argument has another unit layout than this controller "
      "(per-unit leaf shapes: () is one unit, (L,) one unit per layer); measure it with the "
      "controller's `units` and `layer_axis` (recovery_gap.measure(..., units=..., "
      "layer_axis=...)). Differences: " + "; ".join(diffs[:8])
      + (f"; ... ({len(diffs)} in all)" if len(diffs) > 8 else ""))


def needs_recovery_gap(priority: str) -> bool:
  """Whether a priority ranks by a measured recovery gap (the train step must measure it)."""
  return priority in GAP_PRIORITIES

