"""Moved to :mod:`gnmr_jax.control.units`; this module keeps the old import path working."""

from gnmr_jax import _moved
from gnmr_jax.control.units import LeafUnits as LeafUnits
from gnmr_jax.control.units import UnitLayout as UnitLayout
from gnmr_jax.control.units import compile_selector as compile_selector
from gnmr_jax.control.units import layout_of as layout_of
from gnmr_jax.control.units import path_to_str as path_to_str
from gnmr_jax.control.units import resolve_units as resolve_units
from gnmr_jax.control.units import unbox as unbox
from gnmr_jax.control.units import unit_norms as unit_norms

__getattr__ = _moved.missing(__name__, {})
