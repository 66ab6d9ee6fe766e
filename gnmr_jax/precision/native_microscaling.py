r"""Native NVFP4 / MXFP8 GEMMs: the project's codes and scales into a block-scaled GEMM.

On GPUs of CUDA compute capability 10 and up (Blackwell: B200, GB200, B300) the tensor
cores multiply block-scaled operands directly: XLA turns ``jax.nn.scaled_matmul`` into one
``__cudnn$blockScaledDot`` custom call. The native path feeds it the *same* codes and block
scales as the emulation (microscaling.py), stored in the formats' own dtypes:

* NVFP4: codes ``float4_e2m1fn``, block scales ``float8_e4m3fn`` (1 x 16), the float32
  per-tensor scales :math:`s_t` of both operands multiplied into the float32 result;
* MXFP8: codes ``float8_e4m3fn``, block scales ``float8_e8m0fnu`` (1 x 32); a block with a
  non-finite value gets the E8M0 NaN scale, as its emulated scale is NaN.

Every value already lies on its format's grid, so the conversions are exact and the GEMM
computes :math:`\sum_k c^a_k s^a_{b(k)} c^b_k s^b_{b(k)}` from the values the emulation puts
into its bf16 dot: the two differ only in the order of the float32 accumulation. Rounding
(nearest and the stochastic rounding of the NVFP4 gradient), block layout (each operand along
its own contraction, in every leg) and the per-tensor scale are the project's recipe, not
``jax.nn.scaled_dot_general``'s (docs/guides/precision_paths.md lists what that function
does differently, measured).

Layout: ``scaled_matmul`` takes ``lhs [B, M, K]`` and ``rhs [B, N, K]`` with the contraction
last. A right operand ``[K, N]`` is quantized along axis 0, exactly as the emulation does it
(the same blocks, the same stochastic-rounding noise), and its codes transposed; XLA fuses
the transpose into the quantizing fusion. A contraction that is not a multiple of the block
is zero-padded in both operands (zero codes add nothing).

No CPU or TPU lowering exists (TPUs have no block-scaled MXU mode; XLA:GPU on Hopper expands
the call into float32 dots, slower than the emulation's bf16 GEMM), so ``'auto'`` picks the
native GEMM only where it is native (``supports_native``) and ``'native'`` is refused
elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from gnmr_jax.precision import explicit_sharding, microscaling, quantize

IMPLS = ('auto', 'native', 'emulated')
# Paths whose GEMMs take the implementation choice.
MICROSCALING_PATHS = ('nvfp4', 'nvfp4_backward', 'mxfp8', 'mxfp8_backward')
# Device names of GPUs with block-scaled tensor cores, for runtimes that report no capability.
BLOCK_SCALED_GPU_NAMES = ('B100', 'B200', 'B300', 'GB200', 'GB300', 'Blackwell')
MIN_CAPABILITY = (10, 0)


def compute_capability(device) -> tuple[int, int] | None:
  """A CUDA device's compute capability (major, minor), or None (CPU, TPU, ROCm, unreported)."""
  try:
    major, minor = (int(p) for p in str(device.compute_capability).split('.')[:2])
  except (AttributeError, ValueError):  # CPU, TPU, ROCm's 'gfx950'
    return None
  return major, minor


def supports_native(device) -> bool:
  """True where ``device`` runs block-scaled GEMMs natively (CUDA compute capability >= 10).

  Example:
    >>> import jax
    >>> supports_native(jax.devices('cpu')[0])
    False
  """
  if device.platform not in ('gpu', 'cuda'):
    return False
  capability = compute_capability(device)
  if capability is None:
    return any(name in device.device_kind for name in BLOCK_SCALED_GPU_NAMES)
  return capability >= MIN_CAPABILITY


def describe(device) -> str:
  capability = compute_capability(device)
  extra = f', compute capability {capability[0]}.{capability[1]}' if capability else ''
  return f'{device.device_kind!r} ({device.platform}{extra})'


