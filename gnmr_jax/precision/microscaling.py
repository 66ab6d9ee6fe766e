r"""Block-scaled microscaling quantizers: NVFP4 and MXFP8, emulated in float32.

Both formats cut each matmul operand into 1 x B blocks along the matmul's
contracting axis and give every block its own scale; a value is
:math:`\hat{x} = c \cdot s_b \cdot s_t` with a low-bit code :math:`c`, a
block scale :math:`s_b` and (NVFP4 only) a per-tensor float32 scale
:math:`s_t`. Below, :math:`\otimes, \oslash` are float32 operations and
:math:`a_b = \max_b |x|`, :math:`a_t = \max |x|`.

* **NVFP4** (B = 16): codes E2M1, :math:`|c| \in \{0, 0.5, 1, 1.5, 2, 3, 4, 6\}`;
  block scales E4M3, rounded to nearest; per-tensor scale by current scaling,
  :math:`s_t = a_t \otimes \mathrm{fl}(1 / (6 \cdot 448))` (1 if :math:`a_t = 0`);
  :math:`s_b = \mathrm{RN}_{E4M3}(\mathrm{clip}(a_b \otimes (1 \oslash (s_t \otimes 6)), 0, 448))`;
  :math:`c = \mathrm{round}_{E2M1}(x \otimes r_b)` with the encode scale
  :math:`r_b = 1 \oslash (s_b \otimes s_t)` (0 if :math:`s_b \otimes s_t = 0`).
  Multiplying by reciprocal (encode) scales is what NVFP4 kernels do, and what
  XLA would turn a division by a block's scale into anyway.
* **MXFP8** (B = 32): codes E4M3, rounded to nearest (ties to even); block scales
  E8M0 rounded *up*, :math:`s_b = 2^{e_b}`, :math:`e_b = \lceil \log_2(a_b / 448) \rceil`
  (exact, from the bits of :math:`a_b`), so a block's maximum never saturates;
  :math:`c = \mathrm{RN}_{E4M3}(x\,2^{-e_b})` (exact scaling). The smallest E8M0
  scale, 2^-127, is a float32 subnormal, which XLA:CPU flushes to zero: scales
  are clamped to [2^-126, 2^127].

**Rounding is arithmetic**, without tables, gathers or conversions: E2M1's
spacing is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6], so
:math:`c = \mathrm{round}(|y| / h)\,h` with :math:`h` the spacing of
:math:`|y|`'s interval (|y| above 6 saturates); E4M3 rounds to a multiple of
:math:`2^{\max(\lfloor \log_2 |y| \rfloor, -6) - 3}` by adding and subtracting
that quantum times 2^23. Every step is exact but the final rounding (ties to
even). Stochastic rounding takes :math:`\lfloor |y| / h \rfloor + [u < \mathrm{frac}(|y| / h)]`
steps with :math:`u \sim U[0, 1)` on a 2^-24 grid: unbiased, :math:`E[c] = y`
inside the grid.

**Where the randomness comes from.** A path's legs take no PRNG key, so
stochastic rounding derives its noise from the tensor it rounds: the bits of
its E4M3 block scales, each hashed with its block index and summed (wrapping
uint32), then mixed with a leg-specific constant, give a 32-bit seed; element
``i`` (of the padded, blocked operand) gets the uniform
``lowbias32(i * 0x9E3779B9 + seed) >> 8`` (C. Wellons' integer hash). The same
tensor always gets the same noise, so a run is reproducible and a resumed run
bit-exact with no key in the train state; another tensor (the next step's
gradient, another layer's, the other backward leg) gets another stream.
Why the block scales and not the raw float32 bits: two programs that compute
the same gradient up to float32 reordering (a scanned and an unrolled model, a
routed unit and a static one) differ in a few last bits, which would redraw all
of a raw-bits hash's noise; a quantized scale moves only when a block maximum
crosses an E4M3 rounding boundary. (Degenerate tensors whose block scales all
coincide, e.g. all 448, share one noise pattern; the noise stays independent
of each element's value.) Why a counter hash and not ``jax.random``: threefry
cost 9x as much per element on CPU (1.3 ms against 0.15 ms for 360k
elements), which alone took the NVFP4 step past 2x the bf16 step; rounding
noise needs uniformity, not cryptographic strength.

**Shapes.** A contracting axis that is not a multiple of B is zero-padded to one
inside the quantizer and the padding sliced off again: zeros change neither a
block maximum nor the dot. All-zero blocks and tensors quantize to exact zeros.
**Non-finite values** propagate: a NaN or Inf makes its NVFP4 tensor's scale,
hence every value of that tensor, non-finite (its MXFP8 block's, hence that
block's); nothing is zeroed or clipped to a finite value. Float32 subnormals
(and NVFP4 tensor maxima below ~3e-35, whose scale would be one) flush to zero
on CPU, as XLA does.

**Emulation.** The quantizers return the block-scaled values
:math:`c \cdot s_b` (NVFP4: at most 2 + 4 significant bits; MXFP8: 4 bits times a
power of two), exact in bfloat16, and the NVFP4 tensor scale separately; the
paths multiply them in a bf16 x bf16 -> float32 ``dot_general``, as the bf16
recovery path does, and apply the two tensor scales to the float32 result, as a
block-scaled GEMM does. The numerics are the formats'; the speed is bf16's.
**Native**: ``nvfp4_codes`` / ``mxfp8_codes`` give the codes and scales before they
are multiplied; native_microscaling.py stores them in the formats' dtypes and multiplies
them in a block-scaled GEMM (Blackwell GPUs), the same values up to the order of the
float32 sums. ``jax.nn.scaled_dot_general`` is not used: its NVFP4 global scale is a
constant (1 by default, so small tensors underflow and large ones saturate), its NVFP4
backward is unquantized, and its MXFP8 quantizer turns all-zero blocks into NaN on a
host that flushes subnormals (experiments/microscaling_semantics.py measures each).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from gnmr_jax.precision import explicit_sharding

NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ROUNDINGS = ('nearest', 'stochastic')
# fl(1 / (6 * 448)): the NVFP4 tensor scale is a_t times this.
_INV_NVFP4_RANGE = np.float32(1.0 / (E2M1_MAX * E4M3_MAX))
# Clamp of the E8M0 exponent (see the module docstring).
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -126, 127
_GOLDEN = 0x9E3779B9


def _blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """x with ``axis`` zero-padded to a multiple of ``block`` and split into
  (num_blocks, block): the block axis is ``axis + 1``."""
  pad = -x.shape[axis] % block
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
  shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
  return x.reshape(shape)


def _unblocks(xb: jax.Array, axis: int, size: int) -> jax.Array:
  """Inverse of ``_blocks``: merges the block axes and drops the padding."""
  shape = xb.shape[:axis] + (xb.shape[axis] * xb.shape[axis + 1],) + xb.shape[axis + 2:]
  return lax.slice_in_dim(xb.reshape(shape), 0, size, axis=axis)


def _check_axis(x: jax.Array, axis: int) -> None:
  if x.ndim != 2 or axis not in (0, 1):
    raise ValueError(f'microscaling quantizers take a 2-D operand and its contracting '
                     f'axis 0 or 1, got shape {x.shape} and axis {axis!r}.')


def _keeping_sharding(quantize, static_argnums=(1,)):
  """``quantize(x, axis, ...)`` typed with ``x``'s sharding under an explicit mesh.

  Blocks straddle shard boundaries (16 tokens over a batch axis split 8 ways),
  which explicit sharding types cannot express, so the padding and reshapes run
  under ``auto_axes``: the partitioner gathers what a block needs. Maxima take
  no order, so the codes are those of one device. No-op without explicit axes.
  The result is jitted with ``axis`` (and the arguments after it) static, so a
  program's jaxpr shows each quantizer call as a ``jit`` named after it.
  """
  @functools.wraps(quantize)
  def wrapped(x, axis, *args):
    sharding = explicit_sharding.out_sharding(x)
    if sharding is None:
      return quantize(x, axis, *args)
    fn = lambda a: quantize(a, axis, *args)  # the arguments after x are static
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    shapes = jax.eval_shape(fn, jax.ShapeDtypeStruct(x.shape, x.dtype))  # unsharded
    out = jax.tree.map(lambda s: sharding if s.ndim else replicated, shapes)
    return jax.sharding.auto_axes(fn, out_sharding=out)(x)
  return jax.jit(wrapped, static_argnums=static_argnums)


# --- rounding --------------------------------------------------------------------


def _exponent_field(a: jax.Array) -> jax.Array:
  """Biased float32 exponent field of ``a`` (int32; 0 for zero and subnormals)."""
  return (lax.bitcast_convert_type(a, jnp.uint32) >> 23).astype(jnp.int32)


def _pow2_from_field(field: jax.Array) -> jax.Array:
  """float32 with biased exponent field ``field`` (1..254) and mantissa 1: 2^(field-127)."""
  return lax.bitcast_convert_type((field << 23).astype(jnp.uint32), jnp.float32)


def round_e2m1(y: jax.Array, uniform: jax.Array | None = None) -> jax.Array:
  r"""Rounds float32 ``y`` to the E2M1 grid :math:`\pm\{0, .5, 1, 1.5, 2, 3, 4, 6\}`.

  Magnitudes above 6 saturate to 6; NaN stays NaN.

  Args:
    y: float32 array, already divided by its scale.
    uniform: None for round to nearest (ties to even), else float32 U[0, 1)
      draws of ``y``'s shape for stochastic rounding.

  Returns:
    float32 array of grid values, the sign of ``y``.

  Example:
    >>> import jax.numpy as jnp
    >>> round_e2m1(jnp.array([0.25, 0.75, 1.75, 2.5, 5.0, -7.0])).tolist()
    [0.0, 1.0, 2.0, 2.0, 4.0, -6.0]
  """
  magnitude = jnp.minimum(jnp.abs(y), E2M1_MAX)
  # The spacing h of |y|'s interval and 1 / h: exact powers of two.
  small, middle = magnitude < 2.0, magnitude < 4.0
  inv_step = jnp.where(small, 2.0, jnp.where(middle, 1.0, 0.5))
  step = jnp.where(small, 0.5, jnp.where(middle, 1.0, 2.0))
  t = magnitude * inv_step
  if uniform is None:
    steps = jnp.round(t)
  else:
    whole = jnp.floor(t)
    steps = whole + (uniform < t - whole).astype(jnp.float32)
  return jnp.copysign(steps * step, y)


def round_e4m3(y: jax.Array) -> jax.Array:
  r"""Rounds float32 ``y`` (:math:`|y| \le 448`) to the nearest E4M3 value, ties to even.

  Normal E4M3 values (:math:`|y| \ge 2^{-6}`) keep 4 significant bits, subnormal
  ones are multiples of :math:`2^{-9}`: the quantum is
  :math:`q = 2^{\max(\lfloor \log_2|y| \rfloor, -6) - 3}`, and
  :math:`(|y| + 2^{23} q) - 2^{23} q` rounds :math:`|y|` to a multiple of it.

  Example:
    >>> import jax.numpy as jnp
    >>> round_e4m3(jnp.array([1.0625, 1.1875, -300.0, 0.0029296875])).tolist()
    [1.0, 1.25, -288.0, 0.00390625]
  """
  magnitude = jnp.abs(y)
  # Biased exponent of 2^23 q: max(field, 127 - 6) - 3 + 23.
  magic = _pow2_from_field(jnp.maximum(_exponent_field(magnitude), 121) + 20)
  return jnp.copysign((magnitude + magic) - magic, y)


# --- noise for stochastic rounding ---------------------------------------------------


def _lowbias32(h: jax.Array) -> jax.Array:
  """C. Wellons' lowbias32 integer hash of uint32 ``h``."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def block_scale_seed(block_scale: jax.Array, salt: int) -> jax.Array:
  """uint32 seed from a tensor's block scales and a constant ``salt`` (module docstring).

  Example:
    >>> import jax.numpy as jnp
    >>> scales = jnp.array([[448.0, 3.5], [0.0, 1.0]])
    >>> int(block_scale_seed(scales, 1)) == int(block_scale_seed(scales, 1))
    True
    >>> int(block_scale_seed(scales, 1)) == int(block_scale_seed(scales, 2))
    False
    >>> int(block_scale_seed(scales, 1)) == int(block_scale_seed(scales[::-1], 1))
    False
  """
  bits = lax.bitcast_convert_type(block_scale.astype(jnp.float32), jnp.uint32).reshape(-1)
  index = lax.iota(jnp.uint32, bits.size)
  total = jnp.sum(_lowbias32(bits + index * jnp.uint32(_GOLDEN)), dtype=jnp.uint32)  # wraps
  return _lowbias32(total ^ _lowbias32(jnp.uint32(salt % 2**32)))


