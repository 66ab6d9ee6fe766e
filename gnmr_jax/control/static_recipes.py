"""Static recipes: a set of units fixed in advance on the recovery path, no ranking, no lock.

  'fixed'        the units whose name matches a regex (``fixed_units``; at most max_o of them)
                 at every step after warmup: a set chosen in hindsight, or a practitioner's
                 recipe
  'last_blocks'  NVIDIA's NVFP4 recipe: every unit of the last ``last_blocks`` layers (of each
                 layer-stacked leaf) for the whole run after warmup
  'late_switch'  a global late switch ("FP4 All the Way"): every unit from step
                 ``switch_step`` on (max_o must cover every unit)

Each is a :class:`~gnmr_jax.control.priority_types.StaticSet` entry of the table; its
constructor is in :mod:`gnmr_jax.control.recommended`. The state is a
:class:`gnmr_jax.PriorityState` like the budgeted controllers' (the paper's statistics for
telemetry; ``value`` 1 in the set, else 0), so checkpoints and readers are the same.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import optax

from gnmr_jax.control import checks as _checks
from gnmr_jax.control import paper as gnmr_lib
from gnmr_jax.control import priorities
from gnmr_jax.control import units as units_lib
from gnmr_jax.control.priority_types import Field, Settings, StaticSet


def _set_by_pattern(layout, options):
  pattern = units_lib.compile_selector(options["fixed_units"], "pattern")
  return ([pattern.search(unit) is not None for unit in layout.names()],
          f"the pattern {pattern.pattern!r}")


def _set_of_last_blocks(layout, options):
  last = options["last_blocks"]
  in_set = []
  for info in layout:
    if info.is_unit:
      num_layers = info.unit_shape[0] if info.unit_shape else 1
      in_set.extend([info.layer_axis is not None and l >= num_layers - last
                     for l in range(num_layers)])
  return in_set, f"the last {last} block(s) (units of layer-stacked leaves, see `layer_axis`)"


def _every_unit(layout, options):
  del options
  return [True] * layout.num_units, "'late_switch' (every unit)"


def _check_pattern(where, value, options):
  del options
  expected = "a regex searched in the unit names (e.g. r'mlp/down')"
  if value == "":
    raise ValueError(f"{where} must be {expected}, got ''.")
  _checks.check_regex(where, value, expected)


def _check_at_least_one(where, value, options):
  del options
  _checks.check_int(where, value, 1)


FIXED = StaticSet("fixed", "the units whose name matches a regex, every step",
                  unit_set=_set_by_pattern,
                  fields=(Field("fixed_units", "", _check_pattern,
                                "the regex searched in the unit names"),))
LAST_BLOCKS = StaticSet("last_blocks", "every unit of the last layers, every step (NVFP4's)",
                        unit_set=_set_of_last_blocks,
                        fields=(Field("last_blocks", 0, _check_at_least_one,
                                      "how many of the last layers"),))
LATE_SWITCH = StaticSet("late_switch", "every unit from a step on (FP4 All the Way's switch)",
                        unit_set=_every_unit, first_step=lambda options: options["switch_step"],
                        fields=(Field("switch_step", 0, _check_at_least_one,
                                      "the first step run with every unit recovered"),))
STATIC = (FIXED, LAST_BLOCKS, LATE_SWITCH)


def _unit_set(recipe: StaticSet, name: str, max_o: int, layout, options):
  """The set as a bool [N] vector (names and shapes are static)."""
  in_set, what = recipe.unit_set(layout, options)
  if not any(in_set) or sum(in_set) > max_o:
    raise ValueError(
        f"{name}: {what} selects {sum(in_set)} units; a static set must hold 1 to "
        f"max_o={max_o} (the recovery budget and side buffer). Unit names are e.g. "
        f"{layout.names()[:6]}.")
  return jnp.asarray(in_set)


def static_recipe(recipe: StaticSet, *, name: str, settings: Settings,
                  options: Mapping[str, Any]) -> optax.GradientTransformationExtraArgs:
  """The controller recovering ``recipe``'s set (module docstring); ``settings.t_lock`` unused.

  Raises:
    ValueError: an invalid setting or option, before any tracing; at init, a set that is empty
      or larger than ``settings.max_o``.

  Example:
    The last of 3 layers, as :func:`gnmr_jax.last_blocks` builds it:

    >>> import jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.control import static_recipes
    >>> from gnmr_jax.control.priority_types import Settings
    >>> settings = Settings(max_o=1, t_lock=0, warmup=0, units=None, layer_axis=r'^layers/',
    ...                     alpha=2.0, beta=1.5, delta=8)
    >>> tx = static_recipes.static_recipe(static_recipes.LAST_BLOCKS, name="last_blocks",
    ...                                   settings=settings, options={"last_blocks": 1})
    >>> params = {'layers': {'down': jnp.ones((3, 2, 2))}}
    >>> _, state = tx.update(params, tx.init(params), params)
    >>> gnmr_jax.recovery_mask(state)['layers']['down'].tolist()
    [False, False, True]
  """
  priorities.check_settings(name, settings)
  options = recipe.options(dict(options), f"{name}: ")
  first_step = recipe.first_step(options)
  inner = priorities.paper_statistics(settings)
  unit_selector = units_lib.compile_selector(settings.units, "units")
  axis_selector = units_lib.compile_selector(settings.layer_axis, "layer_axis")

  def init_fn(params):
    if not gnmr_lib.is_params_placeholder(params):  # refuse a bad set before any step
      layout = units_lib.resolve_units(params, unit_selector, axis_selector)
      _unit_set(recipe, name, settings.max_o, layout, options)
    return priorities.init_state(inner, params)

  def update_fn(updates, state, params=None, recovery_gap=None, **extra_args):
    updates, ctl, layout = priorities.update_statistics(inner, updates, state, params,
                                                        extra_args)
    value = _unit_set(recipe, name, settings.max_o, layout, options).astype(jnp.float32)
    # The mask made at step t is used at step t + 1.
    selected = (value > 0) & (ctl.count > settings.warmup) & (ctl.count + 1 >= first_step)
    # Kept for telemetry (the noise fraction), as every controller's; no decision reads it.
    gaps = priorities.fold_gap(False, 0.0, layout, state, recovery_gap)
    new_lock = jnp.zeros((layout.num_units,), jnp.int32)
    return updates, priorities.finish(state, ctl, layout, selected, new_lock, value, gaps)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
