"""Research instruments and baselines: controllers kept to measure the recommended ones against.

  gap      ranks by a measured recovery gap e_u (the instrument behind the selection study)
  relgap   the norm level times a measured relative gap e_u / ||g_rec,u||
  oracle   the last measured gap alone: measured every step, the lagged oracle
  hybrid   the paper's alarm first, the norm level fills the budget
  random   max_o units drawn uniformly at random: the same-budget baseline
  noise    the measured quantization-noise fraction against a threshold, plus the paper's alarm
  saturation  delayed scaling's saturation alone: the units whose codes reached the top

None of them is recommended for training (:mod:`gnmr_jax.control.recommended` lists those, with
the measurements): the gap-ranked ones cost one extra forward + backward per measurement and
closed less of the loss gap than the free :func:`gnmr_jax.norm_level`; ``random`` and ``oracle``
bound what a controller can do. Every one shares the budgeted rules of
:mod:`gnmr_jax.control.priorities` (``max_o`` units, non-finite units first, then locked ones,
then the ranking; ``t_lock`` steps of lock for a unit that enters) and keeps a
:class:`gnmr_jax.PriorityState`. The gap-ranked ones ('gap', 'relgap', 'oracle', 'noise') read
a :class:`gnmr_jax.control.RecoveryGap` passed to ``update`` as ``recovery_gap=`` (the train step
measures it every ``config.diagnostics.recovery_gap_every`` steps; :func:`gnmr_jax.control.measure`
for a model of your own); without one their estimate stays as it was.

Measurements quoted: RESULTS.md ("Selection", tensor4: 4-bit per-tensor saved activations on the
CPU scenario model, 5 seeds, max_o 4 of 28 units; "Noise fraction", wsd8: NVFP4 under a
warmup-stable-decay schedule, 3 seeds). "Closed": share of the static low-cost -> static recovery
loss gap; "coverage": share of the oracle top-max_o units' gap that the mask holds (replayed).
"""

from __future__ import annotations

import optax

import jax.numpy as jnp

from gnmr_jax.control import paper
from gnmr_jax.control import priorities
from gnmr_jax.control.priority_types import (PAPER_ALPHA, PAPER_BETA, PAPER_DELTA,
                                             PAPER_T_LOCK, Settings)


def gap(*, max_o: int, t_lock: int = PAPER_T_LOCK, gap_decay: float = 0.0,
        warmup: int = 0, units=None, layer_axis=None, alpha: float = PAPER_ALPHA,
        beta: float = PAPER_BETA, delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """Ranks units by their measured recovery gap e_u = ||g_low,u - g_rec,u|| (an estimate).

  Each unit keeps est <- gap_decay * est + (1 - gap_decay) * e_u (the first measurement as is),
  updated where the measurement is ``valid``: every unit with the 'uniform' and 'swapped'
  measuring passes, only the units outside the mask with the 'recovery' pass (so the units it
  selects keep their estimate while they stay selected: a static set chosen online).

  What it measured: it ranks well (coverage 0.97 replayed at K=10) but closes less than the free
  norm level in training: on tensor4, K=50, 0.36 of the gap ('recovery' pass) and 0.44
  ('uniform') against :func:`gnmr_jax.norm_level`'s 0.61, for one extra forward + backward every
  K steps.

  Args:
    max_o: units recovered per step (>= 0).
    t_lock: lock of a unit that enters the mask (>= 0).
    gap_decay: weight of the old estimate at each measurement, in [0, 1).
    warmup: first steps with an empty mask (>= 0).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`; the measurement
      must use the same ones.
    alpha, beta, delta: thresholds of the paper's statistics kept in the state (telemetry).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` takes ``recovery_gap=``.

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import recovery_gap, research
    >>> tx = research.gap(max_o=1, t_lock=0)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> low = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}     # gradients on the low-cost path
    >>> rec = {'a': jnp.ones((2, 2)), 'b': 2 * jnp.ones((2, 2))}  # ... and on the recovery path
    >>> measured = recovery_gap.unit_gaps(low, rec)               # e_a = 0, e_b = 2
    >>> _, state = tx.update(low, tx.init(params), params, recovery_gap=measured)
    >>> {k: bool(v) for k, v in gnmr_jax.recovery_mask(state).items()}
    {'a': False, 'b': True}
  """
  return priorities.budgeted(
      priorities.GAP, name="gap",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta,
                        gap_decay=gap_decay))


