"""The engine of the budgeted controllers: units ranked by other signals than the paper's score.

:func:`gnmr_jax.gnmr` is the paper's rule and stays exactly that. :func:`budgeted` keeps its
budget (``max_o`` units per step), its warmup and a lock, but ranks the units by one of these
priorities (each a :class:`~gnmr_jax.control.priority_types.Ranked` entry of the table,
:mod:`gnmr_jax.control.priority_table`, with its ranking defined here; its constructor
checks its own arguments: :mod:`gnmr_jax.control.recommended` for 'norm',
:mod:`gnmr_jax.control.research` for the others; the static recipes 'fixed', 'last_blocks'
and 'late_switch' are their own transform, :mod:`gnmr_jax.control.static_recipes`):

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

Rules shared by every ranking, for the mask of step t + 1:

  tier     = 3 if n_t is not finite (not for 'random', which stays uniform); else the
             ranking's tier ('hybrid', 'noise': 2 if risky by the paper's rule, then
             ranked by the paper's score r), at least 1 if lock > 0; else 0
  mask     = the max_o candidates first by tier, then by value (ties: tree order); a
             locked unit is always a candidate
  lock     = t_lock for a unit that enters the mask (not in the mask of step t),
             lock - 1 for a locked unit, else 0

so a unit that enters the mask stays in it for at least t_lock + 1 steps (unless
non-finite units, or for 'hybrid' risky ones, take its place), the active set does not
thrash between units of nearly equal priority, and a non-finite gradient is recovered at once.
Every unit is a candidate but for 'noise' (the others are persistent signals, not alarms), so
the mask holds min(max_o, N) units every step after warmup.

The state is a :class:`PriorityState` holding a :class:`gnmr_jax.GNMRState` (the
paper's statistics, computed as by ``gnmr(max_o=0)`` for telemetry and for the
hybrid's transient risk) whose ``mask``, ``lock`` and budget counts are this
controller's, so :func:`gnmr_jax.recovery_mask` and the train loop read it unchanged.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from gnmr_jax.control import checks as _checks
from gnmr_jax.control import paper as gnmr_lib
from gnmr_jax.control import units as units_lib
from gnmr_jax.control.priority_types import Field, Ranked, Ranking, Settings, Signals

NOISE_RANKS = ("pi", "norm")  # 'noise': how candidates beyond the alarm are ranked
NOISE_GATES = ("unit", "any")  # 'noise': a unit's own pi, or any unit's, makes candidates


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


# --- the built-in rankings -------------------------------------------------------------------


def _finite_norm(s: Signals):
  return jnp.where(s.finite, s.norm, 0.0)


def _lock_tier(s: Signals):
  return jnp.where(s.lock > 0, 1, 0)


def _rank_norm(s: Signals, options) -> Ranking:
  del options
  return Ranking(_finite_norm(s))


def _rank_relgap(s: Signals, options) -> Ranking:
  del options  # the norm level scaled by the relative gap once u has been measured
  return Ranking(_finite_norm(s) * jnp.where(s.gap_count > 0, s.gap, 1.0))


def _rank_gap(s: Signals, options) -> Ranking:
  del options
  return Ranking(s.gap)


def _rank_hybrid(s: Signals, options) -> Ranking:
  del options  # transient risk outranks locks and is ranked by the paper's score
  return Ranking(jnp.where(s.risky, s.score, _finite_norm(s)),
                 tier=jnp.where(s.risky, 2, _lock_tier(s)))


def _rank_random(s: Signals, options) -> Ranking:
  """The first max_o units of a fresh permutation get the top values."""
  num_units = s.norm.shape[0]
  del options
  order = jax.random.permutation(s.key, num_units)
  return Ranking(jnp.zeros((num_units,), jnp.float32).at[order].set(
      jnp.arange(num_units, 0, -1, dtype=jnp.float32)))


def _rank_noise(s: Signals, options) -> Ranking:
  """The paper's alarm first (by its score); pi over the thresholds; a cap, not a quota."""
  pi = noise_fraction(s.noise_sq, s.rec_sq)
  above = (pi > options["noise_upper"]) | (s.prev_mask & (pi >= options["noise_lower"]))
  if options["noise_gate"] == "any":
    above = jnp.broadcast_to(jnp.any(above), above.shape)
  rank_by = pi if options["noise_rank"] == "pi" else _finite_norm(s)
  return Ranking(jnp.where(s.risky, s.score, rank_by), tier=jnp.where(s.risky, 2, _lock_tier(s)),
                 candidate=s.risky | (s.lock > 0) | above)


