"""Quantization primitives shared by the precision paths.

Symmetric absmax quantization, scaled low-precision matmuls whose operands go
into ``lax.dot_general`` in their storage dtype (int8 or fp8), and the 4-bit
nibble planes used to store saved activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Contracts lhs axis 1 with rhs axis 0, no batch axes: [M, C] x [C, N] -> [M, N].
MATMUL_DIMS = (((1,), (0,)), ((), ()))

# Largest finite magnitude of each quantized storage dtype.
_MAX_VALUE = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),
}


def absmax_scale(x: jax.Array, axis, max_value: float) -> jax.Array:
  r"""Per-slice absmax scale :math:`s = \max|x| / q_{max}` (1 where the slice is 0).

  Args:
    x: array to quantize.
    axis: axis or axes reduced to one scale (kept as size-1 axes).
    max_value: largest representable code magnitude :math:`q_{max}`.

  Returns:
    float32 scale, broadcastable against ``x``.
  """
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
  return jnp.where(amax > 0, amax / max_value, 1.0)


def quantize(x: jax.Array, axis, dtype) -> tuple[jax.Array, jax.Array]:
  r"""Symmetric absmax quantization to ``dtype`` (int8, float8_e4m3fn or float8_e5m2).

  :math:`q = \mathrm{clip}(\mathrm{round}(x / s), -q_{max}, q_{max})`, rounding to
  the nearest integer for int8 and to the nearest fp8 value (ties to even) for fp8.

  Args:
    x: array to quantize.
    axis: axes sharing one scale (the contraction axis of a matmul operand).
    dtype: storage dtype.

  Returns:
    ``(q, scale)`` with ``x ~= q * scale``; ``scale`` is float32 with ``axis`` kept.
  """
  max_value = _MAX_VALUE[jnp.dtype(dtype)]
  scale = absmax_scale(x, axis, max_value)
  y = jnp.clip(x.astype(jnp.float32) / scale, -max_value, max_value)
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.round(y)
  return y.astype(dtype), scale


def scaled_matmul(lhs: jax.Array, rhs: jax.Array, lhs_dtype, rhs_dtype,
                  out_dtype) -> jax.Array:
  r"""Quantized 2-D matmul :math:`(q_a s_a)(q_b s_b)` with per-row/per-column scales.

  ``lhs`` [M, C] gets one scale per row and ``rhs`` [C, N] one per column, so the
  scales factor out of the contraction:
  :math:`y_{mn} = s_{a,m}\, s_{b,n} \sum_c q_{a,mc}\, q_{b,cn}`.
  The quantized arrays go into ``lax.dot_general`` as int8/fp8 operands (int32
  accumulation for int8, float32 for fp8), which is what lets XLA emit an
  int8/fp8 GEMM on GPU and TPU.

  Args:
    lhs: [M, C] float array.
    rhs: [C, N] float array.
    lhs_dtype: storage dtype of ``lhs`` codes.
    rhs_dtype: storage dtype of ``rhs`` codes.
    out_dtype: dtype of the result.

  Returns:
    [M, N] array of ``out_dtype``.
  """
  q_lhs, s_lhs = quantize(lhs, 1, lhs_dtype)
  q_rhs, s_rhs = quantize(rhs, 0, rhs_dtype)
  is_int = jnp.issubdtype(lhs_dtype, jnp.integer)
  acc = lax.dot_general(q_lhs, q_rhs, MATMUL_DIMS,
                        preferred_element_type=jnp.int32 if is_int else jnp.float32)
  return (acc.astype(jnp.float32) * s_lhs * s_rhs).astype(out_dtype)


def bf16_matmul(lhs: jax.Array, rhs: jax.Array, out_dtype) -> jax.Array:
  """[M, C] x [C, N] with bfloat16 operands and float32 accumulation."""
  acc = lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16),
                        MATMUL_DIMS, preferred_element_type=jnp.float32)
  return acc.astype(out_dtype)


# --- 4-bit nibble planes -------------------------------------------------------
# A k-bit code c in [-(2^(k-1)-1), 2^(k-1)-1] is stored offset-binary, u = c + 2^(k-1),
# split into ceil(k/4) nibbles; each nibble plane packs two neighbouring elements of
# the last axis per byte, so every plane is uint8[..., ceil(K/2)] whatever k is. The
# common plane shape is what lets lax.cond merge the residuals of a 4-bit and an
# 8-bit branch instead of storing both (see saved_activation.py).


def pack_nibbles(nibbles: jax.Array) -> jax.Array:
  """Packs uint8 values < 16 pairwise along the last axis: [..., K] -> [..., ceil(K/2)]."""
  if nibbles.shape[-1] % 2:
    nibbles = jnp.pad(nibbles, [(0, 0)] * (nibbles.ndim - 1) + [(0, 1)])
  pairs = nibbles.reshape(nibbles.shape[:-1] + (-1, 2))
  return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: jax.Array, size: int) -> jax.Array:
  """Inverse of ``pack_nibbles``: [..., ceil(K/2)] uint8 -> [..., size] uint8."""
  pairs = jnp.stack([packed & 15, packed >> 4], axis=-1)
  return pairs.reshape(packed.shape[:-1] + (-1,))[..., :size]


def codes_to_planes(codes: jax.Array, bits: int) -> tuple[jax.Array, ...]:
  """Stores signed ``bits``-bit integer codes as ceil(bits/4) packed nibble planes."""
  offset = (codes.astype(jnp.int32) + (1 << (bits - 1))).astype(jnp.uint32)
  num_planes = -(-bits // 4)
  return tuple(pack_nibbles(((offset >> (4 * p)) & 15).astype(jnp.uint8))
               for p in range(num_planes))


def planes_to_codes(planes: tuple[jax.Array, ...], bits: int, size: int) -> jax.Array:
  """Inverse of ``codes_to_planes``: int32 codes of the last-axis ``size``."""
  offset = jnp.zeros(planes[0].shape[:-1] + (size,), jnp.int32)
  for p, plane in enumerate(planes):
    offset = offset | (unpack_nibbles(plane, size).astype(jnp.int32) << (4 * p))
  return offset - (1 << (bits - 1))