def relgap(*, max_o: int, t_lock: int = PAPER_T_LOCK, gap_decay: float = 0.0,
           warmup: int = 0, units=None, layer_axis=None, alpha: float = PAPER_ALPHA,
           beta: float = PAPER_BETA,
           delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """Ranks units by ||g_u(t)|| * r_u, r_u an estimate (as in :func:`gap`) of e_u / ||g_rec,u||.

  r_u is 1 before u's first measurement; 0 / 0 counts as 0 and a gap over a zero recovery
  gradient is not folded in. Meant to age better than a stale absolute gap.

  What it measured: replayed on tensor4 it ranked like the norm level (coverage 0.95, Spearman
  0.97) and in training it closed no more of the loss gap than :func:`gnmr_jax.norm_level`.

  Args:
    max_o, t_lock, gap_decay, warmup, units, layer_axis, alpha, beta, delta: as in :func:`gap`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` takes ``recovery_gap=``.

  Example:
    Unit a is larger but its paths agree (r_a = 0); b's relative gap is 0.5:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import recovery_gap, research
    >>> tx = research.relgap(max_o=1, t_lock=0)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> low = {'a': 3 * jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> rec = {'a': 3 * jnp.ones((2, 2)), 'b': 2 * jnp.ones((2, 2))}
    >>> measured = recovery_gap.unit_gaps(low, rec)
    >>> _, state = tx.update(low, tx.init(params), params, recovery_gap=measured)
    >>> {k: bool(v) for k, v in gnmr_jax.recovery_mask(state).items()}
    {'a': False, 'b': True}
  """
  return priorities.budgeted(
      priorities.RELGAP, name="relgap",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta,
                        gap_decay=gap_decay))


def oracle(*, max_o: int, t_lock: int = PAPER_T_LOCK, warmup: int = 0, units=None,
           layer_axis=None, alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
           delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """Ranks units by their last measured recovery gap alone (:func:`gap` without blending).

  Measured at every step it is the lagged oracle: the top max_o units by e_u(t), used at t + 1.
  A bound, not a controller to deploy: it costs one extra forward + backward per step. Replayed
  on tensor4 (K=1) its mask held 0.98 of the oracle top set's gap (the norm level: 0.84).

  Args:
    max_o, t_lock, warmup, units, layer_axis, alpha, beta, delta: as in :func:`gap`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` takes ``recovery_gap=``.

  Example:
    The mask follows the last measurement (e_a: 4, then 0; e_b: 2):

    >>> from gnmr_jax.control import recovery_gap, research
    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx, ones = research.oracle(max_o=1, t_lock=0), jnp.ones((2, 2))
    >>> params = {'a': ones, 'b': ones}
    >>> state = tx.init(params)
    >>> for rec_a in (3.0, 1.0):
    ...   measured = recovery_gap.unit_gaps(params, {'a': rec_a * ones, 'b': 2 * ones})
    ...   _, state = tx.update(params, state, params, recovery_gap=measured)
    ...   print([k for k, v in gnmr_jax.recovery_mask(state).items() if v])
    ['a']
    ['b']
  """
  return priorities.budgeted(
      priorities.ORACLE, name="oracle",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta))


