"""Precision paths and routed execution for GNMR.

``make_policy(config)`` builds a ``PrecisionPolicy`` whose ``dot`` runs each unit
on the low-cost path, or (mode='gnmr') on ``lax.cond(recover, recovery, low_cost)``.
Paths: 'bf16' (recovery/reference), 'int8', 'fp8', 'saved_activation', 'blockwise',
'mxfp8', 'nvfp4' (block-scaled microscaling: emulated, microscaling.py, or native
on Blackwell GPUs, native_microscaling.py, per ``microscaling_impl``);
add one with ``register_path(name, builder)``. Routed units whose recovery path
keeps more than the low-cost path store it in a shared side buffer
(``policy.init_side``/``dot_side``, ``side_buffer.attach``; side_buffer.py).
"""

# Importing a path module registers it.
from gnmr_jax.precision import bf16 as bf16
from gnmr_jax.precision import blockwise as blockwise
from gnmr_jax.precision import fp8 as fp8
from gnmr_jax.precision import int8 as int8
from gnmr_jax.precision import mxfp8 as mxfp8
from gnmr_jax.precision import nvfp4 as nvfp4
from gnmr_jax.precision import saved_activation as saved_activation
from gnmr_jax.precision import side_buffer as side_buffer
from gnmr_jax.precision.backend import default_low_cost_path as default_low_cost_path
from gnmr_jax.precision.config import default_precision_config as default_precision_config
from gnmr_jax.precision.config import validate_config as validate_config
from gnmr_jax.precision.policy import make_policy as make_policy
from gnmr_jax.precision.policy import recovery_policy as recovery_policy
from gnmr_jax.precision.policy import PrecisionPolicy as PrecisionPolicy
from gnmr_jax.precision.registry import available_paths as available_paths
from gnmr_jax.precision.registry import register_path as register_path
from gnmr_jax.precision.path import Path as Path
from gnmr_jax.precision.path import path_dot as path_dot
from gnmr_jax.precision.routing import routed_dot as routed_dot
from gnmr_jax.precision.routing import routed_side_dot as routed_side_dot