def _check_choice(choices):
  def check(where, value, options):
    del options
    if value not in choices:
      raise ValueError(f"{where} must be one of {list(choices)}, got {value!r}.")
  return check


def _check_noise_upper(where, value, options):
  del options
  _checks.check_positive(where, value)


def _check_noise_lower(where, value, options):
  upper = options.get("noise_upper")
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not 0 <= value <= upper):
    raise ValueError(f"{where} must be a float in [0, noise_upper={upper!r}], got {value!r}.")


def _needs_every_unit_measured(config) -> None:
  if ("diagnostics" in config and
      config.diagnostics.get("recovery_gap_pass", "recovery") == "recovery"):
    raise ValueError("config.gnmr.priority='noise' needs every unit re-measured: set "
                     "config.diagnostics.recovery_gap_pass='uniform' (the 'recovery' pass never "
                     "re-measures the units in the mask, so none could leave it).")


NORM = Ranked("norm", "the max_o units with the largest gradient norm", rank=_rank_norm)
GAP = Ranked("gap", "the units with the largest measured recovery gap (an EMA)", rank=_rank_gap,
             reads_gap=True)
RELGAP = Ranked("relgap", "the gradient norm times a measured relative gap", rank=_rank_relgap,
                reads_gap=True, relative_gap=True)
ORACLE = Ranked("oracle", "the last measured recovery gap alone (the lagged oracle)",
                rank=_rank_gap, reads_gap=True, last_gap_only=True)
HYBRID = Ranked("hybrid", "the paper's alarm first, the gradient norm fills the budget",
                rank=_rank_hybrid)
RANDOM = Ranked("random", "max_o units drawn uniformly at random (the same-budget baseline)",
                rank=_rank_random, nonfinite_first=False)
NOISE = Ranked(
    "noise", "a measured quantization-noise fraction over a threshold, and the paper's alarm",
    rank=_rank_noise, reads_gap=True, check_config=_needs_every_unit_measured, fields=(
        Field("noise_upper", 1 / 3, _check_noise_upper, "pi above it makes a candidate"),
        Field("noise_lower", 1 / 6, _check_noise_lower, "pi a unit in the mask keeps above"),
        Field("noise_rank", "pi", _check_choice(NOISE_RANKS), "rank by 'pi' or by 'norm'"),
        Field("noise_gate", "unit", _check_choice(NOISE_GATES),
              "'unit': its own pi; 'any': any unit's pi opens every unit")))
RANKED = (NORM, GAP, RELGAP, ORACLE, HYBRID, RANDOM, NOISE)


# --- the engine ------------------------------------------------------------------------------


def check_settings(name: str, settings: Settings) -> None:
  """The shared integer settings, before any tracing."""
  for arg in ("max_o", "t_lock", "seed"):
    _checks.check_int(f"{name}: `{arg}`", getattr(settings, arg), 0, _checks.STATIC_HINT)
  _checks.check_fraction(f"{name}: `gap_decay`", settings.gap_decay)


def paper_statistics(settings: Settings) -> optax.GradientTransformationExtraArgs:
  """The paper's statistics without its selection (max_o=0 never selects or locks)."""
  return gnmr_lib.gnmr(alpha=settings.alpha, beta=settings.beta, delta=settings.delta,
                       max_o=0, t_lock=0, warmup=settings.warmup, units=settings.units,
                       layer_axis=settings.layer_axis)


def init_state(inner, params) -> PriorityState:
  ctl = inner.init(params)
  def zeros(tree):
    return jax.tree_util.tree_map(jnp.zeros_like, tree)

  return PriorityState(controller=ctl, gap=zeros(ctl.norm), gap_count=zeros(ctl.norm_count),
                       value=zeros(ctl.norm), noise_sq=zeros(ctl.norm), rec_sq=zeros(ctl.norm))


