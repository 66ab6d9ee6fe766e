"""The controllers the measurements recommend, one constructor each (beside the paper's rule).

  transient_alarm  the config default: the paper's rule at alpha 4 / beta 3 / t_lock 2, an alarm
                   that recovers a unit when its gradient jumps (or is not finite), else nothing
  norm_level       the max_o units with the largest gradient norm, every step after warmup
  fixed_set        a static set of units named by a regex (chosen in hindsight or by a recipe)
  last_blocks      a static set: every unit of the last layers (NVIDIA's NVFP4 recipe)
  late_switch      every unit from one step on ("FP4 All the Way"'s late switch)

Each returns an ``optax.GradientTransformationExtraArgs`` that passes updates through and keeps
its mask in a :class:`gnmr_jax.GNMRState` (``transient_alarm``: its own state, as
:func:`gnmr_jax.gnmr`; the others inside a :class:`gnmr_jax.PriorityState`), so
:func:`gnmr_jax.recovery_mask` reads any of them. Chain it first, so it sees the raw gradients.
The budgeted ones keep the paper's statistics (``alpha``, ``beta``, ``delta``) in the state for
telemetry only (``num_risky``, the per-unit scores); they do not select with them.

Measurements quoted below: RESULTS.md ("Selection", tensor4: 4-bit per-tensor saved activations
on the CPU scenario model, 5 seeds, max_o 4 of 28 units; "Noise fraction", wsd8: an NVFP4 low-cost
path under a warmup-stable-decay schedule, 3 seeds) and THRESHOLDS.md (spike replays of
``make train``). "Closed" is the share of the static low-cost -> static recovery loss gap.
Research instruments and baselines (measured gap, oracle, random, noise fraction, ...) are in
:mod:`gnmr_jax.control.research`.
"""

from __future__ import annotations

import optax

from gnmr_jax.control import checks as _checks
from gnmr_jax.control import paper
from gnmr_jax.control import priorities
from gnmr_jax.control import static_recipes
from gnmr_jax.control import units as units_lib
from gnmr_jax.control.priority_types import (PAPER_ALPHA, PAPER_BETA, PAPER_DELTA,
                                             PAPER_T_LOCK, Settings)

# The transient alarm (config.gnmr's default): THRESHOLDS.md's cheapest setting of `make train`'s
# replay that recovers every x5 / x10 / x100 spike within 2 steps.
ALARM_ALPHA, ALARM_BETA, ALARM_T_LOCK = 4.0, 3.0, 2


def transient_alarm(*, max_o: int, alpha: paper.ScalarOrSchedule = ALARM_ALPHA,
                    beta: paper.ScalarOrSchedule = ALARM_BETA, delta: int = PAPER_DELTA,
                    t_lock: int = ALARM_T_LOCK, warmup: int = 0, units=None,
                    layer_axis=None) -> optax.GradientTransformationExtraArgs:
  """The default controller: the paper's rule (:func:`gnmr_jax.gnmr`) as a transient alarm.

  ``gnmr(alpha=4, beta=3, delta=8, t_lock=2, ...)``: a unit whose gradient norm jumps over
  4x its running mean (or 3x its recent GNMR), or is not finite, runs the recovery path for
  ``t_lock + 1`` steps; ``max_o`` is a cap, and the mask is empty while nothing jumps.

  When the measurements recommend it: where the low-cost path does not hurt persistently (int8
  or fp8 with a bf16 recovery path, ``make train``) and the budget should go to spikes only. On
  ``make train``'s replay it recovers 0.75% of the unit-steps and catches 99.5% of x5 and every
  x10 / x100 single-step spike at the next step (THRESHOLDS.md); ``norm_level`` spent 13% there for
  no measured gain. Where the low-cost error is persistent it recovers almost nothing and closes
  none of the gap (tensor4: -0.19 closed at 1.1% of unit-steps): use :func:`norm_level` or a
  static set there.

  Args:
    max_o: most units recovered per step (>= 0).
    alpha, beta, delta, t_lock: the paper's thresholds, window and lock (see :func:`gnmr_jax.gnmr`).
    warmup: first steps with an empty mask (>= 0).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.

  Returns:
    :func:`gnmr_jax.gnmr` with these arguments (its state is a :class:`gnmr_jax.GNMRState`).

  Example:
    Steady gradients recover nothing; a x10 jump of one unit puts it in the mask:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.transient_alarm(max_o=2)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> state = tx.init(params)
    >>> for scale in (1.0, 1.0, 1.0, 10.0):
    ...   _, state = tx.update({'a': scale * params['a'], 'b': params['b']}, state, params)
    ...   print({k: bool(v) for k, v in gnmr_jax.recovery_mask(state).items()})
    {'a': False, 'b': False}
    {'a': False, 'b': False}
    {'a': False, 'b': False}
    {'a': True, 'b': False}
  """
  return paper.gnmr(alpha=alpha, beta=beta, delta=delta, max_o=max_o, t_lock=t_lock,
                    warmup=warmup, units=units, layer_axis=layer_axis)