def hash_uniform(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 U[0, 1) on a 2^-24 grid, one per element of ``shape``, from a uint32 seed."""
  index = lax.iota(jnp.uint32, int(np.prod(shape))).reshape(shape)
  bits = _lowbias32(index * jnp.uint32(_GOLDEN) + seed)
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


# --- formats ------------------------------------------------------------------------


def _nvfp4_scales(xb: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(E4M3 block scales with the block axis kept, float32 tensor scale) of blocked ``xb``."""
  block_amax = jnp.max(jnp.abs(xb), axis=axis + 1, keepdims=True)
  tensor_amax = jnp.max(block_amax)  # NaN and Inf stay: they must reach the values.
  tensor_scale = jnp.where(tensor_amax == 0, jnp.float32(1), tensor_amax * _INV_NVFP4_RANGE)
  block_scale = round_e4m3(jnp.clip(
      block_amax * (1 / (tensor_scale * jnp.float32(E2M1_MAX))), 0.0, E4M3_MAX))
  return block_scale, tensor_scale


def nvfp4_scales(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  r"""NVFP4 scales of ``x`` [M, K] or [K, N] blocked along ``axis``.

  Returns:
    ``(block_scale, tensor_scale)``: float32 E4M3 values :math:`s_b`, one per
    block ([M, K/16] for axis 1, [K/16, N] for axis 0, K padded up), and the
    float32 scalar :math:`s_t`.
  """
  _check_axis(x, axis)
  block_scale, tensor_scale = _nvfp4_scales(_blocks(x.astype(jnp.float32), axis, NVFP4_BLOCK),
                                            axis)
  return jnp.squeeze(block_scale, axis + 1), tensor_scale


@functools.partial(_keeping_sharding, static_argnums=(1, 2))
def nvfp4_quantize(x: jax.Array, axis: int, salt: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  r"""NVFP4 quantization of a 2-D operand in 1 x 16 blocks along ``axis``.

  Args:
    x: [M, K] or [K, N] float array.
    axis: the contracting axis (1 for a lhs, 0 for a rhs).
    salt: None for round to nearest; an int for stochastic rounding, with
      noise seeded by ``block_scale_seed(block scales, salt)``.

  Returns:
    ``(values, tensor_scale)``: bfloat16 ``values`` :math:`= c\,s_b` (exact) of
    ``x``'s shape and the float32 scalar :math:`s_t`; :math:`\hat{x} = c\,s_b\,s_t`.

  Example:
    >>> import jax.numpy as jnp
    >>> values, scale = nvfp4_quantize(jnp.array([[0.3, -1.0, 2.6, 6.0]]), axis=1)
    >>> values.tolist(), float(scale) == float(jnp.float32(6) * jnp.float32(1 / 2688))
    ([[224.0, -448.0, 1344.0, 2688.0]], True)
  """
  _check_axis(x, axis)
  codes, block_scale, tensor_scale = nvfp4_codes(x, axis, salt)
  return _unblocks(codes * block_scale, axis, x.shape[axis]).astype(jnp.bfloat16), tensor_scale


def nvfp4_codes(x: jax.Array, axis: int, salt: int | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""The NVFP4 codes and scales of ``x`` before they are multiplied (``nvfp4_quantize``).

  Returns:
    ``(codes, block_scale, tensor_scale)``: float32 E2M1 values :math:`c` of the blocked,
    zero-padded ``x`` (``axis`` split into (blocks, 16)), float32 E4M3 values :math:`s_b`
    with the block axis kept (size 1), and the float32 scalar :math:`s_t`. The native path
    (native_microscaling.py) stores them in the formats' own dtypes.
  """
  xb = _blocks(x.astype(jnp.float32), axis, NVFP4_BLOCK)
  block_scale, tensor_scale = _nvfp4_scales(xb, axis)
  divisor = block_scale * tensor_scale
  # A block whose scale is 0 (all zeros, or underflowed) codes x * 0 = 0.
  encode = jnp.where(divisor == 0, jnp.float32(0), 1 / divisor)
  uniform = (None if salt is None
             else hash_uniform(block_scale_seed(block_scale, salt), xb.shape))
  return round_e2m1(xb * encode, uniform), block_scale, tensor_scale


def _e8m0_exponent(amax: jax.Array) -> jax.Array:
  r""":math:`\lceil \log_2(a / 448) \rceil` of float32 ``a``, exactly, from its bits.

  With :math:`a = m\,2^E`, :math:`m \in [1, 2)` and :math:`448 = 1.75 \cdot 2^8`:
  the exponent is :math:`E - 8` when :math:`m \le 1.75`, else :math:`E - 7`.
  """
  bits = lax.bitcast_convert_type(amax, jnp.uint32)
  exponent = (bits >> 23).astype(jnp.int32) - 127
  above = (bits & 0x7FFFFF) > 0x600000  # mantissa 1.75 = 1 + 0x600000 / 2^23
  return jnp.clip(exponent - 8 + above.astype(jnp.int32), _E8M0_MIN_EXP, _E8M0_MAX_EXP)


def _mxfp8_scales(xb: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(int32 exponents, float32 E8M0 scales) per block of blocked ``xb``, block axis kept."""
  block_amax = jnp.max(jnp.abs(xb), axis=axis + 1, keepdims=True)
  exponent = _e8m0_exponent(block_amax)
  # Exact powers of two; a non-finite block maximum makes its scale NaN.
  block_scale = jnp.where(jnp.isfinite(block_amax), _pow2_from_field(exponent + 127),
                          jnp.float32(jnp.nan))
  return exponent, block_scale


def mxfp8_scales(x: jax.Array, axis: int) -> jax.Array:
  r"""MXFP8 block scales :math:`s_b = 2^{e_b}` (float32) of ``x`` blocked along ``axis``:
  [M, K/32] for axis 1, [K/32, N] for axis 0 (K padded up)."""
  _check_axis(x, axis)
  _, block_scale = _mxfp8_scales(_blocks(x.astype(jnp.float32), axis, MXFP8_BLOCK), axis)
  return jnp.squeeze(block_scale, axis + 1)


@_keeping_sharding
def mxfp8_quantize(x: jax.Array, axis: int) -> jax.Array:
  r"""MXFP8 quantization of a 2-D operand in 1 x 32 blocks along ``axis``.

  Args:
    x: [M, K] or [K, N] float array.
    axis: the contracting axis (1 for a lhs, 0 for a rhs).

  Returns:
    bfloat16 values :math:`c\,s_b` (exact) of ``x``'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> mxfp8_quantize(jnp.array([[1.0, 0.3, -0.01, 500.0]]), axis=1).tolist()
    [[1.0, 0.3125, -0.01171875, 512.0]]
  """
  _check_axis(x, axis)
  codes, _, block_scale = mxfp8_codes(x, axis)
  return _unblocks(codes * block_scale, axis, x.shape[axis]).astype(jnp.bfloat16)


def mxfp8_codes(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""The MXFP8 codes and scales of ``x`` before they are multiplied (``mxfp8_quantize``).

  Returns:
    ``(codes, exponent, block_scale)``: float32 E4M3 values :math:`c` of the blocked,
    zero-padded ``x`` (``axis`` split into (blocks, 32)), the int32 exponents :math:`e_b`
    and the float32 scales :math:`2^{e_b}` (NaN for a block with a non-finite value), both
    with the block axis kept (size 1).
  """
  xb = _blocks(x.astype(jnp.float32), axis, MXFP8_BLOCK)
  exponent, block_scale = _mxfp8_scales(xb, axis)
  return round_e4m3(xb * _pow2_from_field(127 - exponent)), exponent, block_scale


def nvfp4_dequantized(x: jax.Array, axis: int, salt: int | None = None) -> jax.Array:
  """float32 :math:`\\hat{x}` of ``nvfp4_quantize`` (for tests and diagnostics)."""
  values, tensor_scale = nvfp4_quantize(x, axis, salt)
  return values.astype(jnp.float32) * tensor_scale


def mxfp8_dequantized(x: jax.Array, axis: int) -> jax.Array:
  """float32 :math:`\\hat{x}` of ``mxfp8_quantize`` (for tests and diagnostics)."""
  return mxfp8_quantize(x, axis).astype(jnp.float32)
