r"""Per-tensor current scaling: one scale per operand tensor, each operand quantized once.

Its primitives (scales, codes, the scaled GEMM); the path is per_tensor.per_tensor_path.

The 'row' recipe (quantize.scaled_matmul) gives every leg its own per-row / per-column scales,
so a unit quantizes six operands per step (x and W forward, g and W^T for dx, x^T and g for
dW), each with an absmax reduction and a cast pass, and asks the GEMM for a float32 result that
another pass rescales. The 'tensor' recipe scales each tensor as a whole:

* forward: :math:`s_x = \max|x| / q_{max}`, :math:`s_W = \max|W| / q_{max}`,
  :math:`y = (s_x s_W)\, Q(x) Q(W)`; residuals :math:`Q(x)` (the 8-bit codes: half the bytes of
  a bf16 ``x``), :math:`s_x`, :math:`s_W`;
* backward: :math:`s_g = \max|g| / q_{max}` once,
  :math:`\partial x = (s_g s_W)\, Q(g) Q(W)^T`, :math:`\partial W = (s_x s_g)\, Q(x)^T Q(g)`,
  with :math:`Q(W)` recast from ``W`` at the saved :math:`s_W` (the same codes, no reduction)
  and :math:`Q(x)` the forward's codes.

So x, W and g are each reduced and cast once per step, and both uses of a tensor share its
codes (the transposed use is an 8-bit transpose). A scalar scale factors out of the whole
product; XLA's GPU GEMM rewriter folds it into the cuBLASLt fp8 call, which then writes the
bf16 result itself (no float32 [M, N] result, no rescale pass). For that the fp8 scales are
powers of two (:math:`s = 2^{\lceil \log_2(\max|x| / q_{max}) \rceil}`): a bf16 scale is then
exact, the product rounds once, and the largest code lands in (q_max / 2, q_max], which costs
an fp8 format nothing but range headroom (its spacing is relative). int8 keeps the exact absmax
scale (a power of two would cost up to one bit of a uniform grid); its int32 GEMM result is
rescaled in float32 (in the GEMM's output fusion on TPU, a fused pass on GPU).

Numerics: one outlier element coarsens its whole tensor (a per-row scale confines it to its
row), which is why the 'row' recipe stays as the precise one. Under explicit mesh axes the
scale's reduction is a cross-shard max (XLA inserts it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import explicit_sharding
from gnmr_jax.precision import quantize

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def tensor_scale(x: jax.Array, dtype, power_of_two: bool) -> jax.Array:
  r"""float32[] scale of ``x`` as a whole: :math:`\max|x| / q_{max}` (1 for an all-zero x).

  With ``power_of_two`` the scale is rounded up to a power of two (so every code stays within
  :math:`q_{max}`). A non-finite amax gives a non-finite scale: the codes and the result are
  then non-finite too, which the train step's non-finite guard sees.
  """
  return scale_from_amax(jnp.max(jnp.abs(x)).astype(jnp.float32), dtype, power_of_two)


def scale_from_amax(amax: jax.Array, dtype, power_of_two: bool) -> jax.Array:
  """``tensor_scale`` from the tensor's float32[] amax."""
  scale = amax / quantize.MAX_VALUE[jnp.dtype(dtype)]
  if power_of_two:
    scale = power_of_two_scale(scale)
  return jnp.where(amax == 0, 1.0, scale)  # a nan amax stays nan (an int8 cast would hide it)


def power_of_two_scale(scale: jax.Array) -> jax.Array:
  """The smallest power of two >= ``scale`` (> 0); 0, inf and nan pass through."""
  # frexp: scale = m 2^e, m in [0.5, 1), so 2^e >= scale > 2^(e-1) (exact; no log rounding).
  mantissa, exponent = jnp.frexp(scale)
  exact = (mantissa == 0.5) | ~jnp.isfinite(scale) | (scale == 0)
  return jnp.where(exact, scale, jnp.ldexp(jnp.ones_like(scale), exponent))


def codes(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """``x / scale`` rounded to ``dtype`` codes (nearest; clipped to the format's range)."""
  max_value = quantize.MAX_VALUE[jnp.dtype(dtype)]
  y = jnp.clip(x.astype(jnp.float32) / scale, -max_value, max_value)
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.round(y)
  return y.astype(dtype)


# [M, C] x [N, C] -> [M, N]: both operands contract their minor axis (cuBLASLt's fp8 "TN").
NT_DIMS = (((1,), (1,)), ((), ()))


def scaled_matmul(q_lhs: jax.Array, q_rhs: jax.Array, scale: jax.Array, out_dtype,
                  out_sharding=None, rhs_transposed: bool = False) -> jax.Array:
  """``scale * (q_lhs [M, C] @ q_rhs [C, N])`` from 8-bit codes, in ``out_dtype``.

  ``rhs_transposed``: ``q_rhs`` is given as [N, C] (both operands contract their last axis,
  the layout an fp8 GEMM takes, so a caller that has the transposed codes spares XLA a
  transpose where it cannot fuse one, inside a routed dot's conditional).

  fp8: the GEMM returns ``out_dtype`` when it is bf16 (float32 accumulation, one rounding; the
  scale must then be a power of two so that its bf16 multiply is exact), float32 otherwise.
  int8: int32 accumulation, rescaled in float32.
  """
  kwargs = explicit_sharding.dot_kwargs(out_sharding)
  dims = NT_DIMS if rhs_transposed else quantize.MATMUL_DIMS
  if jnp.issubdtype(q_lhs.dtype, jnp.integer):
    acc = lax.dot_general(q_lhs, q_rhs, dims, preferred_element_type=jnp.int32, **kwargs)
    return (acc.astype(jnp.float32) * scale).astype(out_dtype)
  result = jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32
  acc = lax.dot_general(q_lhs, q_rhs, dims, preferred_element_type=result, **kwargs)
  # The product of scalars stays in float32 until it meets the result (a power of two: exact).
  return (acc * scale.astype(result)).astype(out_dtype)