def update_statistics(inner, updates, state: PriorityState, params, extra_args):
  """The paper's statistics of this step, and the layout they are held in.

  The inner controller never selects; it gets no lock, so its candidate count stays the
  paper's alarm count (risky units) instead of counting this controller's locks.
  """
  inner_state = state.controller._replace(
      lock=jax.tree_util.tree_map(jnp.zeros_like, state.controller.lock))
  updates, ctl = inner.update(updates, inner_state, params, **extra_args)
  return updates, ctl, units_lib.unbox(ctl.window).layout


def finish(state: PriorityState, ctl, layout, selected, new_lock, value, gaps) -> PriorityState:
  """The state after a step: ``selected`` and ``new_lock`` [N] become the mask and the lock,
  the budget counts are this controller's; ``gaps`` = (gap, gap_count, noise_sq, rec_sq)."""
  num_active = jnp.sum(selected, dtype=jnp.int32)
  tel = ctl.telemetry  # num_risky / num_candidates stay the paper's alarm counts
  telemetry = tel._replace(
      num_active=num_active, num_locked=jnp.sum(new_lock > 0, dtype=jnp.int32),
      active_unit_steps=state.controller.telemetry.active_unit_steps + num_active)

  def back(vec, dtype):
    return layout.values(vec.astype(dtype))

  ctl = ctl._replace(mask=back(selected, jnp.bool_), lock=back(new_lock, jnp.int32),
                     telemetry=telemetry)
  gap, gap_count, noise_sq, rec_sq = gaps
  return PriorityState(controller=ctl, gap=back(gap, jnp.float32),
                       gap_count=back(gap_count, jnp.int32), value=back(value, jnp.float32),
                       noise_sq=back(noise_sq, jnp.float32), rec_sq=back(rec_sq, jnp.float32))


def fold_gap(relative: bool, gap_decay: float, layout, state: PriorityState, recovery_gap):
  """(gap, gap_count, noise_sq, rec_sq) [N] after folding in ``recovery_gap`` (None: as were);
  ``relative``: the gap estimate is of e_u / ||g_rec,u||."""
  flat = layout.flat
  gap, gap_count = flat(state.gap), flat(state.gap_count)
  noise_sq, rec_sq = flat(state.noise_sq), flat(state.rec_sq)
  if recovery_gap is None:
    return gap, gap_count, noise_sq, rec_sq
  _check_gap_layout(recovery_gap, layout)
  measured = flat(recovery_gap.gap).astype(jnp.float32)
  if relative:  # 0 / 0 = 0; a gap over a zero recovery gradient is not finite
    rec_norm = flat(recovery_gap.rec_norm).astype(jnp.float32)
    measured = jnp.where(measured == 0, 0.0, measured / jnp.where(measured == 0, 1.0, rec_norm))
  valid = flat(recovery_gap.valid) & jnp.isfinite(measured)

  def blend(old, new, ok):  # the first measurement is taken as is
    mixed = jnp.where(gap_count > 0, gap_decay * old + (1 - gap_decay) * new, new)
    return jnp.where(ok, mixed, old)

  gap_sq = jnp.square(flat(recovery_gap.gap).astype(jnp.float32))
  rec_norm_sq = jnp.square(flat(recovery_gap.rec_norm).astype(jnp.float32))
  valid_sq = valid & jnp.isfinite(gap_sq) & jnp.isfinite(rec_norm_sq)
  noise_sq, rec_sq = blend(noise_sq, gap_sq, valid_sq), blend(rec_sq, rec_norm_sq, valid_sq)
  gap = blend(gap, measured, valid)
  return gap, gap_count + valid.astype(jnp.int32), noise_sq, rec_sq


