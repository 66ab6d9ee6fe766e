"""The bf16 path: the recovery path and the reference.

bfloat16 operands, float32 accumulation, in all three matmuls (forward, dlhs,
drhs). Params may stay float32 masters; they are cast per call.
"""

from __future__ import annotations

from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import quantize, registry

PATH = path_lib.three_leg_path(
    quantize.bf16_matmul, quantize.bf16_matmul, quantize.bf16_matmul)
bf16_dot = path_lib.path_dot(PATH)
bf16_dot.__doc__ = r"""bf16 dot :math:`y = \mathrm{bf16}(x)\,\mathrm{bf16}(W)` accumulated in float32.

Backward: :math:`\partial x = \mathrm{bf16}(g)\,\mathrm{bf16}(W)^T`,
:math:`\partial W = \mathrm{bf16}(x)^T\,\mathrm{bf16}(g)`, both accumulated in float32.

Args:
  x: [M, K] activations.
  kernel: [K, N] weights.

Returns:
  [M, N] in ``x.dtype``.

Example:
  >>> import jax.numpy as jnp
  >>> bf16_dot(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
  (2, 4)
"""


registry.register_path('bf16', registry.fixed_path(PATH))
