r"""Delayed per-tensor scaling: scales from the unit's amax history, as Transformer Engine does.

Each operand's scale comes from the largest amax its history holds (amax_history.py):
:math:`s = 2^{\lceil \log_2(\max_h a_h / q_{max}) \rceil}` (a power of two, so it folds
exactly into the GEMM, as in tensor_scaling.py). The scale does not depend on the tensor it
scales, so the cast to 8 bits needs no pass of its own: XLA fuses it into the fusion that
produces the operand (the norm, the SwiGLU product, the activation gradient), which then writes
8-bit codes and no bf16 tensor. The amax this step observes is read from those codes (1 byte
an element, not the producer again): :math:`a = s \max|q|`, doubled when a code saturated
(the tensor outgrew its scale; its true amax is unknown but larger), so a jump past the
history costs a few saturated steps while the scale doubles, as dynamic loss scaling grows;
all codes 0 (an underflow) records an upper bound of the true amax, so the next scale brings
the tensor into range at once. An empty history row (the first step) scales by 1, as
Transformer Engine's initial scale does: an output gradient far below 1 then underflows for
that one step (its weight gradient is 0) and is in range from the next. The history's update
rides in the backward pass (path.path_dot), the train step keeps the next history.

Numerics: a saturated step clips the outgrowing values to the largest code
(``amax_history.overflow`` flags the jump), which current scaling never does and why the 'row'
recipe stays the precise one. fp8 only: a power-of-two scale puts the history's amax in the
top binade of an fp8 format at no cost in precision (its spacing is relative), while an int8
grid would lose a bit; and the saturation test (the largest code reached) would fire on every
step at int8's exact absmax scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gnmr_jax.precision import amax_history
from gnmr_jax.precision import explicit_sharding
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import quantize
from gnmr_jax.precision import tensor_scaling


def history_scale(history_row: jax.Array, dtype) -> jax.Array:
  """float32[] power-of-two scale for ``dtype`` codes from one history row (1 when empty)."""
  amax = amax_history.history_amax(history_row)
  scale = tensor_scaling.power_of_two_scale(amax / quantize.MAX_VALUE[jnp.dtype(dtype)])
  return jnp.where(amax > 0, scale, 1.0)


# The observed amax of a saturated tensor: its scale's range times this (the scale doubles).
SATURATION_GROWTH = 2.0


def observe_codes(codes: jax.Array, scale: jax.Array) -> jax.Array:
  """float32[] amax this step observed of the tensor behind ``codes`` (module docstring).

  The largest code times the scale, exact up to the code's rounding; doubled when it is the
  format's largest code (saturated: the true amax is larger); half the smallest positive code
  when every code is 0 (underflow, e.g. an output gradient at an empty history's scale of 1:
  the true amax is below that, so the next scale maps it into range without saturating).

  Args:
    codes: the tensor's 8-bit codes at ``scale``.
    scale: float32[] its scale.
  """
  if jnp.issubdtype(codes.dtype, jnp.integer):
    top, smallest = quantize.MAX_VALUE[jnp.dtype(codes.dtype)], 1.0
  else:
    top, smallest = float(jnp.finfo(codes.dtype).max), float(
        jnp.finfo(codes.dtype).smallest_subnormal)
  largest = jnp.max(jnp.abs(codes.astype(jnp.float32)))
  grow = jnp.where(largest >= top, SATURATION_GROWTH, 1.0)
  underflow_bound = smallest / 2
  return jnp.where(largest > 0, largest * grow, underflow_bound) * scale


def delayed_path(activation_dtype, weight_dtype, gradient_dtype) -> path_lib.Path:
  """A ``Path`` that takes the unit's history and scales every operand from it.

  Residuals: the codes of ``x`` (not ``x``; transposed, as the weight gradient's GEMM takes
  them), the two forward scales and the history row of the gradient. ``W``'s codes are recast in the backward at the saved scale; its amax is read
  from the float32 master (a weight is small beside the activations).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gnmr_jax.precision import amax_history, path_dot
    >>> dot = path_dot(delayed_path(jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2))
    >>> history = amax_history.init(4).at[:, 0].set(jnp.array([1.0, 1.0, 4.0]))
    >>> y, vjp = jax.vjp(dot, jnp.full((2, 4), 0.5), jnp.ones((4, 3)), history)
    >>> y.tolist()[0], vjp(jnp.ones((2, 3)))[2][:, :2].tolist()
    ([2.0, 2.0, 2.0], [[0.5, 1.0], [1.0, 1.0], [1.0, 4.0]])
  """

  # The codes are laid out as the fp8 GEMMs take them (both operands contracting their last
  # axis): x's and W's transposed codes are made with the codes, where XLA fuses them into the
  # producer; a routed dot makes them outside its conditional too (path.Hoisted).
  def quantize_inputs(x, kernel, history):
    x_scale = history_scale(history[0], activation_dtype)
    kernel_scale = history_scale(history[1], weight_dtype)
    x_codes = tensor_scaling.codes(x, x_scale, activation_dtype)
    kernel_codes_t = tensor_scaling.codes(kernel.T, kernel_scale, weight_dtype)
    observed = jnp.stack([observe_codes(x_codes, x_scale), amax_history.amax(kernel)])
    return (x_codes, x_codes.T, kernel_codes_t, x_scale, kernel_scale, history[2]), observed

  def forward_from_codes(operands, out_dtype):
    x_codes, x_codes_t, kernel_codes_t, x_scale, kernel_scale, gradient_row = operands
    y = tensor_scaling.scaled_matmul(x_codes, kernel_codes_t, x_scale * kernel_scale,
                                     out_dtype, rhs_transposed=True)
    return y, (x_codes_t, x_scale, kernel_scale, gradient_row)

  def quantize_gradient(g, gradient_row):
    g_scale = history_scale(gradient_row, gradient_dtype)
    g_codes = tensor_scaling.codes(g, g_scale, gradient_dtype)
    return (g_codes, g_codes.T, g_scale), observe_codes(g_codes, g_scale)

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

  def forward(x, kernel, history):
    operands, observed = quantize_inputs(x, kernel, history)
    y, residuals = forward_from_codes(operands, x.dtype)
    return y, residuals, observed

  def backward(residuals, x, kernel, g):
    g_operands, observed = quantize_gradient(g, residuals[3])
    return backward_from_codes(residuals, x, kernel, g_operands, g.dtype) + (observed,)

  hoisted = path_lib.Hoisted(
      quantize_inputs=quantize_inputs, forward=forward_from_codes,
      quantize_gradient=lambda g, history: quantize_gradient(g, history[2]),
      backward=backward_from_codes)
  return path_lib.Path(forward=forward, backward=backward, saves_input=False,
                       takes_history=True, hoisted=hoisted)


FP8_PATH = delayed_path(tensor_scaling.E4M3, tensor_scaling.E4M3, tensor_scaling.E5M2)
