"""Moved to :mod:`gnmr_jax.control` (the rule in ``control/paper.py``, the readers in
``control/state.py``); this module keeps the old import path working."""

from gnmr_jax import _moved
from gnmr_jax.control.paper import GNMRState as GNMRState
from gnmr_jax.control.paper import GNMRTelemetry as GNMRTelemetry
from gnmr_jax.control.paper import gnmr as gnmr
from gnmr_jax.control.state import controller_state as controller_state
from gnmr_jax.control.state import recovery_mask as recovery_mask

__getattr__ = _moved.missing(__name__, {
    "_flat": "gnmr_jax.control.units.UnitLayout.flat",
    "_unflat": "gnmr_jax.control.units.UnitLayout.unflat",
    "_replicated": "gnmr_jax.control.units.UnitLayout.flat (replicated per-unit vectors)",
    "_check_int": "gnmr_jax.control.checks.check_int",
    "_check_positive": "gnmr_jax.control.checks.check_positive_or_schedule",
    "_find_states": "gnmr_jax.control.state.find_states",
    "_readable": "gnmr_jax.control.controller_state",
})
