"""The typed entries of the priority table (:mod:`gnmr_jax.control.priority_table`).

A priority is what ``config.gnmr.priority`` names: how a controller decides which units run the
recovery path next step. Three kinds, one base:

  :class:`Ranked`     a ranking under the budgeted rules (:func:`priorities.budgeted`): ``max_o``
                      units, non-finite ones first, then locked ones, then by the ranking's value
  :class:`StaticSet`  a set fixed in advance (:func:`static_recipes.static_recipe`): no ranking,
                      no lock
  :class:`Built`      a controller with its own transform (the paper's rule, saturation)

Each carries its own fields (``config.gnmr.<field>``, with their defaults and checks), its
default lock and its doc line, so the config checks and :func:`gnmr_jax.control.from_config`
read one table. A user adds a priority with
:func:`gnmr_jax.control.register_priority` (docs/guides/controller.md, "A priority of your own").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax

# The paper's thresholds, window and lock: the budgeted controllers' defaults (alpha, beta and
# delta only feed the telemetry statistics, but for 'hybrid' and 'noise', whose alarm they set).
PAPER_ALPHA, PAPER_BETA, PAPER_DELTA, PAPER_T_LOCK = 2.0, 1.5, 8, 5


@dataclasses.dataclass(frozen=True)
class Field:
  """A field of ``config.gnmr`` that one priority reads (passed to it as a keyword option).

  Attributes:
    name: the field's name, in ``config.gnmr`` and as the option's keyword.
    default: its value when unset; a config that sets another value while another priority is
      chosen is refused (the field would be ignored).
    check: ``check(where, value, options)`` raises a ValueError naming ``where`` (e.g.
      ``'config.gnmr.noise_lower'``) and what is allowed; ``options`` holds the priority's other
      fields. None: any value.
    doc: one line, what it sets.
  """
  name: str
  default: Any
  check: Optional[Callable[[str, Any, Mapping[str, Any]], None]] = None
  doc: str = ""


class Settings(NamedTuple):
  """What every controller is built with (``config.gnmr``'s shared fields)."""
  max_o: int
  t_lock: int
  warmup: int
  units: Any
  layer_axis: Any
  alpha: Any
  beta: Any
  delta: int
  gap_decay: float = 0.0  # the priorities that read a measured gap: weight of the old estimate
  seed: int = 0           # the priorities that draw at random


class Signals(NamedTuple):
  """What a ranking reads at step t: one [N] vector per unit (tree order), N = the units.

  The paper's statistics (``norm``, ``risky``, ``score``) are computed for every priority; the
  gap fields hold the estimates folded from the measurements (:class:`gnmr_jax.PriorityState`).
  """
  step: jax.Array        # int32 scalar: the steps seen, t
  norm: jax.Array        # float32: ||g_u(t)||
  finite: jax.Array      # bool: whether norm is finite
  gnmr: jax.Array        # float32: GNMR_t, the norm over the mean of its finite history
  delta_gnmr: jax.Array  # float32: dGNMR_t, GNMR_t over its mean in the last delta steps
  risky: jax.Array       # bool: over the paper's alpha_t or beta_t (or non-finite)
  score: jax.Array       # float32: the paper's risk score
  lock: jax.Array        # int32: steps of lock left
  prev_mask: jax.Array   # bool: the mask used at step t
  gap: jax.Array         # float32: recovery-gap estimate (0 before the first measurement)
  gap_count: jax.Array   # int32: measurements folded into gap
  noise_sq: jax.Array    # float32: EMA of e_u^2
  rec_sq: jax.Array      # float32: EMA of ||g_rec,u||^2
  key: jax.Array         # this step's random key: fold_in(key(settings.seed), step)


class Ranking(NamedTuple):
  """A ranking's answer for one step: the engine keeps the first ``max_o`` candidates by
  (tier, value), ties in tree order."""
  value: jax.Array                       # float32 [N]: higher first (kept in the state)
  tier: Optional[jax.Array] = None       # int32 [N]: above value (a locked unit's is >= 1,
                                         # a non-finite one's 3); None: 1 if locked, else 0
  candidate: Optional[jax.Array] = None  # bool [N]: may be selected (locked units always
                                         # are); None: every unit


@dataclasses.dataclass(frozen=True)
class Priority:
  """The base of the table's entries.

  Attributes:
    name: the value of ``config.gnmr.priority``.
    doc: one line, what it recovers.
    fields: the ``config.gnmr`` fields only this priority reads.
    t_lock: the lock when ``config.gnmr.t_lock`` is None.
    reads_gap: ranks by a measured recovery gap: the train step must measure it
      (``config.diagnostics.recovery_gap_every`` > 0).
    check_config: ``check_config(config)`` raises a ValueError for what this priority needs
      elsewhere in the config (e.g. a scaling recipe); None: nothing.
  """
  name: str
  doc: str
  fields: tuple[Field, ...] = ()
  t_lock: int = PAPER_T_LOCK
  reads_gap: bool = False
  check_config: Optional[Callable[[Any], None]] = None

  def options(self, given: Mapping[str, Any], where: str) -> dict:
    """This priority's fields from ``given`` (defaults where absent), each checked; unknown
    keys refused. ``where`` prefixes the field in messages ('config.gnmr.', or a constructor's
    'noise: ')."""
    names = [f.name for f in self.fields]
    unknown = sorted(set(given) - set(names))
    if unknown:
      raise ValueError(f"priority {self.name!r} has no field {unknown[0]!r}; its fields: "
                       f"{names or 'none'}.")
    options = {f.name: given.get(f.name, f.default) for f in self.fields}
    for f in self.fields:
      if f.check is not None:
        label = f"{where}`{f.name}`" if where.endswith(": ") else f"{where}{f.name}"
        f.check(label, options[f.name], options)
    return options


@dataclasses.dataclass(frozen=True)
class Ranked(Priority):
  """A ranking under the budgeted rules.

  Attributes:
    rank: ``rank(signals, options) -> Ranking``, traced inside the controller's update.
    relative_gap: fold each measured gap as e_u / ||g_rec,u|| (else e_u).
    last_gap_only: rank by the last measurement alone (``gap_decay`` 0, whatever the config).
    nonfinite_first: a unit with a non-finite norm outranks every other ('random': no).
  """
  rank: Callable[[Signals, Mapping[str, Any]], Ranking] = None
  relative_gap: bool = False
  last_gap_only: bool = False
  nonfinite_first: bool = True


@dataclasses.dataclass(frozen=True)
class StaticSet(Priority):
  """A set fixed in advance: no signal, no lock.

  Attributes:
    unit_set: ``unit_set(layout, options) -> (list of N bools, what)``: the set over the units
      of a :class:`gnmr_jax.control.UnitLayout`, and its description for errors.
    first_step: ``first_step(options)``: the first step run with the set recovered (0: from
      the end of warmup).
  """
  unit_set: Callable[[Any, Mapping[str, Any]], tuple] = None
  first_step: Callable[[Mapping[str, Any]], int] = lambda options: 0


@dataclasses.dataclass(frozen=True)
class Built(Priority):
  """A controller with its own transform: ``constructor(settings, options)``."""
  constructor: Callable[[Settings, Mapping[str, Any]], Any] = None
