r"""The MXFP8 path: E4M3 values in 1 x 32 blocks with E8M0 scales rounded up (microscaling.py).

All three matmuls quantize both operands along their own contracting axis
(forward, dlhs, drhs), round to nearest, re-quantizing the saved ``x`` and ``W``
for the backward, as NVIDIA's MXFP8 recipe does (E4M3 for every tensor,
gradients included). Emulated on every backend: the block-scaled values, exact
in bfloat16, go into a bf16 x bf16 -> float32 ``dot_general``. The path
``'mxfp8_backward'`` runs the forward in bf16 and the backward in MXFP8 (the
recovery path of a forward-only late switch).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import explicit_sharding, microscaling, quantize, registry
from gnmr_jax.precision import path as path_lib


def mxfp8_matmul(lhs, rhs, out_dtype, out_sharding=None):
  r""":math:`Q(a)\,Q(b)` for [M, C] x [C, N], both quantized in 1 x 32 blocks along C.

  Args:
    lhs: [M, C].
    rhs: [C, N].
    out_dtype: the result's dtype.
    out_sharding: the result's sharding under an explicit-axis mesh, else None.

  Returns:
    [M, N] of ``out_dtype``, accumulated in float32.

  Example:
    >>> import jax.numpy as jnp
    >>> mxfp8_matmul(jnp.full((2, 40), 0.3), jnp.ones((40, 3)), jnp.float32).tolist()[0]
    [12.5, 12.5, 12.5]
  """
  acc = lax.dot_general(microscaling.mxfp8_quantize(lhs, 1),
                        microscaling.mxfp8_quantize(rhs, 0), quantize.MATMUL_DIMS,
                        preferred_element_type=jnp.float32,
                        **explicit_sharding.dot_kwargs(out_sharding))
  return acc.astype(out_dtype)


def _forward(x, kernel, out_dtype):
  return mxfp8_matmul(x, kernel, out_dtype)


PATH = path_lib.three_leg_path(_forward, mxfp8_matmul, mxfp8_matmul)
mxfp8_dot = path_lib.path_dot(PATH)
mxfp8_dot.__doc__ = r"""MXFP8 dot: :math:`y = Q(x)\,Q(W)`, :math:`\partial x = Q(g)\,Q(W^T)`,
:math:`\partial W = Q(x^T)\,Q(g)`, each Q in 1 x 32 blocks along the contraction.

Args:
  x: [M, K] activations.
  kernel: [K, N] weights.

Returns:
  [M, N] in ``x.dtype``.
"""


# The converse of a forward-only MXFP8 path: the forward in bf16, both backward matmuls in MXFP8,
# the recovery path of a forward-only late switch ('late_switch' with
# recovery_path='mxfp8_backward'), as 'nvfp4_backward' is for NVFP4.
BACKWARD_PATH = path_lib.three_leg_path(quantize.bf16_matmul, mxfp8_matmul, mxfp8_matmul)

registry.register_path('mxfp8', registry.fixed_path(PATH))
registry.register_path('mxfp8_backward', registry.fixed_path(BACKWARD_PATH))
