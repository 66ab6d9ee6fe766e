"""gnmr_jax: GNMR runtime stability control for low-precision LLM training in JAX.

Public API, one constructor per controller (optax transforms that emit a recovery mask):
  gnmr(...)             the paper's rule
  transient_alarm(...)  the paper's rule at alpha 4 / beta 3 / t_lock 2: the config default, for
                        low-cost paths that do not hurt persistently (int8 / fp8)
  norm_level(...)       the max_o units with the largest gradient norm: where the low-cost error
                        is persistent and not measured
  fixed_set(...), last_blocks(...), late_switch(...)
                        static recipes: a named set, the last layers, every unit from a step on
  control.research      instruments and baselines (measured gap, oracle, random, noise, ...)
  control.from_config   the controller that ``config.gnmr.priority`` names
  GNMRState             the state that carries every controller's mask, statistics, telemetry
  PriorityState         the state of the budgeted controllers (a GNMRState inside)
  recovery_mask(s)      the mask tree found inside any optax state
  controller_state(s)   the GNMRState found inside any optax state
  control               the package that holds all of it (gnmr_jax/control/)
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
from gnmr_jax.control import recovery_mask as recovery_mask
from gnmr_jax.control import transient_alarm as transient_alarm

__all__ = ["gnmr", "transient_alarm", "norm_level", "fixed_set", "last_blocks", "late_switch",
           "GNMRState", "GNMRTelemetry", "PriorityState", "recovery_mask", "controller_state",
           "control"]
__version__ = "0.2.0"
