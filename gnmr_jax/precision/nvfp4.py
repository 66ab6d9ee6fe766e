r"""The NVFP4 path: E2M1 values in 1 x 16 blocks with E4M3 block scales (microscaling.py).

All three matmuls quantize both operands along their own contracting axis,
re-quantizing the saved full-precision ``x`` and ``W`` for the backward (as
NVIDIA's NVFP4 recipe does): the forward rounds to nearest; the backward rounds
the incoming gradient ``g`` stochastically (each leg with its own noise, keyed
by ``g``'s block scales) and ``W^T`` / ``x^T`` to nearest. Options (precision config):
``nvfp4_forward_only`` runs both backward matmuls in bf16, the recovery
precision; ``nvfp4_gradient_rounding='nearest'`` rounds ``g`` to nearest too.
The path ``'nvfp4_backward'`` is the converse (the forward in bf16, both backward
matmuls in NVFP4): the recovery path of NVIDIA's forward-only late switch, which
moves the forward to BF16 for the last part of training and keeps the backward in FP4.
Emulated by default: the block-scaled values go into a bf16 x bf16 -> float32
``dot_general`` and the two per-tensor scales multiply its result. With
``microscaling_impl`` 'native' (or 'auto' on a Blackwell GPU) the same codes and scales go
into one native block-scaled GEMM instead (native_microscaling.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from gnmr_jax.precision import explicit_sharding, microscaling, native_microscaling, quantize
from gnmr_jax.precision import registry
from gnmr_jax.precision import path as path_lib

# Leg constants mixed into the gradient's noise seed: the two backward legs draw
# independent noise for the same g.
_DLHS_SALT, _DRHS_SALT = 1, 2


def nvfp4_matmul(lhs, rhs, out_dtype, out_sharding=None, *, lhs_salt=None, rhs_salt=None):
  r""":math:`Q(a)\,Q(b)` for [M, C] x [C, N], both quantized in 1 x 16 blocks along C.

  Args:
    lhs: [M, C]; ``lhs_salt``: None (round to nearest) or an int (stochastic,
      noise keyed by the operand's block scales and the salt).
    rhs: [C, N]; ``rhs_salt`` likewise.
    out_dtype: the result's dtype.
    out_sharding: the result's sharding under an explicit-axis mesh, else None.

  Returns:
    [M, N] of ``out_dtype``: the float32 sum of bf16 block-scaled products times
    both tensor scales.
  """
  lhs_values, lhs_scale = microscaling.nvfp4_quantize(lhs, 1, lhs_salt)
  rhs_values, rhs_scale = microscaling.nvfp4_quantize(rhs, 0, rhs_salt)
  acc = lax.dot_general(lhs_values, rhs_values, quantize.MATMUL_DIMS,
                        preferred_element_type=jnp.float32,
                        **explicit_sharding.dot_kwargs(out_sharding))
  return (acc * (lhs_scale * rhs_scale)).astype(out_dtype)


def _dlhs(g, kernel_t, out_dtype, out_sharding=None, *, matmul, gradient_rounding):
  return matmul(g, kernel_t, out_dtype, out_sharding,
                lhs_salt=_gradient_salt(_DLHS_SALT, gradient_rounding))


def _drhs(x_t, g, out_dtype, out_sharding=None, *, matmul, gradient_rounding):
  return matmul(x_t, g, out_dtype, out_sharding,
                rhs_salt=_gradient_salt(_DRHS_SALT, gradient_rounding))


def _gradient_salt(salt, gradient_rounding):
  return salt if gradient_rounding == 'stochastic' else None


def nvfp4_path(forward_only: bool = False, gradient_rounding: str = 'stochastic',
               backward_only: bool = False, native: bool = False) -> path_lib.Path:
  r"""The NVFP4 ``Path``: :math:`y = Q_{RN}(x)\,Q_{RN}(W)`,
  :math:`\partial x = Q_{SR}(g)\,Q_{RN}(W^T)`, :math:`\partial W = Q_{RN}(x^T)\,Q_{SR}(g)`.

  Args:
    forward_only: True runs :math:`\partial x` and :math:`\partial W` on bf16
      operands (float32 accumulation) instead.
    gradient_rounding: 'stochastic' or 'nearest', for ``g`` in the backward.
    backward_only: True runs the forward on bf16 operands (float32 accumulation)
      and both backward matmuls in NVFP4 (the converse of ``forward_only``).
    native: True multiplies the same codes and scales in one native block-scaled GEMM
      (``native_microscaling.py``; Blackwell GPUs only) instead of the emulating bf16 dot.

  Returns:
    A ``Path`` (residuals: x and the kernel, unquantized). One object per argument
    tuple.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gnmr_jax.precision import path_dot
    >>> dot = path_dot(nvfp4_path())
    >>> x, w = jnp.ones((4, 16)), jnp.full((16, 3), 0.5)
    >>> dot(x, w).tolist()[0], jax.grad(lambda w: dot(x, w).sum())(w)[0].tolist()
    ([8.0, 8.0, 8.0], [4.0, 4.0, 4.0])
  """
  for name, value in (('forward_only', forward_only), ('backward_only', backward_only),
                      ('native', native)):
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f'nvfp4_path: {name} must be a bool, got {value!r}.')
  if forward_only and backward_only:
    raise ValueError('nvfp4_path: forward_only and backward_only exclude each other (both '
                     'would be the bf16 path).')
  if gradient_rounding not in microscaling.ROUNDINGS:
    raise ValueError(f'nvfp4_path: gradient_rounding must be one of '
                     f'{microscaling.ROUNDINGS}, got {gradient_rounding!r}.')
  return _nvfp4_path(bool(forward_only), gradient_rounding, bool(backward_only), bool(native))


@functools.lru_cache(maxsize=None)
def _nvfp4_path(forward_only, gradient_rounding, backward_only, native):
  matmul = native_microscaling.nvfp4_matmul if native else nvfp4_matmul
  forward = lambda x, kernel, out_dtype: matmul(x, kernel, out_dtype)
  if forward_only:
    return path_lib.three_leg_path(forward, quantize.bf16_matmul, quantize.bf16_matmul)
  legs = dict(matmul=matmul, gradient_rounding=gradient_rounding)
  return path_lib.three_leg_path(
      quantize.bf16_matmul if backward_only else forward,
      functools.partial(_dlhs, **legs), functools.partial(_drhs, **legs))


def build(config, role):
  """Registry builder: ``nvfp4_forward_only``, ``nvfp4_gradient_rounding`` and
  ``microscaling_impl``, both roles."""
  del role
  return nvfp4_path(bool(config.nvfp4_forward_only), config.nvfp4_gradient_rounding,
                    native=native_microscaling.uses_native(config))


def build_backward(config, role):
  """Registry builder of ``'nvfp4_backward'``: bf16 forward, NVFP4 backward with
  ``nvfp4_gradient_rounding`` and ``microscaling_impl``, both roles."""
  del role
  return nvfp4_path(gradient_rounding=config.nvfp4_gradient_rounding, backward_only=True,
                    native=native_microscaling.uses_native(config))


registry.register_path('nvfp4', build)
registry.register_path('nvfp4_backward', build_backward)
