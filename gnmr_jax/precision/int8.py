"""The int8 path: per-channel scaled int8 operands in all three matmuls (AQT-style).

This is the 'row' scaling (``PATH``); with the precision config's ``scaling='tensor'`` the
path is per_tensor.INT8_TENSOR (one scale per tensor).

Each leg quantizes its lhs per row and its rhs per column (one scale per
non-contracted index, so scales factor out of the sum), runs
``lax.dot_general(int8, int8, preferred_element_type=int32)`` and rescales.
This is the TPU low-cost path; it also runs on GPU and CPU.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import per_tensor, quantize, registry, scaling

_int8_matmul = functools.partial(quantize.scaled_matmul, lhs_dtype=jnp.int8,
                                 rhs_dtype=jnp.int8)


def _leg(lhs, rhs, out_dtype, out_sharding=None):
  return _int8_matmul(lhs, rhs, out_dtype=out_dtype, out_sharding=out_sharding)


PATH = path_lib.three_leg_path(_leg, _leg, _leg)
int8_dot = path_lib.path_dot(PATH)
int8_dot.__doc__ = r"""int8 dot with int8 forward, dlhs and drhs legs.

Forward :math:`y_{mn} = s^x_m s^W_n \sum_k q^x_{mk} q^W_{kn}` with
:math:`s^x_m = \max_k |x_{mk}|/127` (rows of the activation) and
:math:`s^W_n = \max_k |W_{kn}|/127` (columns of the weight). Backward:
:math:`\partial x = Q(g)\,Q(W^T)` and :math:`\partial W = Q(x^T)\,Q(g)`, each
quantized per row of its lhs and per column of its rhs, int32 accumulation.
Residuals: ``x`` and ``W`` as given.

Args:
  x: [M, K] activations.
  kernel: [K, N] weights.

Returns:
  [M, N] in ``x.dtype``.
"""


registry.register_path('int8', scaling.builder(
    'int8', {scaling.ROW.name: PATH, scaling.TENSOR.name: per_tensor.INT8_TENSOR}))