def hybrid(*, max_o: int, t_lock: int = PAPER_T_LOCK, alpha: float = PAPER_ALPHA,
           beta: float = PAPER_BETA, delta: int = PAPER_DELTA, warmup: int = 0, units=None,
           layer_axis=None) -> optax.GradientTransformationExtraArgs:
  """The paper's alarm first, the norm level fills the rest of the budget.

  A unit over ``alpha`` / ``beta`` (or non-finite) takes the budget first, ranked by the paper's
  risk score; the other units follow by gradient norm, as in :func:`gnmr_jax.norm_level`.

  What it measured: at alpha 4 / beta 3 it catches every x5 spike of ``make train``'s replay
  where the norm level catches 30% (THRESHOLDS.md), but on tensor4 it closed 0.36 of the loss
  gap against the norm level's 0.61, at the same spend.

  Args:
    max_o: units recovered per step (>= 0).
    t_lock: lock of a unit that enters the mask (>= 0).
    alpha, beta, delta: the paper's thresholds and window; they decide the alarm here.
    warmup: first steps with an empty mask (>= 0).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` keeping a :class:`gnmr_jax.PriorityState`.

  Example:
    Unit a leads by norm; b's x10 jump at step 4 takes the budget:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import research
    >>> tx = research.hybrid(max_o=1, t_lock=0, alpha=4.0, beta=3.0)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> state = tx.init(params)
    >>> for scale in (1.0, 1.0, 1.0, 10.0):
    ...   grads = {'a': 4 * params['a'], 'b': scale * params['b']}
    ...   _, state = tx.update(grads, state, params)
    ...   print([k for k, v in gnmr_jax.recovery_mask(state).items() if v])
    ['a']
    ['a']
    ['a']
    ['b']
  """
  return priorities.budgeted(
      priorities.HYBRID, name="hybrid",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta))


def random(*, max_o: int, t_lock: int = PAPER_T_LOCK, seed: int = 0, warmup: int = 0,
           units=None, layer_axis=None, alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
           delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """``max_o`` units drawn uniformly at random: the same-budget baseline.

  After ``warmup``, the mask for step t + 1 is, after the locked units, the first entries of
  ``jax.random.permutation(fold_in(key(seed), t), N)`` over the N units in tree order (slices of
  layer-stacked leaves in layer order); non-finite units get no precedence. With ``t_lock=0`` it
  is a fresh draw every step (what the scenario experiments call same-budget random recovery).

  What it measured: on tensor4 it closed -0.04 of the loss gap at the norm level's spend (12.8%
  of unit-steps): a budget spent blindly buys nothing there.

  Args:
    seed: seed of the draws (>= 0).
    max_o, t_lock, warmup, units, layer_axis, alpha, beta, delta: as in :func:`gap`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` keeping a :class:`gnmr_jax.PriorityState`.

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import research
    >>> tx = research.random(max_o=2, t_lock=0, seed=1)
    >>> params = {name: jnp.ones((2, 2)) for name in 'abcd'}
    >>> state = tx.init(params)
    >>> for _ in range(3):
    ...   _, state = tx.update(params, state, params)
    ...   print(sum(bool(v) for v in gnmr_jax.recovery_mask(state).values()))
    2
    2
    2
  """
  return priorities.budgeted(
      priorities.RANDOM, name="random",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta, seed=seed))


