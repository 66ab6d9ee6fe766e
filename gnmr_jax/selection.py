"""Moved to :mod:`gnmr_jax.control.priorities`; this module keeps the old import path working."""

from gnmr_jax import _moved
from gnmr_jax.control.priorities import GAP_PRIORITIES as GAP_PRIORITIES
from gnmr_jax.control.priorities import PRIORITIES as PRIORITIES
from gnmr_jax.control.priorities import PriorityState as PriorityState
from gnmr_jax.control.priorities import needs_recovery_gap as needs_recovery_gap
from gnmr_jax.control.priorities import prioritized as prioritized
from gnmr_jax.control.priorities import random_recovery as random_recovery
from gnmr_jax.control.state import gap_estimate as gap_estimate

__getattr__ = _moved.missing(__name__, {})
