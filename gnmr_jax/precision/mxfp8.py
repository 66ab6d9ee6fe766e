r"""The MXFP8 path: E4M3 values in 1 x 32 blocks with E8M0 scales rounded up (microscaling.py).

All three matmuls quantize both operands along their own contracting axis
(forward, dlhs, drhs), round to nearest, re-quantizing the saved ``x`` and ``W``
for the backward, as NVIDIA's MXFP8 recipe does (E4M3 for every tensor,
gradients included). Emulated by default: the block-scaled values, exact in bfloat16, go
into a bf16 x bf16 -> float32 ``dot_general``; with ``microscaling_impl`` 'native' (or
'auto' on a Blackwell GPU) the same codes and scales go into one native block-scaled GEMM
(native_microscaling.py). The path
``'mxfp8_backward'`` runs the forward in bf16 and the backward in MXFP8 (the
recovery path of a forward-only late switch).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import explicit_sharding, microscaling, native_microscaling, quantize
from gnmr_jax.precision import registry
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


def mxfp8_path(native: bool = False, backward_only: bool = False) -> path_lib.Path:
  r"""The MXFP8 ``Path`` (``native``: one native block-scaled GEMM per leg, Blackwell only;
  ``backward_only``: the forward in bf16).

  Example:
    >>> mxfp8_path() is PATH, mxfp8_path(backward_only=True) is BACKWARD_PATH
    (True, True)
  """
  return _PATHS[bool(native), bool(backward_only)]


def _make_path(native, backward_only):
  matmul = native_microscaling.mxfp8_matmul if native else mxfp8_matmul
  forward = (quantize.bf16_matmul if backward_only
             else lambda x, kernel, out_dtype: matmul(x, kernel, out_dtype))
  return path_lib.three_leg_path(forward, matmul, matmul)


_PATHS = {(native, backward_only): _make_path(native, backward_only)
          for native in (False, True) for backward_only in (False, True)}
PATH = _PATHS[False, False]
# The converse of a forward-only MXFP8 path: the forward in bf16, both backward matmuls in MXFP8,
# the recovery path of a forward-only late switch ('late_switch' with
# recovery_path='mxfp8_backward'), as 'nvfp4_backward' is for NVFP4.
BACKWARD_PATH = _PATHS[False, True]
mxfp8_dot = path_lib.path_dot(PATH)
mxfp8_dot.__doc__ = r"""MXFP8 dot: :math:`y = Q(x)\,Q(W)`, :math:`\partial x = Q(g)\,Q(W^T)`,
:math:`\partial W = Q(x^T)\,Q(g)`, each Q in 1 x 32 blocks along the contraction.

Args:
  x: [M, K] activations.
  kernel: [K, N] weights.

Returns:
  [M, N] in ``x.dtype``.
"""


def _builder(backward_only):
  def build(config, role):
    del role
    return mxfp8_path(native_microscaling.uses_native(config), backward_only)
  return build


registry.register_path('mxfp8', _builder(False))
registry.register_path('mxfp8_backward', _builder(True))
