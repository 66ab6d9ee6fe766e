"""The priority table: every value ``config.gnmr.priority`` may take, one typed entry each.

:func:`gnmr_jax.control.from_config`, the config checks (:func:`gnmr_jax.config.validate`) and
the train step read this table only; :func:`register_priority` adds an entry of your own
(docs/guides/controller.md, "A priority of your own").

  gnmr         the paper's rule (:func:`gnmr_jax.gnmr`), a :class:`Built` entry
  saturation   delayed scaling's saturation as the alarm (:func:`research.saturation`)
  norm, gap, relgap, oracle, hybrid, random, noise
               rankings under the budgeted rules (:mod:`gnmr_jax.control.priorities`)
  fixed, last_blocks, late_switch
               static recipes (:mod:`gnmr_jax.control.static_recipes`)
"""

from __future__ import annotations

from gnmr_jax.control import paper
from gnmr_jax.control import priorities
from gnmr_jax.control import recommended
from gnmr_jax.control import research
from gnmr_jax.control import static_recipes
from gnmr_jax.control.priority_types import Built, Priority, Ranked, Settings, StaticSet

# config.gnmr's fields that every controller reads (Settings); no priority may own one.
SHARED_FIELDS = ("enabled", "priority", "alpha", "beta", "delta", "max_o", "t_lock", "warmup",
                 "units", "layer_axis", "gap_decay")


def _paper(settings: Settings, options) -> object:
  del options
  return paper.gnmr(alpha=settings.alpha, beta=settings.beta, delta=settings.delta,
                    max_o=settings.max_o, t_lock=settings.t_lock, warmup=settings.warmup,
                    units=settings.units, layer_axis=settings.layer_axis)


def _saturation(settings: Settings, options) -> object:
  del options
  return research.saturation(max_o=settings.max_o, t_lock=settings.t_lock,
                             warmup=settings.warmup, units=settings.units,
                             layer_axis=settings.layer_axis, delta=settings.delta)


def _needs_delayed_scaling(config) -> None:
  scaling = config.precision.get("scaling")
  if config.gnmr.enabled and scaling != "delayed":
    raise ValueError(f"config.gnmr.priority='saturation' reads delayed scaling's saturation: "
                     f"set config.precision.scaling='delayed' (got {scaling!r}; without delayed "
                     f"scaling nothing saturates, and 'auto' is resolved per device only when "
                     f"the run is built).")


# 'gnmr' with config.gnmr.t_lock None: the transient alarm's lock (the config's thresholds are
# recommended.transient_alarm's).
PAPER = Built("gnmr", "the paper's rule: units over alpha_t or beta_t, top max_o by risk",
              constructor=_paper, t_lock=recommended.ALARM_T_LOCK)
SATURATION = Built("saturation", "the units whose delayed-scaling codes saturated",
                   constructor=_saturation, t_lock=research.SATURATION_T_LOCK,
                   check_config=_needs_delayed_scaling)

_TABLE: dict[str, Priority] = {
    entry.name: entry
    for entry in (PAPER, *priorities.RANKED, *static_recipes.STATIC, SATURATION)}


def names() -> tuple[str, ...]:
  """The priorities in the table, built-in first, then registered ones in order."""
  return tuple(_TABLE)


def get(name: str) -> Priority:
  """The entry named ``name``.

  Raises:
    ValueError: no such entry, naming those there are.

  Example:
    >>> from gnmr_jax.control import priority_table
    >>> entry = priority_table.get('noise')
    >>> [f.name for f in entry.fields], entry.reads_gap, entry.t_lock
    (['noise_upper', 'noise_lower', 'noise_rank', 'noise_gate'], True, 5)
  """
  if name not in _TABLE:
    raise ValueError(f"config.gnmr.priority must be one of {names()}, got {name!r}.")
  return _TABLE[name]


def field_owners() -> dict:
  """{field: the priority that reads it} over every entry's own fields."""
  return {f.name: entry.name for entry in _TABLE.values() for f in entry.fields}


def needs_recovery_gap(name: str) -> bool:
  """Whether a priority ranks by a measured recovery gap (the train step must measure it)."""
  return get(name).reads_gap


def build(entry: Priority, settings: Settings, options, name: str):
  """The controller transform of ``entry`` with ``settings`` and its checked ``options``;
  ``name`` prefixes its error messages."""
  if isinstance(entry, Ranked):
    return priorities.budgeted(entry, name=name, settings=settings, options=options)
  if isinstance(entry, StaticSet):
    return static_recipes.static_recipe(entry, name=name, settings=settings, options=options)
  return entry.constructor(settings, options)


def register_priority(entry: Priority, *, replace: bool = False) -> Priority:
  """Adds ``entry`` to the table, so ``config.gnmr.priority = entry.name`` builds it.

  Args:
    entry: a :class:`Ranked` (a ranking under the budgeted rules: the usual case),
      :class:`StaticSet` or :class:`Built` entry.
    replace: allow replacing a registered entry of the same name (a notebook cell run twice);
      the built-in entries are never replaced.

  Returns:
    ``entry``.

  Raises:
    ValueError: a built-in name, a name already there (without ``replace``), fields without
      distinct identifier names or named like a shared ``config.gnmr`` field or another
      priority's, or an entry without its callable.
  """
  if type(entry) not in (Ranked, StaticSet, Built):  # pylint: disable=unidiomatic-typecheck
    raise ValueError(f"register_priority takes a Ranked, StaticSet or Built entry, got "
                     f"{entry!r}.")
  if not isinstance(entry.name, str) or not entry.name.isidentifier():
    raise ValueError(f"a priority's name must be an identifier, got {entry.name!r}.")
  if entry.name in _BUILT_IN:
    raise ValueError(f"priority {entry.name!r} is built in; name yours otherwise.")
  if entry.name in _TABLE and not replace:
    raise ValueError(f"priority {entry.name!r} is already in the table (replace=True to "
                     f"replace it).")
  needed = {Ranked: "rank", StaticSet: "unit_set", Built: "constructor"}[type(entry)]
  if not callable(getattr(entry, needed)):
    raise ValueError(f"priority {entry.name!r}: `{needed}` must be callable.")
  names_given = [f.name for f in entry.fields]
  if len(set(names_given)) != len(names_given) or not all(
      isinstance(n, str) and n.isidentifier() for n in names_given):
    raise ValueError(f"priority {entry.name!r}: its fields must have distinct identifier "
                     f"names, got {names_given}.")
  owners = field_owners()
  for f in entry.fields:
    if f.name in SHARED_FIELDS:
      raise ValueError(f"priority {entry.name!r}: field {f.name!r} is a shared config.gnmr "
                       f"field ({SHARED_FIELDS}); name it for your priority.")
    if owners.get(f.name, entry.name) != entry.name:
      raise ValueError(f"priority {entry.name!r}: field {f.name!r} is priority "
                       f"{owners[f.name]!r}'s; name it for your priority.")
  _TABLE[entry.name] = entry
  return entry


def unregister_priority(name: str) -> None:
  """Removes a registered entry (tests, notebooks); the built-in ones stay.

  Raises:
    ValueError: ``name`` is built in or absent.
  """
  if name in _BUILT_IN or name not in _TABLE:
    raise ValueError(f"{name!r} is not a registered priority (built in: {_BUILT_IN}).")
  del _TABLE[name]


_BUILT_IN = names()
