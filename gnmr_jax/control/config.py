"""The controller of a config group (``config.gnmr``): the one place that maps it to a transform."""

from __future__ import annotations

import optax

from gnmr_jax.control.priorities import PAPER_T_LOCK, prioritized
from gnmr_jax.control.recommended import ALARM_T_LOCK


# gnmr.t_lock when the config leaves it None: the alarm's 2 for 'gnmr' (the config default since
# 2026-12-02), else the paper's 5, with which 'norm', 'gap', 'hybrid', ... were measured.
DEFAULT_T_LOCK = {"gnmr": ALARM_T_LOCK}


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


def from_config(g, seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """The controller of ``config.gnmr``: :func:`gnmr_jax.gnmr` for priority 'gnmr' (the paper's
  rule), else :func:`gnmr_jax.prioritized` (priority, ...) with the same budget, lock and warmup.
  A ``t_lock`` of None is the priority's default (:func:`t_lock_of`).

  Args:
    g: the ``config.gnmr`` ConfigDict (gnmr_jax.config.gnmr_config()).
    seed: seeds priority 'random'.

  Returns:
    The controller transform; chain it first into the optimizer.

  Example:
    >>> from gnmr_jax.config import gnmr_config
    >>> from gnmr_jax import control
    >>> g = gnmr_config()
    >>> g.priority, g.max_o = 'fixed', 2
    >>> g.fixed_units = r'mlp/down'
    >>> tx = control.from_config(g)
  """
  return prioritized(g.get("priority", "gnmr"), alpha=g.alpha, beta=g.beta, delta=g.delta,
                     max_o=g.max_o, t_lock=t_lock_of(g), warmup=g.warmup, units=g.units or None,
                     layer_axis=g.layer_axis or None, gap_decay=g.get("gap_decay", 0.0),
                     seed=seed, fixed_units=g.get("fixed_units", "") or None,
                     last_blocks=g.get("last_blocks", 0), switch_step=g.get("switch_step", 0),
                     noise_upper=g.get("noise_upper", 1 / 3),
                     noise_lower=g.get("noise_lower", 1 / 6),
                     noise_rank=g.get("noise_rank", "pi"),
                     noise_gate=g.get("noise_gate", "unit"))
