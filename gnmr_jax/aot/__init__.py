"""Compiling for TPUs and GPUs on a CPU host (deviceless ahead-of-time compilation).

  compile_config(config, target)   a config's train / eval steps compiled for a named target:
                                   memory per device and fit, compile seconds, GEMMs by dtype,
                                   conditionals, loops, collectives (a JSON-able report)
  get_target(name)                 'h100', 'h100:2x8', 'v5e-4', 'v5p-64', ... (targets.py)
  inventory.parse(hlo_text)        what an optimized HLO program runs (inventory.py)

Command line: ``python -m gnmr_jax.aot --config=configs/small.py --target=v5e-4``, in an
environment with the ``aot`` extra (``make aot-venv``; see README "Compiling for an
accelerator").
"""

from gnmr_jax.aot import inventory as inventory
from gnmr_jax.aot.compile import AotSetupError as AotSetupError
from gnmr_jax.aot.compile import DoesNotFit as DoesNotFit
from gnmr_jax.aot.compile import compile_config as compile_config
from gnmr_jax.aot.compile import fits as fits
from gnmr_jax.aot.targets import Target as Target
from gnmr_jax.aot.targets import get_target as get_target
from gnmr_jax.aot.targets import target_names as target_names

__all__ = ['compile_config', 'fits', 'get_target', 'target_names', 'Target', 'AotSetupError',
           'DoesNotFit', 'inventory']
