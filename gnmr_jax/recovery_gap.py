"""Moved to :mod:`gnmr_jax.control.recovery_gap` (and the recovery policy to
:func:`gnmr_jax.precision.recovery_policy`); this module keeps the old import path working."""

from gnmr_jax import _moved
from gnmr_jax.control.recovery_gap import MEASURING_PASSES as MEASURING_PASSES
from gnmr_jax.control.recovery_gap import GapProbe as GapProbe
from gnmr_jax.control.recovery_gap import GradientPasses as GradientPasses
from gnmr_jax.control.recovery_gap import RecoveryGap as RecoveryGap
from gnmr_jax.control.recovery_gap import all_recovered_mask as all_recovered_mask
from gnmr_jax.control.recovery_gap import measure as measure
from gnmr_jax.control.recovery_gap import measure_passes as measure_passes
from gnmr_jax.control.recovery_gap import not_measured as not_measured
from gnmr_jax.control.recovery_gap import summarize as summarize
from gnmr_jax.control.recovery_gap import swapped_mask as swapped_mask
from gnmr_jax.control.recovery_gap import unit_gaps as unit_gaps
from gnmr_jax.precision.policy import recovery_policy as recovery_policy

__getattr__ = _moved.missing(__name__, {})
