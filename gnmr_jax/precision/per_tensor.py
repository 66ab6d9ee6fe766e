r"""The per-tensor recipes' path: one scale per operand tensor, each operand quantized once.

``per_tensor_path(..., scaling='tensor')`` scales from the tensors' current amaxes
(tensor_scaling.py), ``scaling='delayed'`` from the unit's amax history (delayed_scaling.py).
Either way a unit reduces and casts x, W and the output gradient g once a step:

* forward: :math:`y = (s_x s_W)\, Q(x) Q(W)`; residuals :math:`Q(x)^T` (the 8-bit codes,
  transposed as the weight gradient's GEMM takes them: half the bytes of a bf16 ``x``),
  :math:`s_x`, :math:`s_W` (and, delayed, the history row of g);
* backward: :math:`\partial x = (s_g s_W)\, Q(g) Q(W)^T`,
  :math:`\partial W = (s_x s_g)\, Q(x)^T Q(g)`, with :math:`Q(W)` recast from ``W`` at the
  saved :math:`s_W` (the same codes, no reduction).

Every GEMM takes both operands contracting their last axis (cuBLASLt's fp8 layout), so the
transposed codes are made with the codes, in the fusion that produces the operand. The path is
also split (``path.Hoisted``): a routed dot quantizes outside its ``lax.cond`` and the cond
chooses only the GEMMs. Given a history, each leg reports what it observed: the amax the
current scale came from ('tensor'), or the one read from the codes ('delayed').
"""

from __future__ import annotations

import jax.numpy as jnp

from gnmr_jax.precision import amax_history
from gnmr_jax.precision import delayed_scaling
from gnmr_jax.precision import explicit_sharding
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import tensor_scaling

SCALINGS = ('tensor', 'delayed')


def per_tensor_path(activation_dtype, weight_dtype, gradient_dtype, *, scaling: str,
                    power_of_two: bool = True) -> path_lib.Path:
  """A ``Path`` scaling each operand tensor as a whole (module docstring).

  Args:
    activation_dtype: codes of ``x`` (int8, float8_e4m3fn).
    weight_dtype: codes of ``W``.
    gradient_dtype: codes of the output gradient (int8, float8_e5m2).
    scaling: 'tensor' (current scales) or 'delayed' (from the unit's history: the path then
      ``takes_history``; powers of two always).
    power_of_two: 'tensor' only: round the scales up to powers of two (fp8: the bf16 scale
      folds into the GEMM exactly).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gnmr_jax.precision import path_dot
    >>> dot = path_dot(per_tensor_path(jnp.int8, jnp.int8, jnp.int8, scaling='tensor',
    ...                                power_of_two=False))
    >>> y, vjp = jax.vjp(dot, jnp.full((2, 4), 0.5), jnp.ones((4, 3)))
    >>> y.tolist()[0], vjp(jnp.ones((2, 3)))[1].tolist()[0]
    ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
  """
  if scaling not in SCALINGS:
    raise ValueError(f'per_tensor_path: scaling must be one of {SCALINGS}, got {scaling!r}.')
  delayed = scaling == 'delayed'

  def scale_of(tensor, history_row, dtype):
    """(scale, the amax it came from or None when the codes will tell)."""
    if delayed:
      return delayed_scaling.history_scale(history_row, dtype), None
    amax = amax_history.amax(tensor)
    return tensor_scaling.scale_from_amax(amax, dtype, power_of_two), amax

  def observed(codes, scale, amax):
    return amax if amax is not None else delayed_scaling.observe_codes(codes, scale)

  def quantize_inputs(x, kernel, history):
    rows = history if delayed else (None, None, None)
    x_scale, x_amax = scale_of(x, rows[0], activation_dtype)
    kernel_scale, kernel_amax = scale_of(kernel, rows[1], weight_dtype)
    x_codes = tensor_scaling.codes(x, x_scale, activation_dtype)
    kernel_codes_t = tensor_scaling.codes(kernel.T, kernel_scale, weight_dtype)
    # W's amax from its float32 master either way (a weight is small beside the activations)
    seen = jnp.stack([observed(x_codes, x_scale, x_amax),
                      amax_history.amax(kernel) if kernel_amax is None else kernel_amax])
    gradient_row = history[2] if delayed else None
    return (x_codes, x_codes.T, kernel_codes_t, x_scale, kernel_scale, gradient_row), seen

  def forward_from_codes(operands, out_dtype):
    x_codes, x_codes_t, kernel_codes_t, x_scale, kernel_scale, gradient_row = operands
    y = tensor_scaling.scaled_matmul(x_codes, kernel_codes_t, x_scale * kernel_scale,
                                     out_dtype, rhs_transposed=True)
    return y, (x_codes_t, x_scale, kernel_scale, gradient_row)

  def quantize_gradient(g, gradient_row):
    g_scale, g_amax = scale_of(g, gradient_row, gradient_dtype)
    g_codes = tensor_scaling.codes(g, g_scale, gradient_dtype)
    return (g_codes, g_codes.T, g_scale), observed(g_codes, g_scale, g_amax)

  def backward_from_codes(residuals, x, kernel, g_operands, dx_dtype):
    x_codes_t, x_scale, kernel_scale, _ = residuals
    g_codes, g_codes_t, g_scale = g_operands
    kernel_codes = tensor_scaling.codes(kernel, kernel_scale, weight_dtype)
    dx = tensor_scaling.scaled_matmul(g_codes, kernel_codes, g_scale * kernel_scale, dx_dtype,
                                      explicit_sharding.out_sharding(x), rhs_transposed=True)
    dkernel = tensor_scaling.scaled_matmul(x_codes_t, g_codes_t, x_scale * g_scale,
                                           kernel.dtype, explicit_sharding.out_sharding(kernel),
                                           rhs_transposed=True)
    return dx, dkernel

  def forward(x, kernel, history=None):
    operands, seen = quantize_inputs(x, kernel, history)
    y, residuals = forward_from_codes(operands, x.dtype)
    return (y, residuals, seen) if delayed else (y, residuals)

  def backward(residuals, x, kernel, g):
    g_operands, seen = quantize_gradient(g, residuals[3])
    dx, dkernel = backward_from_codes(residuals, x, kernel, g_operands, g.dtype)
    return (dx, dkernel, seen) if delayed else (dx, dkernel)

  hoisted = path_lib.Hoisted(
      quantize_inputs=quantize_inputs, forward=forward_from_codes,
      quantize_gradient=lambda g, history: quantize_gradient(g, history[2] if delayed else None),
      backward=backward_from_codes)
  return path_lib.Path(forward=forward, backward=backward, saves_input=False,
                       takes_history=delayed, hoisted=hoisted)


E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_TENSOR = per_tensor_path(E4M3, E4M3, E5M2, scaling='tensor', power_of_two=True)
INT8_TENSOR = per_tensor_path(jnp.int8, jnp.int8, jnp.int8, scaling='tensor', power_of_two=False)
FP8_DELAYED = per_tensor_path(*delayed_scaling.FORMATS, scaling='delayed')