def resolve_impl(impl: str, device=None) -> str:
  """``'native'`` or ``'emulated'``: what ``precision.microscaling_impl`` means on ``device``.

  Args:
    impl: ``'auto'`` (native where ``supports_native``), ``'native'`` or ``'emulated'``.
    device: the jax Device the program is compiled for (default ``jax.devices()[0]``;
      training passes its mesh's, which may be a compile-only device of another platform).

  Raises:
    ValueError: ``impl`` is not one of ``IMPLS``, or is ``'native'`` on a device that cannot
      run it.

  Example:
    >>> import jax
    >>> cpu = jax.devices('cpu')[0]
    >>> resolve_impl('auto', cpu), resolve_impl('emulated', cpu)
    ('emulated', 'emulated')
    >>> resolve_impl('native', cpu)
    Traceback (most recent call last):
    ...
    ValueError: precision.microscaling_impl='native' needs ...
  """
  if impl not in IMPLS:
    raise ValueError(f"precision config field 'microscaling_impl' must be one of {IMPLS}, "
                     f'got {impl!r}.')
  if impl == 'emulated':
    return impl
  device = device if device is not None else jax.devices()[0]
  if supports_native(device):
    return 'native'
  if impl == 'native':
    raise ValueError(
        "precision.microscaling_impl='native' needs a GPU with block-scaled tensor cores "
        f'(CUDA compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: B200, GB200, '
        f'B300), where XLA runs jax.nn.scaled_matmul as a cuDNN GEMM; the device is '
        f"{describe(device)}. Use 'auto' (native where it is native) or 'emulated'.")
  return 'emulated'


def uses_native(config) -> bool:
  """Whether a path builder given the precision ``config`` builds the native GEMMs.

  ``make_policy`` resolves ``'auto'`` for its device and checks ``'native'`` before any
  builder runs; a builder called directly resolves ``'auto'`` for ``jax.devices()[0]``.
  """
  impl = config.get('microscaling_impl', 'auto')
  return (resolve_impl(impl) if impl == 'auto' else impl) == 'native'


def resolved_config(config, device=None):
  """``config`` (a precision ConfigDict), with ``microscaling_impl`` resolved for ``device``
  when a path in use takes it; else ``config`` itself (nothing asks for a device)."""
  if not {config.low_cost_path, config.recovery_path} & set(MICROSCALING_PATHS):
    return config
  impl = resolve_impl(config.microscaling_impl, device)
  if impl == config.microscaling_impl:
    return config
  resolved = config.copy_and_resolve_references()
  resolved.microscaling_impl = impl
  return resolved


# --- codes and scales in the formats' dtypes ------------------------------------------


def _rows_last(blocked: jax.Array, axis: int) -> jax.Array:
  """A blocked array ([M, blocks, B] or [blocks, B, N]; scales with B = 1) as [rows, K]."""
  merged = blocked.reshape(blocked.shape[:axis] + (-1,) + blocked.shape[axis + 2:])
  return merged if axis == 1 else merged.T


