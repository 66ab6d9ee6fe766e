r"""Delayed per-tensor scaling: scales from the unit's amax history, as Transformer Engine does.

Its scale and observation rules; the path is per_tensor.per_tensor_path(..., scaling='delayed').

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

Numerics: a saturated step clips the outgrowing values to the largest code (:func:`saturation` tells
which steps did), which current scaling never does and why the 'row' recipe stays the precise one.
The power-of-two scale leaves headroom (up to 2x above the history's amax), so an amax that outgrows
its history saturates only past that headroom. fp8 only: a power-of-two scale puts the history's
amax in the top binade of an fp8 format at no cost in precision (its spacing is relative), while an
int8 grid would lose a bit; and the saturation test (the largest code reached) would fire on every
step at int8's exact absmax scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gnmr_jax.precision import amax_history
from gnmr_jax.precision import quantize
from gnmr_jax.precision import tensor_scaling


def history_scale(history_row: jax.Array, dtype) -> jax.Array:
  """float32[] power-of-two scale for ``dtype`` codes from one history row (1 when empty)."""
  amax = amax_history.history_amax(history_row)
  scale = tensor_scaling.power_of_two_scale(amax / quantize.MAX_VALUE[jnp.dtype(dtype)])
  return jnp.where(amax > 0, scale, 1.0)


# The formats of the fp8 recipe's history rows x, W and g (per_tensor.FP8_DELAYED).
FORMATS = (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2)


def saturation(previous: jax.Array, current: jax.Array, formats=FORMATS) -> jax.Array:
  r"""float32[3]: per row (x, W, g), this step's amax over the largest magnitude its scale
  represented, :math:`a_t / (q_{max} s_t)` with :math:`s_t` from ``previous``: at most 1 in
  range, above 1 when codes saturated (an x or g observation read from saturated codes is 2:
  :data:`SATURATION_GROWTH`; W's is its exact amax), 0 for a row with no observation (a
  non-finite step, settled).

  Args:
    previous: the history the step scaled from, float32[3, H].
    current: the history after the step (``amax_history.push`` then ``settle``), whose column
      0 holds what the step observed.
    formats: the code formats of the rows.

  Example:
    >>> import jax.numpy as jnp
    >>> previous = jnp.zeros((3, 4)).at[:, 0].set(jnp.array([300.0, 448.0, 57344.0]))
    >>> current = jnp.zeros((3, 4)).at[:, 0].set(jnp.array([224.0, 448.0, 2 * 57344.0]))
    >>> saturation(previous, current).tolist()  # scales 1: x in range, W at its top, g saturated
    [0.5, 1.0, 2.0]
  """
  limits = jnp.stack([history_scale(previous[row], fmt) * quantize.MAX_VALUE[jnp.dtype(fmt)]
                      for row, fmt in enumerate(formats)])
  return current[:, 0] / limits


# The observed amax of a saturated tensor: its scale's range times this (the scale doubles).
SATURATION_GROWTH = 2.0


def observe_codes(codes: jax.Array, scale: jax.Array) -> jax.Array:
  """float32[] amax this step observed of the tensor behind ``codes`` (module docstring).

  The largest code times the scale, exact up to the code's rounding; doubled when it is the
  format's largest code (saturated: the true amax is larger); half the smallest positive code
  when every code is 0 (underflow, e.g. an output gradient at an empty history's scale of 1:
  the true amax is below that, so the next scale maps it into range without saturating); +inf
  when a code is NaN.

  Args:
    codes: the tensor's 8-bit codes at ``scale``.
    scale: float32[] its scale.
  """
  if jnp.issubdtype(codes.dtype, jnp.integer):
    top, smallest = quantize.MAX_VALUE[jnp.dtype(codes.dtype)], 1.0
  else:
    top, smallest = float(jnp.finfo(codes.dtype).max), float(
        jnp.finfo(codes.dtype).smallest_subnormal)
  values = codes.astype(jnp.float32)
  # A NaN code (a NaN in the tensor) reads as +inf, which the step settles as no observation
  # (amax_history.settle): a max reduction need not propagate NaN (XLA CPU's fast min/max
  # drops it, so the NaN step read as an underflow), an infinity it keeps. Elementwise, so it
  # fuses into the reduction: no extra pass over the codes.
  largest = jnp.max(jnp.where(jnp.isnan(values), jnp.inf, jnp.abs(values)))
  grow = jnp.where(largest >= top, SATURATION_GROWTH, 1.0)
  underflow_bound = smallest / 2
  return jnp.where(largest > 0, largest * grow, underflow_bound) * scale