def noise(*, max_o: int, t_lock: int = PAPER_T_LOCK, gap_decay: float = 0.0,
          noise_upper: float = 1 / 3, noise_lower: float = 1 / 6, noise_rank: str = "pi",
          noise_gate: str = "unit", alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
          delta: int = PAPER_DELTA, warmup: int = 0, units=None,
          layer_axis=None) -> optax.GradientTransformationExtraArgs:
  """Recovers the units whose quantization-noise fraction is high, and the paper's alarm.

  pi_u = EMA(e_u^2) / EMA(||g_rec,u||^2) over the measurements (``gap_decay`` weighs the old
  EMA). A unit is a candidate when pi_u > ``noise_upper`` (1/3: FP4 All the Way's sqrt(3) rule
  per tensor), stays one while in the mask and pi_u >= ``noise_lower`` (hysteresis) or locked,
  and the paper's alarm (over ``alpha`` / ``beta``, or non-finite) makes a unit a candidate
  whatever its pi_u. Candidates only, at most ``max_o``: the budget is a cap and the mask may
  be empty. Alarmed units rank first (by the paper's score), the others by pi_u, or with
  ``noise_rank='norm'`` by the gradient norm. With ``noise_gate='any'`` every unit is a
  candidate while any unit's pi_u is over the threshold (pi decides whether to spend, the rank
  where). Needs every unit re-measured (``recovery_gap_pass='uniform'``).

  What it measured: on wsd8 (3 seeds) it closed 1.48 of the static gap at 1.2% of unit-steps,
  but not more than the static recipes beyond the seeds' noise floor (issue 23's goal not met);
  on tensor4 it closed 0.00 ('norm' rank: 0.13; 'any' gate: 0.36).

  Args:
    max_o: most units recovered per step (>= 0).
    t_lock: lock of a unit that enters the mask (>= 0).
    gap_decay: weight of the old EMAs at each measurement, in [0, 1).
    noise_upper, noise_lower: the hysteresis thresholds (0 <= noise_lower <= noise_upper,
      finite, noise_upper > 0).
    noise_rank: 'pi' or 'norm': how candidates beyond the alarm are ranked.
    noise_gate: 'unit' (a unit's own pi_u) or 'any' (any unit's pi_u opens every unit).
    alpha, beta, delta: the paper's thresholds and window; they decide the alarm here.
    warmup: first steps with an empty mask (>= 0).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` takes ``recovery_gap=``.

  Example:
    Unit b's paths differ by its whole gradient (pi_b = 1 > 1/3); a's agree. The budget of 2
    is a cap: only b is recovered.

    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import recovery_gap, research
    >>> tx = research.noise(max_o=2, t_lock=0)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> low = {'a': jnp.ones((2, 2)), 'b': 2 * jnp.ones((2, 2))}
    >>> rec = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> measured = recovery_gap.unit_gaps(low, rec)
    >>> _, state = tx.update(low, tx.init(params), params, recovery_gap=measured)
    >>> {k: bool(v) for k, v in gnmr_jax.recovery_mask(state).items()}
    {'a': False, 'b': True}
  """
  return priorities.budgeted(
      priorities.NOISE, name="noise",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta,
                        gap_decay=gap_decay), options={"noise_upper": noise_upper, "noise_lower":
                        noise_lower, "noise_rank": noise_rank, "noise_gate": noise_gate})


# config.gnmr.t_lock's default for priority 'saturation': the scale catches up in a step or two.
SATURATION_T_LOCK = 1


def _never(count):
  """A threshold no ratio exceeds (``saturation``: the norms never alarm)."""
  del count
  return jnp.inf


def saturation(*, max_o: int, t_lock: int = SATURATION_T_LOCK, warmup: int = 0, units=None,
               layer_axis=None, delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """Delayed scaling's saturation as the only alarm: the units whose codes saturated this step
  (``update(..., overflow=tree)``: ``gnmr_jax.model.amax_saturation_units`` > 1, which the train
  step passes with delayed scaling) run the recovery path for the next ``t_lock + 1`` steps; the
  gradient norms never alarm (a non-finite one still does, as in every controller). It reads the
  cause the paper's rule reads through the gradient norm, so it bounds what a norm-watching
  controller can do in the delayed-scaling regime (experiments/delayed_regime.py). Over ``max_o``
  saturated units, tree order decides. Without ``overflow`` (no delayed scaling) it recovers
  nothing.

  This is :func:`gnmr_jax.gnmr` with thresholds that never fire (its edge rule makes an
  overflowed unit risky with score 1), so it keeps a :class:`gnmr_jax.GNMRState` and its
  statistics.

  Args:
    max_o: units recovered per step (>= 0).
    t_lock: the lock of a unit that saturated (>= 0): it runs the recovery path for the
      t_lock + 1 steps after; the scale catches up within a step or two (delayed_scaling.py),
      so a short lock covers it (``config.gnmr.t_lock`` None: 1).
    warmup, units, layer_axis, delta: as in :func:`gnmr_jax.gnmr` (``delta`` sizes the
      statistics' window, which no decision reads here).

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import research
    >>> tx = research.saturation(max_o=1, t_lock=1)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> state = tx.init(params)
    >>> for a_scale, b_saturated in ((1, False), (1, True), (100, False), (1, False)):
    ...   grads = {'a': a_scale * params['a'], 'b': params['b']}  # a's x100 jump: no alarm
    ...   _, state = tx.update(grads, state, params, overflow={'a': False, 'b': b_saturated})
    ...   print([k for k, v in gnmr_jax.recovery_mask(state).items() if v])
    []
    ['b']
    ['b']
    []
  """
  return paper.gnmr(alpha=_never, beta=_never, delta=delta, max_o=max_o, t_lock=t_lock,
                    warmup=warmup, units=units, layer_axis=layer_axis)