@functools.partial(jax.jit, static_argnums=(1, 2))
def nvfp4_encode(x: jax.Array, axis: int, salt: int | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """NVFP4 ``(codes, block_scales, tensor_scale)`` of 2-D ``x`` as ``scaled_matmul`` takes them.

  Args:
    x: [M, K] (``axis=1``) or [K, N] (``axis=0``); ``axis`` is the contraction.
    salt: as in ``microscaling.nvfp4_quantize`` (None: round to nearest).

  Returns:
    ``float4_e2m1fn`` codes [R, Kp] and ``float8_e4m3fn`` scales [R, Kp / 16], R the other
    axis and Kp the contraction padded to a multiple of 16, and the float32 scalar tensor
    scale: exactly the emulation's values (``codes * scales * tensor_scale``).
  """
  codes, block_scale, tensor_scale = microscaling.nvfp4_codes(x, axis, salt)
  return (_rows_last(codes, axis).astype(jnp.float4_e2m1fn),
          _rows_last(block_scale, axis).astype(jnp.float8_e4m3fn), tensor_scale)


def e8m0(exponent: jax.Array, block_scale: jax.Array) -> jax.Array:
  """``float8_e8m0fnu`` :math:`2^e` from int32 exponents in [-127, 127]; NaN where
  ``block_scale`` is NaN (a block with a non-finite value)."""
  biased = jnp.where(jnp.isnan(block_scale), 255, exponent + 127).astype(jnp.uint8)
  return lax.bitcast_convert_type(biased, jnp.float8_e8m0fnu)


@functools.partial(jax.jit, static_argnums=(1,))
def mxfp8_encode(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """MXFP8 ``(codes, block_scales)`` of 2-D ``x`` as ``scaled_matmul`` takes them.

  Returns:
    ``float8_e4m3fn`` codes [R, Kp] and ``float8_e8m0fnu`` scales [R, Kp / 32] (as in
    ``nvfp4_encode``): exactly the emulation's values (``codes * scales``).
  """
  codes, exponent, block_scale = microscaling.mxfp8_codes(x, axis)
  return (_rows_last(codes, axis).astype(jnp.float8_e4m3fn),
          _rows_last(e8m0(exponent, block_scale), axis))


# --- the GEMMs ------------------------------------------------------------------------


def block_scaled_matmul(lhs_codes, rhs_codes, lhs_scales, rhs_scales) -> jax.Array:
  """float32 [M, N] of codes [M, K] x [N, K] with block scales [M, K/B], [N, K/B]."""
  out = jax.nn.scaled_matmul(lhs_codes[None], rhs_codes[None], lhs_scales[None],
                             rhs_scales[None], preferred_element_type=jnp.float32)
  return out[0]


def _whole_blocks_per_shard(x: jax.Array, axis: int, block: int) -> jax.Array:
  """``x``, its contraction gathered if a shard of it would split a block.

  The GEMM's partitioning splits the codes and their scales along the contraction alike
  (and adds the partial products), which is exact only when every shard holds whole
  blocks: true at training sizes (tokens per device, d_ff per tensor shard, multiples of
  32), not always in tests. Without explicit axes the sharding is not visible here.
  """
  sharding = explicit_sharding.out_sharding(x)
  names = None if sharding is None else (tuple(sharding.spec) + (None,) * x.ndim)[axis]
  if names is None:
    return x
  shards = math.prod(sharding.mesh.shape[n] for n in (names if isinstance(names, tuple)
                                                      else (names,)))
  if x.shape[axis] % (shards * block) == 0:
    return x
  spec = list((tuple(sharding.spec) + (None,) * x.ndim)[:x.ndim])
  spec[axis] = None
  return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec(*spec)))


def _typed(matmul, lhs, rhs, out_dtype, out_sharding, block):
  """``matmul(lhs, rhs)`` in ``out_dtype``; under explicit mesh axes typed as the plain dot's
  result (or ``out_sharding``), the quantizing and the GEMM left to the partitioner."""
  explicit = out_sharding or explicit_sharding.out_sharding(lhs)
  if explicit is None:
    return matmul(lhs, rhs).astype(out_dtype)
  if out_sharding is None:  # the forward: what lax.dot_general would type it
    out_sharding = jax.eval_shape(
        lambda a, b: lax.dot_general(a, b, quantize.MATMUL_DIMS), lhs, rhs).sharding
  lhs, rhs = _whole_blocks_per_shard(lhs, 1, block), _whole_blocks_per_shard(rhs, 0, block)
  return jax.sharding.auto_axes(lambda a, b: matmul(a, b).astype(out_dtype),
                                out_sharding=out_sharding)(lhs, rhs)


def nvfp4_matmul(lhs, rhs, out_dtype, out_sharding=None, *, lhs_salt=None, rhs_salt=None):
  """``nvfp4.nvfp4_matmul``'s product as one native block-scaled GEMM (same codes, scales)."""
  def matmul(a, b):
    a_codes, a_scales, a_tensor = nvfp4_encode(a, 1, lhs_salt)
    b_codes, b_scales, b_tensor = nvfp4_encode(b, 0, rhs_salt)
    return block_scaled_matmul(a_codes, b_codes, a_scales, b_scales) * (a_tensor * b_tensor)
  return _typed(matmul, lhs, rhs, out_dtype, out_sharding, microscaling.NVFP4_BLOCK)


def mxfp8_matmul(lhs, rhs, out_dtype, out_sharding=None):
  """``mxfp8.mxfp8_matmul``'s product as one native block-scaled GEMM (same codes, scales)."""
  def matmul(a, b):
    a_codes, a_scales = mxfp8_encode(a, 1)
    b_codes, b_scales = mxfp8_encode(b, 0)
    return block_scaled_matmul(a_codes, b_codes, a_scales, b_scales)
  return _typed(matmul, lhs, rhs, out_dtype, out_sharding, microscaling.MXFP8_BLOCK)
