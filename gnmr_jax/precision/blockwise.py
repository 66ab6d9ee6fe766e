"""DeepSeek-V3-style fine-grained quantization, simulated by quantize-dequantize.

Activations are scaled per 1 x B tile (B consecutive elements of the contraction
axis of one row) and weights per B x B block (B = 128 in DeepSeek-V3), each tile
or block rounded to a symmetric ``bits``-bit integer grid and dequantized; the
product of the dequantized operands is taken in float32 (HIGHEST precision). No
hardware has a 6-bit tile format, so this simulates the numerics, not the speed.
The backward legs use the same rule: lhs in 1 x B tiles along the contraction,
rhs in B x B blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import explicit_sharding, quantize, registry


def _pad_to(x: jax.Array, multiples: tuple[int, int]) -> jax.Array:
  pads = [(0, -size % m) for size, m in zip(x.shape, multiples)]
  return jnp.pad(x, pads)


def _qdq(x: jax.Array, scale: jax.Array, max_code: int) -> jax.Array:
  return jnp.clip(jnp.round(x / scale), -max_code, max_code) * scale


def qdq_tiles(x: jax.Array, bits: int, tile: int) -> jax.Array:
  r"""Quantize-dequantize [M, C] in 1 x ``tile`` tiles along C (float32 result).

  :math:`\hat{x} = s\,\mathrm{clip}(\mathrm{round}(x/s))`, :math:`s = \max_{tile}|x| / (2^{b-1}-1)`.
  """
  m, c = x.shape
  xp = _pad_to(x.astype(jnp.float32), (1, tile)).reshape(m, -1, tile)
  max_code = 2 ** (bits - 1) - 1
  y = _qdq(xp, quantize.absmax_scale(xp, 2, max_code), max_code)
  return y.reshape(m, -1)[:, :c]


def qdq_blocks(w: jax.Array, bits: int, block: int) -> jax.Array:
  """Quantize-dequantize [C, N] in ``block`` x ``block`` blocks (float32 result)."""
  c, n = w.shape
  wp = _pad_to(w.astype(jnp.float32), (block, block))
  wb = wp.reshape(wp.shape[0] // block, block, wp.shape[1] // block, block)
  max_code = 2 ** (bits - 1) - 1
  y = _qdq(wb, quantize.absmax_scale(wb, (1, 3), max_code), max_code)
  return y.reshape(wp.shape)[:c, :n]


def _keeping_sharding(qdq, x: jax.Array, bits: int, block: int) -> jax.Array:
  """``qdq(x, bits, block)``, typed with ``x``'s sharding under an explicit mesh.

  Tiles and blocks straddle shard boundaries (a 128-long tile over a batch axis
  split 8 ways), which explicit sharding types cannot express; the padding and
  reshapes therefore run under ``auto_axes``, where the partitioner moves data as
  it did before explicit meshes. This path simulates numerics, not speed.
  """
  sharding = explicit_sharding.out_sharding(x)
  if sharding is None:
    return qdq(x, bits, block)
  return jax.sharding.auto_axes(lambda a: qdq(a, bits, block), out_sharding=sharding)(x)


def _leg(lhs, rhs, out_dtype, out_sharding=None, *, bits, block):
  acc = lax.dot_general(_keeping_sharding(qdq_tiles, lhs, bits, block),
                        _keeping_sharding(qdq_blocks, rhs, bits, block),
                        quantize.MATMUL_DIMS, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32,
                        **explicit_sharding.dot_kwargs(out_sharding))
  return acc.astype(out_dtype)


def blockwise_path(bits: int, block: int = 128) -> path_lib.Path:
  r"""Blockwise-quantized dot: :math:`y = \hat{x}_{1\times B}\,\hat{W}_{B\times B}`.

  Backward: :math:`\partial x = \hat{g}_{1\times B}\,\widehat{W^T}_{B\times B}`,
  :math:`\partial W = \widehat{x^T}_{1\times B}\,\hat{g}_{B\times B}`.

  Args:
    bits: bits of the integer grid (2..8; the paper's recipe test uses 6 and 8).
    block: tile length / block side B.

  Returns:
    A ``Path`` (residuals: x and the kernel).
  """
  leg = functools.partial(_leg, bits=bits, block=block)
  return path_lib.three_leg_path(leg, leg, leg)


def make_blockwise_dot(bits: int, block: int = 128):
  """``dot(x [M,K], kernel [K,N])`` of ``blockwise_path(bits, block)``."""
  return path_lib.path_dot(blockwise_path(bits, block))


def build(config, role):
  """Registry builder: ``block_bits`` and ``block_size`` in both roles."""
  del role
  return blockwise_path(config.block_bits, config.block_size)


registry.register_path('blockwise', build)
