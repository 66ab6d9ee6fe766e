r"""Causal grouped-query attention through a kernel per backend, resolved once per run.

Every implementation computes, for query head :math:`h` of :math:`H` and key/value head
:math:`h // G` of :math:`K = H / G` (grouped-query attention),

.. math::
   o_s = \sum_{t \le s} \mathrm{softmax}_t\Big(\frac{q_s \cdot k_t}{\sqrt{D}}\Big)\, v_t ,

with float32 softmax statistics. They differ in what they keep in memory:

* ``'xla'``: the reference. Float32 scores ``[B, K, G, S, T]``, the mask and the softmax as
  XLA fusions: memory and HBM traffic quadratic in the sequence length. It runs everywhere.
* ``'cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')``, cuDNN's fused flash
  attention (``__cudnn$fmhaSoftmax`` and its backward): scores stay on chip. Needs a GPU of
  compute capability >= 8.0 (not a T4), bf16/fp16 operands and a head dimension that is a
  multiple of 8 and at most 128 (256 on Hopper; 128 here so one rule holds on every GPU).
* ``'splash'``: Pallas splash attention on TPU (``jax.experimental.pallas.ops.tpu.
  splash_attention``, MaxText's ``attention='flash'``), the causal mask skipping the blocks
  above the diagonal. Needs the sequence length to be a multiple of 128 (its block size).

``resolve('auto', device, ...)`` picks the kernel the device runs (``'xla'`` on a CPU and
where no kernel applies); ``train_loop.build`` resolves ``model.attention`` for its mesh's
first device (a compile-only topology device included) and records the result in
``run.config``, so the AOT report names what was compiled. The kernels run under
``shard_map`` over the context mesh, batch over the batch axes and heads over ``tensor`` (as
the model shards its activations), each device on its own shard: attention mixes nothing
across batch rows or heads.

Example:
  >>> import jax, jax.numpy as jnp
  >>> q = jnp.ones((1, 8, 4, 16)); kv = jnp.ones((1, 8, 2, 16))
  >>> resolve('auto', jax.devices('cpu')[0], seq_len=8, head_dim=16, dtype='float32')
  'xla'
  >>> attention(q, kv, kv, 'xla').shape
  (1, 8, 4, 16)
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from gnmr_jax import sharding
from gnmr_jax.precision.native_microscaling import compute_capability

IMPLS = ('auto', 'xla', 'cudnn', 'splash')
# cuDNN's fused attention (SDPA) needs Ampere or later.
MIN_CUDNN_CAPABILITY = (8, 0)
CUDNN_DTYPES = ('bfloat16', 'float16')
CUDNN_MAX_HEAD_DIM = 128
# Splash block sizes, largest first (splash_block picks one for every block of the forward and
# backward kernels; MaxText's default blocks are 512).
SPLASH_BLOCKS = (512, 256, 128)
MIN_SPLASH_BLOCKS = 4

Array = jax.Array


def _unsupported(impl: str, device, seq_len: int, head_dim: int, dtype: str) -> str | None:
  """Why `impl` cannot run these shapes on `device`, or None when it can."""
  platform = device.platform
  where = f'{device.device_kind!r} ({platform})'
  if impl == 'cudnn':
    if platform not in ('gpu', 'cuda'):
      return f'cuDNN flash attention runs on NVIDIA GPUs; the device is {where}'
    capability = compute_capability(device)
    if capability is not None and capability < MIN_CUDNN_CAPABILITY:
      return (f'cuDNN flash attention needs compute capability >= 8.0; the device is {where}, '
              f'compute capability {capability[0]}.{capability[1]}')
    if dtype not in CUDNN_DTYPES:
      return f'cuDNN flash attention takes {CUDNN_DTYPES} operands, the model computes in {dtype}'
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
      return (f'cuDNN flash attention needs a head dimension that is a multiple of 8 and at '
              f'most {CUDNN_MAX_HEAD_DIM}, got {head_dim}')
  elif impl == 'splash':
    if platform != 'tpu':
      return f'splash attention is a TPU (Pallas Mosaic) kernel; the device is {where}'
    if seq_len % SPLASH_BLOCKS[-1]:
      return (f'splash attention needs a sequence length that is a multiple of '
              f'{SPLASH_BLOCKS[-1]}, got {seq_len}')
  return None


def resolve(impl: str, device=None, *, seq_len: int, head_dim: int, dtype) -> str:
  """``'xla'``, ``'cudnn'`` or ``'splash'``: what ``model.attention=impl`` runs on ``device``.

  Args:
    impl: one of ``IMPLS``; ``'auto'`` picks cuDNN on a GPU that runs it, splash on a TPU
      that runs it, else ``'xla'``.
    device: the jax Device the program is compiled for (default ``jax.devices()[0]``).
    seq_len, head_dim, dtype: the attention's sequence length, head dimension and operand
      dtype (the model's compute dtype).

  Raises:
    ValueError: ``impl`` is unknown, or names a kernel the device or shapes cannot run (the
      message says why).

  Example:
    >>> import jax
    >>> cpu = jax.devices('cpu')[0]
    >>> resolve('auto', cpu, seq_len=256, head_dim=64, dtype='bfloat16')
    'xla'
    >>> resolve('cudnn', cpu, seq_len=256, head_dim=64, dtype='bfloat16')
    Traceback (most recent call last):
    ...
    ValueError: model.attention='cudnn' cannot run here: cuDNN flash attention runs on ...
  """
  if impl not in IMPLS:
    raise ValueError(f'model.attention must be one of {IMPLS}, got {impl!r}')
  if impl == 'xla':
    return impl
  device = device if device is not None else jax.devices()[0]
  dtype = jnp.dtype(dtype).name
  if impl != 'auto':
    why = _unsupported(impl, device, seq_len, head_dim, dtype)
    if why:
      raise ValueError(f"model.attention={impl!r} cannot run here: {why}. Use 'auto' (the "
                       "kernel the device runs, else 'xla') or 'xla'.")
    return impl
  kernel = {'gpu': 'cudnn', 'cuda': 'cudnn', 'tpu': 'splash'}.get(device.platform)
  if kernel is None or _unsupported(kernel, device, seq_len, head_dim, dtype):
    return 'xla'
  return kernel


def xla_attention(q_BxSxHxD: Array, k_BxTxKxD: Array, v_BxTxKxD: Array) -> Array:
  """The reference: float32 scores and softmax, causal mask, out in q's dtype [B, S, H, D]."""
  batch, seq_len, heads, head_dim = q_BxSxHxD.shape
  kv_heads = k_BxTxKxD.shape[2]
  group = heads // kv_heads
  # Query head h uses kv head h // group.
  q_BxSxKxGxD = q_BxSxHxD.reshape(batch, seq_len, kv_heads, group, head_dim)
  scores_BxKxGxSxT = jnp.einsum(
      'bskgd,btkd->bkgst', q_BxSxKxGxD, k_BxTxKxD,
      preferred_element_type=jnp.float32) * (head_dim ** -0.5)
  causal_SxT = jnp.tril(jnp.ones((seq_len, k_BxTxKxD.shape[1]), jnp.bool_))
  scores_BxKxGxSxT = jnp.where(causal_SxT, scores_BxKxGxSxT, jnp.finfo(jnp.float32).min)
  probs_BxKxGxSxT = jax.nn.softmax(scores_BxKxGxSxT, axis=-1).astype(q_BxSxHxD.dtype)
  out_BxSxKxGxD = jnp.einsum('bkgst,btkd->bskgd', probs_BxKxGxSxT, v_BxTxKxD)
  return out_BxSxKxGxD.reshape(batch, seq_len, heads, head_dim)


def cudnn_attention(q_BxSxHxD: Array, k_BxTxKxD: Array, v_BxTxKxD: Array) -> Array:
  """cuDNN flash attention (fused forward and backward custom calls), causal."""
  return jax.nn.dot_product_attention(q_BxSxHxD, k_BxTxKxD, v_BxTxKxD, is_causal=True,
                                      implementation='cudnn')


def splash_block(seq_len: int) -> int:
  """The splash block size for `seq_len`: the largest of SPLASH_BLOCKS dividing it into at
  least MIN_SPLASH_BLOCKS blocks, else the smallest dividing it.

  A causal kernel computes every block on or below the diagonal whole: with n blocks per side
  (n + 1) / 2n of the square (1 block: all of it, 4: 62%, 16: 53%), so short sequences take
  small blocks and long ones the large blocks that keep the MXU busy.
  """
  dividing = [block for block in SPLASH_BLOCKS if seq_len % block == 0]
  for block in dividing:
    if seq_len // block >= MIN_SPLASH_BLOCKS:
      return block
  if dividing:
    return dividing[-1]
  raise ValueError(f'splash attention needs a sequence length that is a multiple of '
                   f'{SPLASH_BLOCKS[-1]}, got {seq_len}')


def _splash_kernel(heads: int, seq_len: int, interpret: bool):
  # pylint: disable=g-import-not-at-top  (Pallas TPU ops import Mosaic: only where used)
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask
  block = splash_block(seq_len)
  sizes = splash_attention_kernel.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block,
      block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
      block_q_dq=block, block_kv_dq=block)
  mask = splash_attention_mask.MultiHeadMask(
      [splash_attention_mask.CausalMask((seq_len, seq_len)) for _ in range(heads)])
  # Built per call, inside the trace that uses it: its mask tables become that program's
  # constants (a kernel kept across traces would hold one trace's tracers).
  return splash_attention_kernel.make_splash_mha(
      mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q_BxSxHxD: Array, k_BxTxKxD: Array, v_BxTxKxD: Array, *,
                     interpret: bool = False) -> Array:
  """Pallas splash attention (TPU; ``interpret=True`` runs its interpreter on any backend).

  The kernel takes one batch row with heads first ([H, S, D]) and does not scale: q is
  scaled by 1/sqrt(D) in float32 and cast back before it.
  """
  heads, seq_len, head_dim = q_BxSxHxD.shape[2], q_BxSxHxD.shape[1], q_BxSxHxD.shape[3]
  kernel = _splash_kernel(heads, seq_len, interpret)
  scaled = (q_BxSxHxD.astype(jnp.float32) * head_dim ** -0.5).astype(q_BxSxHxD.dtype)
  q_BxHxSxD, k_BxKxTxD, v_BxKxTxD = (jnp.swapaxes(x, 1, 2)
                                     for x in (scaled, k_BxTxKxD, v_BxTxKxD))
  out_BxHxSxD = jax.vmap(kernel)(q_BxHxSxD, k_BxKxTxD, v_BxKxTxD)
  return jnp.swapaxes(out_BxHxSxD, 1, 2)


