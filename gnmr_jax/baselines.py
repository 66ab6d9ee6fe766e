"""Moved: the clipping transforms to :mod:`gnmr_jax.clipping`, same-budget random recovery to
:func:`gnmr_jax.control.random_recovery`; this module keeps the old import path working."""

from gnmr_jax import _moved
from gnmr_jax.clipping import AdaGCState as AdaGCState
from gnmr_jax.clipping import ZClipState as ZClipState
from gnmr_jax.clipping import adagc as adagc
from gnmr_jax.clipping import zclip as zclip
from gnmr_jax.control.priorities import random_recovery as random_recovery

__getattr__ = _moved.missing(__name__, {})
