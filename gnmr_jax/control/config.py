"""The controller of a config group (``config.gnmr``): the one place that maps it to a transform.

``config.gnmr.priority`` names the controller; :data:`FROM_CONFIG` maps each name to its
constructor (:mod:`gnmr_jax.control.paper`, :mod:`gnmr_jax.control.recommended`,
:mod:`gnmr_jax.control.research`) called with the fields that controller reads.
"""

from __future__ import annotations

from typing import Callable

import optax

from gnmr_jax.control import paper
from gnmr_jax.control import recommended
from gnmr_jax.control import research
from gnmr_jax.control.priorities import PAPER_T_LOCK


# gnmr.t_lock when the config leaves it None: the alarm's 2 for 'gnmr' (the config default since
# 2026-12-02), 1 for 'saturation' (research.SATURATION_T_LOCK), else the paper's 5, with which
# 'norm', 'gap', 'hybrid', ... were measured.
DEFAULT_T_LOCK = {"gnmr": recommended.ALARM_T_LOCK, "saturation": research.SATURATION_T_LOCK}

# config.gnmr fields read by one priority only: (that priority, the value that leaves it unset).
PRIORITY_FIELDS = {"fixed_units": ("fixed", ""), "last_blocks": ("last_blocks", 0),
                   "switch_step": ("late_switch", 0), "noise_upper": ("noise", 1 / 3),
                   "noise_lower": ("noise", 1 / 6), "noise_rank": ("noise", "pi"),
                   "noise_gate": ("noise", "unit")}


def t_lock_of(g) -> int:
  """``config.gnmr.t_lock``, or its priority's default when it is None.

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
  return DEFAULT_T_LOCK.get(g.get("priority", "gnmr"), PAPER_T_LOCK)


def _shared(g) -> dict:
  """The fields every controller reads: budget, warmup, units and the paper's statistics."""
  return dict(max_o=g.max_o, warmup=g.warmup, units=g.units or None,
              layer_axis=g.layer_axis or None, alpha=g.alpha, beta=g.beta, delta=g.delta)


def _gap_decay(g) -> float:
  return g.get("gap_decay", 0.0)


def _field(g, name: str):
  """A field of :data:`PRIORITY_FIELDS`, unset in configs written before it existed."""
  return g.get(name, PRIORITY_FIELDS[name][1])


# config.gnmr.priority -> (config.gnmr, seed) -> the controller.
FROM_CONFIG: dict[str, Callable] = {
    "gnmr": lambda g, seed: paper.gnmr(t_lock=t_lock_of(g), **_shared(g)),
    "norm": lambda g, seed: recommended.norm_level(t_lock=t_lock_of(g), **_shared(g)),
    "gap": lambda g, seed: research.gap(t_lock=t_lock_of(g), gap_decay=_gap_decay(g),
                                        **_shared(g)),
    "relgap": lambda g, seed: research.relgap(t_lock=t_lock_of(g), gap_decay=_gap_decay(g),
                                              **_shared(g)),
    "oracle": lambda g, seed: research.oracle(t_lock=t_lock_of(g), **_shared(g)),
    "hybrid": lambda g, seed: research.hybrid(t_lock=t_lock_of(g), **_shared(g)),
    "random": lambda g, seed: research.random(t_lock=t_lock_of(g), seed=seed, **_shared(g)),
    "fixed": lambda g, seed: recommended.fixed_set(_field(g, "fixed_units"), **_shared(g)),
    "last_blocks": lambda g, seed: recommended.last_blocks(_field(g, "last_blocks"),
                                                           **_shared(g)),
    "late_switch": lambda g, seed: recommended.late_switch(_field(g, "switch_step"),
                                                           **_shared(g)),
    "saturation": lambda g, seed: research.saturation(
        t_lock=t_lock_of(g), max_o=g.max_o, warmup=g.warmup, units=g.units or None,
        layer_axis=g.layer_axis or None, delta=g.delta),
    "noise": lambda g, seed: research.noise(
        t_lock=t_lock_of(g), gap_decay=_gap_decay(g), noise_upper=_field(g, "noise_upper"),
        noise_lower=_field(g, "noise_lower"), noise_rank=_field(g, "noise_rank"),
        noise_gate=_field(g, "noise_gate"), **_shared(g)),
}
PRIORITIES = tuple(FROM_CONFIG)


def check_priority_fields(g) -> None:
  """Refuses a field of ``config.gnmr`` that only another priority reads, when it is set.

  Raises:
    ValueError: naming the field, its priority and ``config.gnmr.priority``.
  """
  priority = g.get("priority", "gnmr")
  for field, (owner, unset) in PRIORITY_FIELDS.items():
    value = g.get(field, unset)
    if owner != priority and value not in (unset, None):
      raise ValueError(f"config.gnmr.{field}={value!r} is read by priority {owner!r} only; "
                       f"config.gnmr.priority is {priority!r}.")


def from_config(g, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The controller of ``config.gnmr``: the constructor that ``g.priority`` names
  (:data:`FROM_CONFIG`: 'gnmr' is :func:`gnmr_jax.gnmr`, 'norm' :func:`gnmr_jax.norm_level`,
  'fixed' / 'last_blocks' / 'late_switch' the static recipes, the others
  :mod:`gnmr_jax.control.research`) with the fields it reads. A ``t_lock`` of None is the
  priority's default (:func:`t_lock_of`).

  Args:
    g: the ``config.gnmr`` ConfigDict (gnmr_jax.config.gnmr_config()).
    seed: seeds priority 'random'.

  Returns:
    The controller transform; chain it first into the optimizer.

  Raises:
    ValueError: an unknown priority, a field set that only another priority reads, or an
      invalid field (from the constructor).

  Example:
    >>> from gnmr_jax.config import gnmr_config
    >>> from gnmr_jax import control
    >>> g = gnmr_config()
    >>> g.priority, g.max_o = 'fixed', 2
    >>> g.fixed_units = r'mlp/down'
    >>> tx = control.from_config(g)
  """
  priority = g.get("priority", "gnmr")
  if priority not in FROM_CONFIG:
    raise ValueError(f"config.gnmr.priority must be one of {PRIORITIES}, got {priority!r}.")
  check_priority_fields(g)
  return FROM_CONFIG[priority](g, seed)