def norm_level(*, max_o: int, t_lock: int = PAPER_T_LOCK, warmup: int = 0,
               units=None, layer_axis=None, alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
               delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """The ``max_o`` units with the largest gradient norm ||g_u(t)|| run the recovery path at t + 1.

  Non-finite units come first, then locked ones, then the others by norm (ties: tree order); a
  unit that enters the mask is locked for ``t_lock`` steps, so the set does not thrash. After
  ``warmup`` the mask holds min(max_o, N) units every step. Free: the controller computes the
  norms anyway.

  When the measurements recommend it: where the low-cost error is persistent and you have not
  measured where it is. On tensor4 it closed 0.61 of the loss gap (pooled over 5 seeds) at 12.8%
  of unit-steps, the most of every online controller and as much as the best hindsight static set
  (0.60), against 0.07 for the paper's rule and -0.04 for a random set of the same size. It spends
  its budget every step, needed or not: where int8 / bf16 does not hurt, use
  :func:`transient_alarm`.

  Args:
    max_o: units recovered per step (>= 0; capped at the number of units).
    t_lock: steps a unit that enters the mask stays locked in (>= 0); 5, the paper's, is what
      it was measured with.
    warmup: first steps with an empty mask (>= 0).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.
    alpha, beta, delta: thresholds of the paper's statistics kept in the state (telemetry).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` keeping a :class:`gnmr_jax.PriorityState`.

  Example:
    The two units with the largest gradients are recovered at the next step:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.norm_level(max_o=2, t_lock=0)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2)), 'c': jnp.ones((2, 2))}
    >>> grads = {'a': 3 * jnp.ones((2, 2)), 'b': jnp.ones((2, 2)), 'c': 2 * jnp.ones((2, 2))}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> {k: bool(v) for k, v in gnmr_jax.recovery_mask(state).items()}
    {'a': True, 'b': False, 'c': True}
  """
  return priorities.budgeted(
      priorities.NORM, name="norm_level",
      settings=Settings(max_o=max_o, t_lock=t_lock, warmup=warmup, units=units,
                        layer_axis=layer_axis, alpha=alpha, beta=beta, delta=delta))


def fixed_set(pattern: str, *, max_o: int, warmup: int = 0, units=None, layer_axis=None,
              alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
              delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """The units whose name matches ``pattern`` run the recovery path at every step after warmup.

  No signal, no lock: a static set with the same state and telemetry as the other controllers.
  Unit names are :meth:`gnmr_jax.control.UnitLayout.names`: the leaf path, ``'path[l]'`` for
  layer l of a layer-stacked leaf (e.g. ``layers/mlp/down/kernel[3]``).

  When the measurements recommend it: when you know which units the low-cost path hurts, from a
  recovery-gap measurement (:func:`gnmr_jax.control.measure`) or a recipe. On tensor4 the set
  chosen in hindsight (mlp/down of every layer) closed 0.60 of the loss gap at 12.8% of
  unit-steps, as much as :func:`norm_level`, at no ranking cost and with a mask known in advance.

  Args:
    pattern: a regex searched in the unit names; the 1 to ``max_o`` matching units are the set.
    max_o: the recovery budget (and side buffer) the set must fit in (>= 0).
    warmup, units, layer_axis, alpha, beta, delta: as in :func:`norm_level`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` keeping a :class:`gnmr_jax.PriorityState`.

  Raises:
    ValueError: an invalid argument, before any tracing; at init, a set that is empty or larger
      than ``max_o``.

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.fixed_set(r'down', max_o=2, layer_axis=r'^layers/')
    >>> params = {'layers': {'down': jnp.ones((2, 3, 3)), 'up': jnp.ones((2, 3, 3))}}
    >>> _, state = tx.update(params, tx.init(params), params)
    >>> mask = gnmr_jax.recovery_mask(state)['layers']
    >>> mask['down'].tolist(), mask['up'].tolist()
    ([True, True], [False, False])
  """
  if not isinstance(pattern, str) or not pattern:
    raise ValueError(f"fixed_set: `pattern` must be a regex searched in the unit names (e.g. "
                     f"r'mlp/down'), got {pattern!r}.")
  units_lib.compile_selector(pattern, "pattern")
  return static_recipes.static_recipe(
      static_recipes.FIXED, name="fixed_set",
      settings=Settings(max_o=max_o, t_lock=0, warmup=warmup, units=units, layer_axis=layer_axis,
                        alpha=alpha, beta=beta, delta=delta), options={"fixed_units": pattern})


def last_blocks(num_blocks: int, *, max_o: int, warmup: int = 0, units=None, layer_axis=None,
                alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
                delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """Every unit of the last ``num_blocks`` layers runs the recovery path for the whole run.

  NVIDIA's NVFP4 training recipe as a static set: the units of the last ``num_blocks`` layers
  of every layer-stacked leaf (see ``layer_axis``), after warmup; no signal, no lock.

  When the measurements recommend it: when a recipe you trust says so (NVFP4 pre-training); the
  measurements here give it no edge over :func:`norm_level`. On wsd8 (NVFP4, 3 seeds) it closed
  1.38 of the static gap at 11.8% of unit-steps against 1.11 for ``norm_level`` (paired difference
  within the seeds' noise floor); on tensor4 it closed nothing (-0.01, 22.4% of unit-steps).

  Args:
    num_blocks: how many of the last layers (>= 1); only layer-stacked leaves have layers.
    max_o, warmup, units, layer_axis, alpha, beta, delta: as in :func:`fixed_set`.

  Returns and Raises: as :func:`fixed_set`.

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.last_blocks(1, max_o=2, layer_axis=r'^layers/')
    >>> params = {'layers': {'down': jnp.ones((3, 2, 2)), 'up': jnp.ones((3, 2, 2))}}
    >>> _, state = tx.update(params, tx.init(params), params)
    >>> gnmr_jax.recovery_mask(state)['layers']['down'].tolist()
    [False, False, True]
  """
  _checks.check_int("last_blocks: `num_blocks`", num_blocks, 1)
  return static_recipes.static_recipe(
      static_recipes.LAST_BLOCKS, name="last_blocks",
      settings=Settings(max_o=max_o, t_lock=0, warmup=warmup, units=units, layer_axis=layer_axis,
                        alpha=alpha, beta=beta, delta=delta), options={"last_blocks": num_blocks})


def late_switch(switch_step: int, *, max_o: int, warmup: int = 0, units=None, layer_axis=None,
                alpha: float = PAPER_ALPHA, beta: float = PAPER_BETA,
                delta: int = PAPER_DELTA) -> optax.GradientTransformationExtraArgs:
  """Every unit runs the recovery path from step ``switch_step`` on ("FP4 All the Way").

  A global late switch: the low-cost path until ``switch_step - 1``, then every unit recovered
  (``max_o`` must cover every unit: it sizes the recovery budget and side buffer).

  When the measurements recommend it: under a schedule whose last phase is the sensitive one
  (a warmup-stable-decay run switched at its decay). On wsd8 (3 seeds) it closed 1.27 of the
  static gap at 12.5% of unit-steps, no better than :func:`norm_level` (1.11; paired difference
  within the seeds' noise floor); on tensor4 it closed nothing (0.00, 13% of unit-steps).

  Args:
    switch_step: the first step run with every unit recovered (>= 1).
    max_o: the recovery budget; at least the number of units.
    warmup, units, layer_axis, alpha, beta, delta: as in :func:`norm_level`.

  Returns and Raises: as :func:`fixed_set` (at init, ``max_o`` below the number of units).

  Example:
    The mask made at step 2 is used at step 3, the switch:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> tx = gnmr_jax.late_switch(3, max_o=2)
    >>> params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((2, 2))}
    >>> state = tx.init(params)
    >>> for step in (1, 2, 3):
    ...   _, state = tx.update(params, state, params)
    ...   print(step + 1, sorted(k for k, v in gnmr_jax.recovery_mask(state).items() if v))
    2 []
    3 ['a', 'b']
    4 ['a', 'b']
  """
  _checks.check_int("late_switch: `switch_step`", switch_step, 1)
  return static_recipes.static_recipe(
      static_recipes.LATE_SWITCH, name="late_switch",
      settings=Settings(max_o=max_o, t_lock=0, warmup=warmup, units=units, layer_axis=layer_axis,
                        alpha=alpha, beta=beta, delta=delta), options={"switch_step": switch_step})
