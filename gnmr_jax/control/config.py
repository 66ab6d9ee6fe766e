"""The controller of a config group (``config.gnmr``): the one place that maps it to a transform.

``config.gnmr.priority`` names an entry of the priority table
(:mod:`gnmr_jax.control.priority_table`); :func:`from_config` builds it with the shared fields
(:class:`~gnmr_jax.control.priority_types.Settings`) and the entry's own fields.
"""

from __future__ import annotations

import optax

from gnmr_jax.control import priority_table
from gnmr_jax.control.priority_types import Settings


def priority_of(g) -> str:
  """``config.gnmr.priority``; a config written before priorities existed means the paper's."""
  return g.get("priority", "gnmr")


def t_lock_of(g) -> int:
  """``config.gnmr.t_lock``, or its priority's default (the table's ``t_lock``) when None.

  Example:
    >>> from gnmr_jax.config import gnmr_config
    >>> g = gnmr_config()
    >>> t_lock_of(g), g.priority
    (2, 'gnmr')
    >>> g.priority = 'norm'
    >>> t_lock_of(g)
    5
    >>> g.t_lock = 1
    >>> t_lock_of(g)
    1
  """
  t_lock = g.get("t_lock")
  if t_lock is not None:
    return t_lock
  return priority_table.get(priority_of(g)).t_lock


def check_priority_fields(g) -> None:
  """Refuses a field of ``config.gnmr`` that only another priority reads, when it is set.

  Raises:
    ValueError: naming the field, its priority and ``config.gnmr.priority``.
  """
  priority = priority_of(g)
  for field, owner in priority_table.field_owners().items():
    if owner == priority or field not in g:
      continue
    unset = next(f.default for f in priority_table.get(owner).fields if f.name == field)
    if g[field] not in (unset, None):
      raise ValueError(f"config.gnmr.{field}={g[field]!r} is read by priority {owner!r} only; "
                       f"config.gnmr.priority is {priority!r}.")


def options_of(g) -> dict:
  """The fields of ``config.gnmr`` that its priority reads, checked (defaults where absent).

  Raises:
    ValueError: an unknown priority, or a field of it that its check refuses.
  """
  entry = priority_table.get(priority_of(g))
  return entry.options({f.name: g[f.name] for f in entry.fields if f.name in g},
                       "config.gnmr.")


def from_config(g, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The controller of ``config.gnmr``: the table's entry that ``g.priority`` names
  ('gnmr' is :func:`gnmr_jax.gnmr`, 'norm' :func:`gnmr_jax.norm_level`, 'fixed' /
  'last_blocks' / 'late_switch' the static recipes, the others
  :mod:`gnmr_jax.control.research`, or one registered with
  :func:`gnmr_jax.control.register_priority`) with the fields it reads. A ``t_lock`` of None
  is the priority's default (:func:`t_lock_of`).

  Args:
    g: the ``config.gnmr`` ConfigDict (gnmr_jax.config.gnmr_config()).
    seed: the controller's seed (priority 'random' draws with it).

  Returns:
    The controller transform; chain it first into the optimizer.

  Raises:
    ValueError: an unknown priority, a field set that only another priority reads, or an
      invalid field.

  Example:
    >>> from gnmr_jax.config import gnmr_config
    >>> from gnmr_jax import control
    >>> g = gnmr_config()
    >>> g.priority, g.max_o = 'fixed', 2
    >>> g.fixed_units = r'mlp/down'
    >>> tx = control.from_config(g)
  """
  priority = priority_of(g)
  entry = priority_table.get(priority)
  check_priority_fields(g)
  settings = Settings(max_o=g.max_o, t_lock=t_lock_of(g), warmup=g.warmup,
                      units=g.units or None, layer_axis=g.layer_axis or None, alpha=g.alpha,
                      beta=g.beta, delta=g.delta, gap_decay=g.get("gap_decay", 0.0), seed=seed)
  return priority_table.build(entry, settings, options_of(g),
                              f"config.gnmr.priority={priority!r}")
