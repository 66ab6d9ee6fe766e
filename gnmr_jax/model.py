"""LLaMA-2 decoder whose projections run through a (possibly routed) precision policy.

Architecture: token embedding -> num_layers x [RMSNorm -> causal (grouped-query)
attention with rotary embeddings -> residual; RMSNorm -> SwiGLU MLP -> residual]
-> RMSNorm -> untied output head. No biases. Blocks are stacked with `nn.scan`,
so every block param has a leading [num_layers] axis (`LAYER_AXIS`).

Each of the seven projections (attn/q, k, v, o and mlp/gate, up, down) computes
`policy.dot(x, kernel, recover)`; one (layer, projection) pair is one GNMR unit.
The controller's recovery mask holds one bool[num_layers] leaf per projection
kernel; the model feeds those leaves to `nn.scan` as scan inputs, so inside a
block each projection receives a bool[] scalar and `lax.cond` predicates are
never batched. With `config.scan_unroll == num_layers` the scan is fully
unrolled (no while loop), which is where per-unit routing is free on a GPU
(see /work/shared/reference/gpu-anchors.md).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from gnmr_jax.model_configs import model_config
  >>> class F32Policy:
  ...   routed = False
  ...   def dot(self, x, kernel, recover=None):
  ...     return jnp.dot(x, kernel.astype(x.dtype))
  >>> model = Transformer(model_config('tiny'), F32Policy())
  >>> tokens = jnp.zeros((2, 16), jnp.int32)
  >>> params = model.init(jax.random.key(0), tokens)['params']
  >>> model.apply({'params': params}, tokens).shape
  (2, 16, 256)
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax.core import meta

from gnmr_jax import attention as attention_lib
from gnmr_jax import loss as loss_lib
from gnmr_jax import sharding
from gnmr_jax.model_configs import static_scan_unroll, validate_model_config
from gnmr_jax.precision import amax_history as amax_history_lib
from gnmr_jax.precision import delayed_scaling
from gnmr_jax.precision import explicit_sharding, side_buffer

# Projection names per sub-module; each owns a `kernel` of shape [d_in, d_out]
# per layer ([num_layers, d_in, d_out] stacked).
PROJECTIONS = {'attn': ('q', 'k', 'v', 'o'), 'mlp': ('gate', 'up', 'down')}
# The recoverable units of one layer (a projection kernel per layer is a unit): 7.
UNITS_PER_LAYER = sum(len(names) for names in PROJECTIONS.values())
# Matches exactly the 7 projection kernels, with or without a 'params/' prefix,
# under re.search or re.fullmatch on '/'-joined paths.
PROJECTION_UNITS_REGEX = (r'(?:^|.*/)layers/(?:' + '|'.join(
    f"{group}/(?:{'|'.join(names)})" for group, names in PROJECTIONS.items()) + r')/kernel$')
# Axis of the stacked projection kernels (and of their mask leaves) that
# indexes the layer.
LAYER_AXIS = 0

_REMAT_POLICIES = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots_saveable': jax.checkpoint_policies.dots_saveable,
    'dots_with_no_batch_dims_saveable':
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'everything_saveable': jax.checkpoint_policies.everything_saveable,
}

Array = jax.Array
Policy = Any  # PrecisionPolicy: `.routed: bool`, `.dot(x, kernel, recover=None)`.


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Array, Array]:
  """Rotary sin/cos tables, float32 [seq_len, head_dim // 2].

  angle[p, i] = p * theta ** (-2i / head_dim).
  """
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x_BxSxHxD: Array, sin_SxF: Array, cos_SxF: Array) -> Array:
  """Rotates feature pairs (i, i + D/2) of each head by the position angle.

  (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32.
  """
  x = x_BxSxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  sin, cos = sin_SxF[:, None, :], cos_SxF[:, None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxSxHxD.dtype)


def projection_recover_bits(recovery_mask: Any, num_layers: int) -> dict:
  """Picks the 7 projection mask leaves out of the controller's mask tree.

  Args:
    recovery_mask: bool tree mirroring `{'params': p}` or `p`.
    num_layers: expected length of each projection leaf.

  Returns:
    {'attn': {'q': bool[L], ...}, 'mlp': {'gate': bool[L], ...}}.

  Raises:
    ValueError: a projection leaf is missing or not of shape [num_layers].

  Example:
    >>> import jax.numpy as jnp
    >>> mask = {'layers': {group: {name: {'kernel': jnp.array([group == 'mlp', False])}
    ...                            for name in names} for group, names in PROJECTIONS.items()}}
    >>> bits = projection_recover_bits({'params': mask}, num_layers=2)
    >>> sorted(bits['attn']), bits['mlp']['up'].tolist(), bits['attn']['q'].tolist()
    (['k', 'o', 'q', 'v'], [True, False], [False, False])
  """
  tree = meta.unbox(recovery_mask)
  if 'params' in tree and 'layers' not in tree:
    tree = tree['params']
  bits = {}
  for group, names in PROJECTIONS.items():
    bits[group] = {}
    for name in names:
      try:
        leaf = tree['layers'][group][name]['kernel']
      except (KeyError, TypeError) as e:
        raise ValueError(
            f'recovery_mask has no leaf layers/{group}/{name}/kernel') from e
      leaf = jnp.asarray(leaf)
      if leaf.shape != (num_layers,):
        raise ValueError(
            f'recovery_mask leaf layers/{group}/{name}/kernel must have shape '
            f'({num_layers},), got {leaf.shape}')
      bits[group][name] = leaf.astype(jnp.bool_)
  return bits


def amax_saturation_units(params: Any, previous: dict, current: dict) -> Any:
  """A params-shaped float32 tree: per projection kernel, float32[L], the largest of its x, W
  and output-gradient saturations this step (``delayed_scaling.saturation``: amax over the
  largest magnitude the step's scale represented; > 1: its codes saturated); 0 for every other
  leaf. Above 1 is what the controller reads as risk (``tx.update(..., overflow=...)``) and
  what the train step logs per unit (``unit_saturation``).

  Args:
    params: the model's params (the tree's shape).
    previous: the amax histories the step scaled from (``TrainState.amax_history``).
    current: the histories after the step (its observations in column 0).

  Example:
    >>> import jax.numpy as jnp
    >>> from gnmr_jax.model_configs import model_config
    >>> previous = init_amax_history(model_config('tiny'), 2)
    >>> current = {g: dict(names) for g, names in previous.items()}
    >>> current['mlp']['up'] = current['mlp']['up'].at[1, 0, 0].set(2 * 448.0)  # x saturated
    >>> params = {'layers': {g: {n: {'kernel': 0} for n in names}
    ...                      for g, names in PROJECTIONS.items()}, 'lm_head': 0}
    >>> tree = amax_saturation_units(params, previous, current)
    >>> tree['layers']['mlp']['up']['kernel'].tolist(), float(tree['lm_head'])
    ([0.0, 2.0, 0.0, 0.0], 0.0)
  """
  per_unit = {group: {name: jnp.max(jax.vmap(delayed_scaling.saturation)(
      previous[group][name], history), axis=1) for name, history in names.items()}
              for group, names in current.items()}

  def leaf(path, _):
    keys = [getattr(k, 'key', None) for k in path]
    if len(keys) == 4 and keys[0] == 'layers' and keys[3] == 'kernel':
      return per_unit[keys[1]][keys[2]]
    return jnp.float32(0.0)

  return jax.tree_util.tree_map_with_path(leaf, meta.unbox(params))


def unit_kernel_shapes(config: ml_collections.ConfigDict) -> list[tuple[int, int]]:
  """[K, N] of the seven projection kernels of one layer (q, k, v, o, gate, up, down)."""
  d, heads = config.d_model, config.num_heads
  head_dim = d // heads
  kv = config.num_kv_heads * head_dim
  f = config.ffn_dim
  return [(d, heads * head_dim), (d, kv), (d, kv), (heads * head_dim, d),
          (d, f), (d, f), (f, d)]


def init_amax_history(config: ml_collections.ConfigDict, length: int) -> dict:
  """Empty amax histories for every projection unit (delayed scaling, amax_history.py).

  Returns:
    ``{'attn': {'q': f32[L, 3, length], ...}, 'mlp': {...}}``, zeros (no observation yet),
    the tree ``Transformer.__call__(amax_history=...)`` takes; its gradient is the next one.

  Example:
    >>> from gnmr_jax.model_configs import model_config
    >>> history = init_amax_history(model_config('tiny'), 16)
    >>> history['mlp']['down'].shape
    (4, 3, 16)
  """
  empty = amax_history_lib.init(length)
  return {group: {name: jnp.broadcast_to(empty, (config.num_layers,) + empty.shape)
                  for name in names} for group, names in PROJECTIONS.items()}


def _constrain_side(side):
  """Shards the side buffer's token axes like the activations'."""
  if side is None:
    return None
  return side._replace(buffer=sharding.constrain(
      side.buffer, ('batch', 'length', None)))


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32."""
  eps: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param(
        'scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
        (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


class Embed(nn.Module):
  """Token embedding lookup: table[tokens], table float32 [vocab, d_model]."""
  vocab_size: int
  init_std: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, tokens_BxS: Array, d_model: int) -> Array:
    table_VxD = self.param(
        'embedding',
        nn.with_logical_partitioning(
            nn.initializers.normal(self.init_std), ('vocab', 'embed')),
        (self.vocab_size, d_model), self.param_dtype)
    # Gather the fsdp shards of the table before the lookup, as FSDP does for
    # every weight; otherwise the partitioner must move the lookup result from
    # embed-sharded to batch-sharded, which it does by replicating it.
    table_VxD = sharding.gather_weight(
        sharding.constrain(table_VxD.astype(self.dtype), ('vocab', None)), ('vocab', 'embed'))
    if not sharding.is_explicit():
      return jnp.take(table_VxD, tokens_BxS, axis=0)
    # Explicit axes: a lookup in a vocab-sharded table has no unique output type; it gets
    # the tokens' sharding (an embedding dim of its own would need an fsdp the batch holds).
    tokens_spec = tuple(jax.typeof(tokens_BxS).sharding.spec)
    tokens_spec += (None,) * (tokens_BxS.ndim - len(tokens_spec))
    return table_VxD.at[tokens_BxS].get(
        out_sharding=jax.sharding.PartitionSpec(*tokens_spec, None))


class Projection(nn.Module):
  """A bias-free projection through the precision policy: policy.dot(x, kernel)."""
  features: int
  kernel_axes: tuple[str, str]
  init_std: float
  policy: Policy
  param_dtype: Any

  @nn.compact
  def __call__(self, x: Array, recover: Array | None = None, side: Any = None,
               history: Array | None = None) -> tuple[Array, Any]:
    kernel = self.param(
        'kernel',
        nn.with_logical_partitioning(
            nn.initializers.normal(self.init_std), self.kernel_axes),
        (x.shape[-1], self.features), self.param_dtype)
    # FSDP: the kernel's embed shards are gathered where it is used (explicit axes only;
    # under auto axes the partitioner does it).
    kernel = sharding.gather_weight(kernel, self.kernel_axes)
    # A row-parallel kernel (o, down: heads / mlp on tensor) and x both shard the
    # contraction, which has no unique output type under explicit axes; x's shards are
    # gathered, as policy.dot does for its own per-row scales (no-op otherwise).
    x = explicit_sharding.unshard_contraction(x, kernel)
    # The float32 master kernel goes to the policy: it owns the operand casts.
    # Only a policy that scales from amax histories (delayed scaling) is given one.
    extra = {'history': history} if history is not None else {}
    if side is None:
      y, side = self.policy.dot(x, kernel, recover=recover, **extra), None
    else:
      y, side = self.policy.dot_side(x, kernel, recover, side, **extra)
    if sharding.is_explicit():  # the layout the rules give y (auto axes: the partitioner's)
      y = sharding.constrain(y, ('batch', 'length', self.kernel_axes[1])[-y.ndim:])
    return y, side


def _dtypes(config) -> tuple[Any, Any]:
  return jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)


class Attention(nn.Module):
  """Causal multi-head / grouped-query attention with rotary embeddings.

  The attention itself runs the kernel `config.attention` names (gnmr_jax/attention.py);
  `interpret_kernels` runs a Pallas kernel in its interpreter (tests on a CPU).
  """
  config: ml_collections.ConfigDict
  policy: Policy
  interpret_kernels: bool = False

  @nn.compact
  def __call__(self, x_BxSxD: Array, rope: tuple[Array, Array], bits: dict,
               side: Any = None, histories: dict | None = None) -> tuple[Array, Any]:
    cfg = self.config
    dtype, param_dtype = _dtypes(cfg)
    batch, seq_len, d_model = x_BxSxD.shape
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    head_dim = d_model // heads
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

    def proj(name, features, axes, std, x, side):
      return Projection(features, axes, std, self.policy, param_dtype,
                        name=name)(x, bits.get(name), side, (histories or {}).get(name))

    q, side = proj('q', heads * head_dim, ('embed', 'heads'), cfg.init_std, x_BxSxD, side)
    k, side = proj('k', kv_heads * head_dim, ('embed', 'kv_heads'), cfg.init_std, x_BxSxD,
                   side)
    v, side = proj('v', kv_heads * head_dim, ('embed', 'kv_heads'), cfg.init_std, x_BxSxD,
                   side)
    q_BxSxHxD = sharding.constrain(
        q.reshape(batch, seq_len, heads, head_dim),
        ('batch', 'length', 'heads', 'head_dim'))
    kv_axes = ('batch', 'length', 'kv_heads', 'head_dim')
    k_BxSxKxD = sharding.constrain(
        k.reshape(batch, seq_len, kv_heads, head_dim), kv_axes)
    v_BxSxKxD = sharding.constrain(
        v.reshape(batch, seq_len, kv_heads, head_dim), kv_axes)
    q_BxSxHxD = apply_rope(q_BxSxHxD, *rope)
    k_BxSxKxD = apply_rope(k_BxSxKxD, *rope)

    impl = cfg.attention
    if impl == 'auto':  # train_loop.build resolves it for its mesh; a bare model for jax's device
      impl = attention_lib.resolve(impl, seq_len=seq_len, head_dim=head_dim, dtype=dtype)
    out_BxSxHxD = attention_lib.attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, impl,
                                          interpret=self.interpret_kernels)
    out_BxSxHD = sharding.constrain(
        out_BxSxHxD.reshape(batch, seq_len, heads * head_dim),
        ('batch', 'length', 'heads'))
    return proj('o', d_model, ('heads', 'embed'), out_std, out_BxSxHD, side)


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  config: ml_collections.ConfigDict
  policy: Policy

  @nn.compact
  def __call__(self, x_BxSxD: Array, bits: dict, side: Any = None,
               histories: dict | None = None) -> tuple[Array, Any]:
    cfg = self.config
    _, param_dtype = _dtypes(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

    def proj(name, features, axes, std, x, side):
      return Projection(features, axes, std, self.policy, param_dtype,
                        name=name)(x, bits.get(name), side, (histories or {}).get(name))

    gate, side = proj('gate', cfg.ffn_dim, ('embed', 'mlp'), cfg.init_std, x_BxSxD, side)
    up, side = proj('up', cfg.ffn_dim, ('embed', 'mlp'), cfg.init_std, x_BxSxD, side)
    hidden_BxSxF = sharding.constrain(
        nn.silu(gate) * up, ('batch', 'length', 'mlp'))
    return proj('down', cfg.d_model, ('mlp', 'embed'), out_std, hidden_BxSxF, side)


class Block(nn.Module):
  """One pre-norm decoder block; the nn.scan body.

  The carry is the residual stream and the policy's side state (None unless
  the routed policy keeps recovery residuals in a side buffer).
  """
  config: ml_collections.ConfigDict
  policy: Policy
  interpret_kernels: bool = False

  @nn.compact
  def __call__(self, carry: tuple[Array, Any], bits: dict | None, histories: dict | None,
               rope: tuple[Array, Array]) -> tuple[tuple[Array, Any], None]:
    cfg = self.config
    x_BxSxD, side = carry
    dtype, param_dtype = _dtypes(cfg)
    bits = bits or {'attn': {}, 'mlp': {}}
    histories = histories or {'attn': None, 'mlp': None}
    residual_axes = ('batch', 'length', 'embed')
    h = RMSNorm(cfg.norm_eps, dtype, param_dtype, name='attn_norm')(x_BxSxD)
    out, side = Attention(cfg, self.policy, self.interpret_kernels, name='attn')(
        h, rope, bits['attn'], side, histories['attn'])
    x_BxSxD = sharding.constrain(x_BxSxD + out, residual_axes)
    h = RMSNorm(cfg.norm_eps, dtype, param_dtype, name='mlp_norm')(x_BxSxD)
    out, side = Mlp(cfg, self.policy, name='mlp')(h, bits['mlp'], side, histories['mlp'])
    x_BxSxD = sharding.constrain(x_BxSxD + out, residual_axes)
    return (x_BxSxD, _constrain_side(side)), None


class Transformer(nn.Module):
  """LLaMA-2 decoder: tokens int32[B, S] -> logits float32[B, S, vocab_size].

  Attributes:
    config: a model config (see gnmr_jax.model_configs.model_config).
    policy: precision policy with `.routed` and `.dot(x, kernel, recover=None)`.
    interpret_kernels: run Pallas attention kernels in their interpreter (CPU tests of
      `config.attention='splash'`).

  Example:
    Routed int8/bf16 projections driven by the controller's mask (one unit per
    projection per layer):

    >>> import flax.linen as nn, jax, jax.numpy as jnp, gnmr_jax
    >>> from gnmr_jax.model_configs import model_config
    >>> from gnmr_jax.precision import make_policy, default_precision_config
    >>> config = model_config('tiny')
    >>> config.num_layers, config.d_model, config.ffn_dim = 2, 64, 128
    >>> model = Transformer(config, make_policy(default_precision_config()))
    >>> tokens = jnp.zeros((1, 8), jnp.int32)
    >>> params = nn.unbox(model.init(jax.random.key(0), tokens)['params'])  # plain arrays
    >>> tx = gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=8, max_o=4, t_lock=5,
    ...                    units=PROJECTION_UNITS_REGEX, layer_axis=r'^layers/')
    >>> state = tx.init(params)
    >>> int(state.telemetry.num_units)
    14
    >>> model.apply({'params': params}, tokens, gnmr_jax.recovery_mask(state)).shape
    (1, 8, 256)
  """
  config: ml_collections.ConfigDict
  policy: Policy
  interpret_kernels: bool = False

  @nn.compact
  def __call__(self, tokens: Array, recovery_mask: Any = None, *, targets: Array | None = None,
               loss_weights: Array | None = None, amax_history: dict | None = None) -> Array:
    """Forward pass: the logits, or with `targets` the summed cross-entropy.

    With targets the head and the loss run fused, `config.loss_chunks` sequence chunks at a
    time (`gnmr_jax.loss.chunked_cross_entropy`), so float32 [B, S, vocab_size] logits are
    never materialised: L = sum_{b,s} w_bs (logsumexp_v z_bsv - z_{b,s,targets_bs}).

    Args:
      tokens: int32[B, S] token ids, S <= config.max_seq_len.
      recovery_mask: the controller's bool mask tree for `{'params': p}` or `p`,
        or None. Used only when `policy.routed`; otherwise no cond is emitted.
      targets: int[B, S] next-token ids, or None for the logits.
      loss_weights: [B, S] per-token weights w of the loss (float or bool), or None for
        all ones; only with `targets`.
      amax_history: the projections' amax histories (`init_amax_history`), required when
        the policy scales from them (`policy.takes_history`: precision.scaling='delayed');
        the gradient with respect to it is the next step's histories.

    Returns:
      float32[B, S, vocab_size] logits (targets None), or the float32 scalar L (mean loss:
      L / number of weighted tokens, e.g. L / targets.size).

    Raises:
      ValueError: loss_weights without targets (and chunked_cross_entropy's shape checks).
    """
    cfg = self.config
    validate_model_config(cfg)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          f'tokens must be an integer array [batch, seq], got {tokens.dtype}{tokens.shape}')
    if tokens.shape[1] > cfg.max_seq_len:
      raise ValueError(
          f'sequence length {tokens.shape[1]} exceeds model.max_seq_len={cfg.max_seq_len}')
    dtype, param_dtype = _dtypes(cfg)
    if (getattr(self.policy, 'takes_history', False) and amax_history is None
        and self.is_initializing()):  # the params do not depend on the histories
      amax_history = init_amax_history(cfg, max(self.policy.amax_history_length, 1))
    if getattr(self.policy, 'takes_history', False) and amax_history is None:
      raise ValueError('the precision policy scales from amax histories (precision.scaling='
                       "'delayed'): pass amax_history=init_amax_history(config, "
                       'precision.amax_history_length), then each step the gradient with '
                       'respect to it.')
    if amax_history is not None and not getattr(self.policy, 'takes_history', False):
      amax_history = None  # nothing scales from them (a recovery-path model of the same run)
    bits = None
    if self.policy.routed and recovery_mask is not None:
      bits = projection_recover_bits(recovery_mask, cfg.num_layers)

    x_BxSxD = Embed(cfg.vocab_size, cfg.init_std, dtype, param_dtype,
                    name='embed')(tokens, cfg.d_model)
    x_BxSxD = sharding.constrain(x_BxSxD, ('batch', 'length', 'embed'))
    rope = rope_tables(tokens.shape[1], cfg.d_model // cfg.num_heads, cfg.rope_theta)

    if cfg.scan_unroll == -1:  # per backend: train_loop.build resolves it for its mesh
      cfg = ml_collections.ConfigDict(cfg.to_dict())
      cfg.scan_unroll = static_scan_unroll(cfg, jax.devices()[0].platform)
    block = Block
    remat = {True: 'full', False: 'none'}.get(cfg.remat, cfg.remat)
    side = None
    # Under remat the residuals are recomputed in the backward pass, so per-unit storage
    # keeps nothing and a side buffer would only add its bytes (everything_saveable keeps
    # them all, as without remat).
    if (bits is not None and hasattr(self.policy, 'init_side')
        and remat in ('none', 'everything_saveable')):
      side = _constrain_side(self.policy.init_side(
          tokens.shape, unit_kernel_shapes(cfg), dtype))
    if remat != 'none':
      # Under a rolled (or partly unrolled) scan the loop keeps the forward and the backward's
      # recomputation apart and prevent_cse would only block optimisations. Fully unrolled, the
      # loop disappears and XLA merges the recomputation into the forward, keeping what remat
      # meant to drop: a routed 1B step compiled for an H100 needed 3.2x the static step's
      # temporaries (50.8 vs 15.8 GB) without it, 0.6x with it (BENCHMARKS.md).
      unrolled = not cfg.scan_layers or cfg.scan_unroll >= cfg.num_layers
      block = nn.remat(block, policy=_REMAT_POLICIES[remat], prevent_cse=unrolled)
    blocks = nn.scan(
        block,
        variable_axes={'params': LAYER_AXIS},
        split_rngs={'params': True},
        in_axes=(0, 0, nn.broadcast),
        length=cfg.num_layers,
        unroll=cfg.scan_unroll if cfg.scan_layers else cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: 'layers'},
    )(cfg, self.policy, self.interpret_kernels, name='layers')
    (x_BxSxD, side), _ = blocks((x_BxSxD, side), bits, amax_history, rope)
    if side is not None:
      # Recoveries that found the side buffer full ran the low-cost path: 0 whenever
      # the mask holds at most side_buffer_units units (the controller's max_o).
      self.sow('intermediates', 'side_buffer_dropped', side.dropped)

    x_BxSxD = RMSNorm(cfg.norm_eps, dtype, param_dtype, name='final_norm')(x_BxSxD)
    head = self.param(
        'lm_head',
        nn.with_logical_partitioning(
            nn.initializers.normal(cfg.d_model ** -0.5), ('embed', 'vocab')),
        (cfg.d_model, cfg.vocab_size), param_dtype)
    head_DxV = sharding.gather_weight(head.astype(dtype), ('embed', 'vocab'))
    if targets is not None:
      loss_sum = loss_lib.chunked_cross_entropy(x_BxSxD, head_DxV, targets, loss_weights,
                                                num_chunks=cfg.loss_chunks)
      # The side buffer's chain ends on the loss (side_buffer.attach: + 0).
      return side_buffer.attach(loss_sum, side)
    if loss_weights is not None:
      raise ValueError('loss_weights needs targets (the weights of the targets\' losses); '
                       'got loss_weights with targets=None')
    logits_BxSxV = jnp.einsum(
        'bsd,dv->bsv', x_BxSxD, head_DxV, preferred_element_type=jnp.float32)
    # The side buffer's chain ends on the logits (side_buffer.attach: + 0).
    logits_BxSxV = side_buffer.attach(logits_BxSxV, side)
    logits_BxSxV = sharding.constrain(logits_BxSxV, ('batch', 'length', 'vocab'))
    if sharding.is_explicit():
      # Explicit axes: the logits leave with the whole vocabulary on every device. The loss
      # (optax's integer-label cross entropy in train_step.py) picks the target logit with a
      # gather, which has no unique output type on a vocab-sharded array; this all-gathers
      # the tensor shards of the logits instead (auto axes: the partitioner's choice, as
      # before).
      logits_BxSxV = sharding.constrain(logits_BxSxV, ('batch', 'length', None))
    return logits_BxSxV

  @nn.nowrap
  def for_init(self) -> nn.Module:
    """`for_init(self)`: what `sharding.init_unboxed` initialises (it asks the model, so the
    sharding helpers do not import the model)."""
    return for_init(self)


def for_init(model: nn.Module) -> nn.Module:
  """The module whose `init` gives `model`'s params with the least to compile.

  A Transformer's layer scan is unrolled for routing (`scan_unroll`, `scan_layers=False`), and
  `init` runs the forward pass, so the unrolled init program grows with depth. `nn.scan` splits
  the params rng per layer however far the scan is unrolled, so the same Transformer with its
  scan rolled (unroll 1) creates the same params bit for bit from a program of one layer
  (CPU, the runlocal model at 8 layers: 25k -> 5k HLO lines, 6.6 -> 1.9 s to compile). Any
  other module comes back as it is.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from gnmr_jax.model_configs import model_config
    >>> from gnmr_jax.precision import make_policy, default_precision_config
    >>> config = model_config('tiny')
    >>> config.scan_unroll = config.num_layers       # fully unrolled, as routing wants
    >>> model = Transformer(config, make_policy(default_precision_config()))
    >>> rolled = for_init(model)
    >>> rolled.config.scan_unroll, model.config.scan_unroll
    (1, 4)
    >>> tokens, key = jnp.zeros((1, 8), jnp.int32), jax.random.key(0)
    >>> same = jax.tree.map(np.array_equal, rolled.init(key, tokens), model.init(key, tokens))
    >>> all(jax.tree.leaves(same))
    True
  """
  if not isinstance(model, Transformer):
    return model
  config = model.config
  if config.scan_layers and config.scan_unroll == 1:
    return model
  rolled = ml_collections.ConfigDict(config.to_dict())
  rolled.scan_layers, rolled.scan_unroll = True, 1
  return model.clone(config=rolled)