def _mesh_entry(mesh, logical: str, size: int, taken: set):
  """The context mesh axes the logical axis rules give `logical`, if they divide `size`."""
  rules = nn.get_logical_axis_rules()
  axes = tuple(a for a in sharding.entry_axes(dict(rules).get(logical) if rules else None)
               if a in mesh.axis_names and a not in taken)
  if not axes or size % math.prod(mesh.shape[a] for a in axes):
    return None
  taken.update(axes)
  return sharding.spec_entry(axes)


def _shard_mapped(kernel, q_BxSxHxD: Array, k_BxTxKxD: Array, v_BxTxKxD: Array) -> Array:
  """`kernel` on each device's shard: batch over the batch axes, heads over tensor.

  Heads are split only when both the query and the key/value heads divide over the axis,
  so each shard keeps whole groups (query head h with kv head h // G). Without a mesh, or
  on one device, the kernel runs as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q_BxSxHxD, k_BxTxKxD, v_BxTxKxD)
  taken = set()
  batch = _mesh_entry(mesh, 'batch', q_BxSxHxD.shape[0], taken)
  heads = _mesh_entry(mesh, 'heads', math.gcd(q_BxSxHxD.shape[2], k_BxTxKxD.shape[2]), taken)
  spec = PartitionSpec(batch, None, heads, None)
  operands = (q_BxSxHxD, k_BxTxKxD, v_BxTxKxD)
  explicit = sharding.explicit_axis_names(mesh)
  if explicit:  # typed shardings: the operands are resharded to what the kernel's map takes
    typed = PartitionSpec(*(sharding.spec_entry(tuple(
        a for a in sharding.entry_axes(entry) if a in explicit)) for entry in spec))
    operands = tuple(jax.sharding.reshard(x, typed) for x in operands)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       check_vma=False)(*operands)


def attention(q_BxSxHxD: Array, k_BxTxKxD: Array, v_BxTxKxD: Array, impl: str, *,
              interpret: bool = False) -> Array:
  """Causal GQA attention [B, S, H, D] by the resolved implementation `impl`.

  Args:
    q_BxSxHxD: queries (rotary applied), in the compute dtype.
    k_BxTxKxD, v_BxTxKxD: keys and values, K dividing H.
    impl: ``'xla'``, ``'cudnn'`` or ``'splash'`` (``resolve``'s result; not ``'auto'``).
    interpret: run a Pallas kernel in its interpreter (tests on a CPU).

  Raises:
    ValueError: an unresolved or unknown `impl`, or heads that do not group.
  """
  heads, kv_heads = q_BxSxHxD.shape[2], k_BxTxKxD.shape[2]
  if heads % kv_heads:
    raise ValueError(f'query heads {heads} must be a multiple of key/value heads {kv_heads}')
  if impl == 'xla':
    return xla_attention(q_BxSxHxD, k_BxTxKxD, v_BxTxKxD)
  if impl == 'cudnn':
    return _shard_mapped(cudnn_attention, q_BxSxHxD, k_BxTxKxD, v_BxTxKxD)
  if impl == 'splash':
    kernel = functools.partial(splash_attention, interpret=interpret)
    return _shard_mapped(kernel, q_BxSxHxD, k_BxTxKxD, v_BxTxKxD)
  raise ValueError(f"attention impl must be one of {IMPLS[1:]} (resolve 'auto' first), "
                   f'got {impl!r}')