def _select(priority: Ranked, ranking: Ranking, s: Signals, settings: Settings):
  """(selected, new lock) [N]: the first max_o candidates by (tier, value), after warmup."""
  num_units = s.norm.shape[0]
  # A locked unit stays a candidate and above the unlocked ones, whatever the ranking says.
  tier = (_lock_tier(s) if ranking.tier is None
          else jnp.maximum(ranking.tier, _lock_tier(s)))
  candidate = (jnp.ones((num_units,), jnp.bool_) if ranking.candidate is None
               else ranking.candidate | (s.lock > 0))
  if priority.nonfinite_first:
    tier = jnp.where(s.finite, tier, 3)
  # lexsort: the last key is the primary one; it is stable, so ties keep tree order.
  order = jnp.lexsort((-ranking.value, -tier, ~candidate))
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(num_units, dtype=order.dtype))
  selected = candidate & (rank < settings.max_o) & (s.step > settings.warmup)
  new_lock = jnp.where(selected & ~s.prev_mask, settings.t_lock,
                       jnp.where(s.lock > 0, s.lock - 1, 0)).astype(jnp.int32)
  return selected, new_lock


def budgeted(priority: Ranked, *, name: str, settings: Settings,
             options: Optional[Mapping[str, Any]] = None) -> optax.GradientTransformationExtraArgs:
  """The budgeted controller ranking units by ``priority`` (module docstring).

  The engine behind the constructors (:func:`gnmr_jax.norm_level`, ...,
  :mod:`gnmr_jax.control.research`) and the priorities a user registers
  (:func:`gnmr_jax.control.register_priority`).

  Args:
    priority: a :class:`~gnmr_jax.control.priority_types.Ranked` entry.
    name: the constructor's name, for error messages.
    settings: max_o (>= 0; capped at the number of units), t_lock (>= 0), warmup, units,
      layer_axis, the paper's alpha / beta / delta (the statistics kept in the state, and the
      alarm a ranking may read), gap_decay (weight of the old gap estimate at a measurement),
      seed (the step's ``Signals.key`` is ``fold_in(key(seed), step)``).
    options: the priority's own fields (:meth:`Priority.options` checks them; default theirs).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` passing updates through; its ``update``
    takes an optional ``recovery_gap=`` (a RecoveryGap) extra argument.

  Raises:
    ValueError: an invalid setting or option, before any tracing.

  Example:
    The built-in 'norm' entry, as :func:`gnmr_jax.norm_level` builds it:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import priorities
    >>> from gnmr_jax.control.priority_types import Settings
    >>> settings = Settings(max_o=1, t_lock=0, warmup=0, units=None, layer_axis=None,
    ...                     alpha=2.0, beta=1.5, delta=8)
    >>> tx = priorities.budgeted(priorities.NORM, name="norm", settings=settings)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> _, state = tx.update({'a': params['a'], 'b': 2 * params['b']}, tx.init(params), params)
    >>> [k for k, v in gnmr_jax.recovery_mask(state).items() if v]
    ['b']
  """
  if not isinstance(priority, Ranked):
    raise ValueError(f"{name}: the budgeted engine takes a Ranked priority, got {priority!r}.")
  check_settings(name, settings)
  options = priority.options(dict(options or {}), f"{name}: ")
  # Only a priority that ranks by the gap blends its measurements; the others keep the last.
  gap_decay = settings.gap_decay if priority.reads_gap and not priority.last_gap_only else 0.0
  inner = paper_statistics(settings)

  def update_fn(updates, state, params=None, recovery_gap=None, **extra_args):
    updates, ctl, layout = update_statistics(inner, updates, state, params, extra_args)
    gaps = fold_gap(priority.relative_gap, gap_decay, layout, state, recovery_gap)
    norm = layout.flat(ctl.norm)
    signals = Signals(step=ctl.count, norm=norm, finite=jnp.isfinite(norm),
                      gnmr=layout.flat(ctl.gnmr), delta_gnmr=layout.flat(ctl.delta_gnmr),
                      risky=layout.flat(ctl.risky), score=layout.flat(ctl.score),
                      lock=layout.flat(state.controller.lock),
                      prev_mask=layout.flat(state.controller.mask), gap=gaps[0],
                      gap_count=gaps[1], noise_sq=gaps[2], rec_sq=gaps[3],
                      key=jax.random.fold_in(jax.random.key(settings.seed), ctl.count))
    ranking = priority.rank(signals, options)
    selected, new_lock = _select(priority, ranking, signals, settings)
    return updates, finish(state, ctl, layout, selected, new_lock, ranking.value, gaps)

  return optax.GradientTransformationExtraArgs(lambda params: init_state(inner, params),
                                               update_fn)


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
