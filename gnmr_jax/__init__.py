"""gnmr_jax: GNMR runtime stability control for low-precision LLM training in JAX.

Public API:
  gnmr(...)            the paper's controller, an optax transform emitting a recovery mask
                       (config.gnmr's default, at alpha 4 / beta 3: a transient alarm)
  prioritized(...)     budgeted controllers ranking units by another signal ('norm', 'noise',
                       'gap', 'hybrid', 'random', static sets: 'fixed', 'last_blocks', ...)
  GNMRState            the state that carries every controller's mask, statistics, telemetry
  recovery_mask(s)     the mask tree found inside any optax state
  controller_state(s)  the GNMRState found inside any optax state
  control              the package that holds all of it (gnmr_jax/control/)
"""

from gnmr_jax import control as control
from gnmr_jax.control import GNMRState as GNMRState
from gnmr_jax.control import GNMRTelemetry as GNMRTelemetry
from gnmr_jax.control import PriorityState as PriorityState
from gnmr_jax.control import controller_state as controller_state
from gnmr_jax.control import fixed_set as fixed_set
from gnmr_jax.control import gnmr as gnmr
from gnmr_jax.control import last_blocks as last_blocks
from gnmr_jax.control import late_switch as late_switch
from gnmr_jax.control import norm_level as norm_level
from gnmr_jax.control import prioritized as prioritized
from gnmr_jax.control import recovery_mask as recovery_mask
from gnmr_jax.control import transient_alarm as transient_alarm

__all__ = ["gnmr", "prioritized", "GNMRState", "GNMRTelemetry", "PriorityState",
           "recovery_mask", "controller_state", "control"]
__version__ = "0.1.0"
