"""gnmr_jax: GNMR runtime stability control for low-precision LLM training in JAX.

Public API:
  gnmr(...)            the controller, an optax transform emitting a recovery mask
  GNMRState            its state (per-unit statistics, locks, mask, telemetry)
  recovery_mask(s)     the mask tree found inside any optax state
  controller_state(s)  the GNMRState found inside any optax state
"""

from gnmr_jax.controller import GNMRState
from gnmr_jax.controller import GNMRTelemetry
from gnmr_jax.controller import controller_state
from gnmr_jax.controller import gnmr
from gnmr_jax.controller import recovery_mask

__all__ = ["gnmr", "GNMRState", "GNMRTelemetry", "recovery_mask", "controller_state"]
__version__ = "0.1.0"
