"""Named LLaMA-2 model configurations and their validation.

The paper sizes (60m..7b) are the LLaMA shapes used in the low-precision and
memory-efficient pretraining literature: GaLore (Zhao et al., 2024, Table 9 and
github.com/jiaweizzhao/GaLore configs/llama_{60m,130m,350m,1b,7b}.json: vocab
32000, rms_norm_eps 1e-6, sequence length 256 in the experiments), reused by
Q-GaLore and COAT. 13b is Meta's LLaMA-2-13B shape (Touvron et al., 2023:
d=5120, 40 layers, 40 heads, ffn 13824, no GQA below 34B).

Example:
  >>> cfg = model_config('60m')
  >>> cfg.d_model, cfg.num_layers
  (512, 8)
"""

from __future__ import annotations

import ml_collections

# Remat policy names accepted by `remat` (besides True/False); model.py maps
# them onto jax.checkpoint_policies.
REMAT_POLICY_NAMES = (
    'none',
    'full',
    'dots_saveable',
    'dots_with_no_batch_dims_saveable',
    'everything_saveable',
)
COMPUTE_DTYPES = ('bfloat16', 'float32')
# Attention kernels accepted by `attention` (gnmr_jax/attention.py resolves 'auto' per device).
ATTENTION_IMPLS = ('auto', 'xla', 'cudnn', 'splash')
PARAM_DTYPES = ('float32',)

# name: (vocab_size, d_model, num_layers, num_heads, ffn_dim, train_seq_len, dtype); the paper
# sizes train at 256 tokens (the literature above) and accept up to LLAMA_MAX_SEQ_LEN.
_SIZES = {
    # Trains on 2 CPU cores: ~3.3M params, byte vocabulary, float32 compute.
    'tiny': (256, 256, 4, 4, 688, 256, 'float32'),
    # A few minutes on one GPU: ~25M params, byte vocabulary.
    'small': (256, 512, 8, 8, 1376, 512, 'bfloat16'),
    '60m': (32000, 512, 8, 8, 1376, 256, 'bfloat16'),
    '130m': (32000, 768, 12, 12, 2048, 256, 'bfloat16'),
    '350m': (32000, 1024, 24, 16, 2736, 256, 'bfloat16'),
    '1b': (32000, 2048, 24, 32, 5461, 256, 'bfloat16'),
    '7b': (32000, 4096, 32, 32, 11008, 256, 'bfloat16'),
    '13b': (32000, 5120, 40, 40, 13824, 256, 'bfloat16'),
}
MODEL_NAMES = tuple(_SIZES)
# LLaMA-2's context length: the longest sequence the paper sizes accept (RoPE has no table;
# flash attention keeps the memory linear in it).
LLAMA_MAX_SEQ_LEN = 4096
_BYTE_SIZES = ('tiny', 'small')


def default_seq_len(name: str) -> int:
  """The sequence length size `name` trains at by default (base_config's data.seq_len)."""
  if name not in _SIZES:
    raise ValueError(f'Unknown model size {name!r}; valid names: {", ".join(MODEL_NAMES)}')
  return _SIZES[name][5]

_FIELDS = (
    'name', 'vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads',
    'ffn_dim', 'max_seq_len', 'rope_theta', 'norm_eps', 'dtype', 'param_dtype',
    'scan_layers', 'scan_unroll', 'remat', 'init_std', 'attention', 'loss_chunks',
)


def model_config(name: str) -> ml_collections.ConfigDict:
  """Returns the model config for a named size.

  Args:
    name: one of 'tiny', 'small', '60m', '130m', '350m', '1b', '7b', '13b'.

  Returns:
    A validated `ConfigDict` with the fields documented below.

  Raises:
    ValueError: for an unknown name (the message lists the valid ones).
  """
  if name not in _SIZES:
    raise ValueError(
        f'Unknown model size {name!r}; valid names: {", ".join(MODEL_NAMES)}')
  vocab, d_model, layers, heads, ffn, seq, dtype = _SIZES[name]
  cfg = ml_collections.ConfigDict()
  # Size name, for logs and checkpoints.
  cfg.name = name
  # Number of token ids; the data pipeline's vocab_size must not exceed it.
  cfg.vocab_size = vocab
  # Residual stream width.
  cfg.d_model = d_model
  # Number of transformer blocks (the leading axis of every stacked layer param).
  cfg.num_layers = layers
  # Query heads; head_dim = d_model // num_heads.
  cfg.num_heads = heads
  # Key/value heads (grouped-query attention when < num_heads; must divide it).
  cfg.num_kv_heads = heads
  # SwiGLU hidden width.
  cfg.ffn_dim = ffn
  # Longest sequence the model accepts (RoPE has no table, so this is a guard): the training
  # length for the byte-vocabulary sizes, LLaMA-2's 4096 for the paper sizes.
  cfg.max_seq_len = seq if name in _BYTE_SIZES else max(seq, LLAMA_MAX_SEQ_LEN)
  # RoPE base frequency (LLaMA-2: 10000).
  cfg.rope_theta = 10000.0
  # RMSNorm epsilon (GaLore configs: 1e-6).
  cfg.norm_eps = 1e-6
  # Compute dtype of activations: 'bfloat16' or 'float32'. Logits are float32.
  cfg.dtype = dtype
  # Parameter (master weight) dtype.
  cfg.param_dtype = 'float32'
  # Layers are stacked with nn.scan (params get a leading [num_layers] axis).
  # False is shorthand for a fully unrolled scan (scan_unroll = num_layers);
  # the param layout is the same either way.
  cfg.scan_layers = True
  # Layers per scan iteration: 1 = rolled loop, num_layers = fully unrolled
  # (no while loop; per-unit lax.cond routing costs nothing there), k = groups;
  # -1 = per backend (static_scan_unroll; a routed step takes the precision policy's).
  cfg.scan_unroll = -1
  # Rematerialise each block in the backward pass: one of REMAT_POLICY_NAMES
  # ('none'; 'full' saves nothing inside a block). validate_model_config also
  # accepts a bool (True = 'full') for configs built by hand.
  cfg.remat = 'full' if name in ('1b', '7b', '13b') else 'none'
  # Std of the normal init (embeddings, q/k/v/gate/up); o/down use
  # init_std / sqrt(2 * num_layers); the output head uses d_model ** -0.5.
  cfg.init_std = 0.02
  # Attention kernel, one of ATTENTION_IMPLS: 'auto' resolves per device when the run is
  # built (cuDNN flash attention on GPUs of compute capability >= 8.0, Pallas splash attention
  # on TPU, 'xla' elsewhere); 'xla' is the reference (float32 scores, softmax, causal mask).
  cfg.attention = 'auto'
  # Chunks along the sequence of the fused head + cross-entropy (gnmr_jax/loss.py): the loss
  # holds float32 logits of one chunk at a time, never of the whole [batch, seq, vocab].
  # 1 = one chunk (the whole sequence's logits at once: fine for a byte vocabulary).
  cfg.loss_chunks = 1 if vocab <= 4096 else 16
  validate_model_config(cfg)
  return cfg


def _require_int(cfg, field: str, minimum: int = 1) -> int:
  value = cfg[field]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'model.{field} must be an int >= {minimum}, got {value!r}')
  return value


def _require_positive_float(cfg, field: str) -> float:
  value = cfg[field]
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f'model.{field} must be a positive number, got {value!r}')
  return float(value)


def validate_model_config(cfg: ml_collections.ConfigDict) -> None:
  """Checks a model config, raising a ValueError that names the bad field.

  Args:
    cfg: a config as returned by `model_config` (possibly edited).

  Raises:
    ValueError: a field is missing or unknown, has the wrong type, or the
      shapes are inconsistent (d_model % num_heads, num_heads % num_kv_heads,
      odd head_dim, scan_unroll outside [1, num_layers], ...).
  """
  missing = [f for f in _FIELDS if f not in cfg]
  if missing:
    raise ValueError(f'model config is missing fields {missing}')
  unknown = sorted(set(cfg.keys()) - set(_FIELDS))
  if unknown:
    raise ValueError(
        f'model config has unknown fields {unknown}; valid fields: {list(_FIELDS)}')
  for field in ('vocab_size', 'd_model', 'num_layers', 'num_heads',
                'num_kv_heads', 'ffn_dim', 'max_seq_len', 'loss_chunks'):
    _require_int(cfg, field)
  _require_int(cfg, 'scan_unroll', minimum=-1)
  for field in ('rope_theta', 'norm_eps', 'init_std'):
    _require_positive_float(cfg, field)
  if cfg.d_model % cfg.num_heads:
    raise ValueError(
        f'model.d_model={cfg.d_model} must be divisible by '
        f'model.num_heads={cfg.num_heads}')
  if (cfg.d_model // cfg.num_heads) % 2:
    raise ValueError(
        f'head_dim = model.d_model // model.num_heads = '
        f'{cfg.d_model // cfg.num_heads} must be even for rotary embeddings')
  if cfg.num_heads % cfg.num_kv_heads:
    raise ValueError(
        f'model.num_heads={cfg.num_heads} must be divisible by '
        f'model.num_kv_heads={cfg.num_kv_heads}')
  if cfg.dtype not in COMPUTE_DTYPES:
    raise ValueError(f'model.dtype must be one of {COMPUTE_DTYPES}, got {cfg.dtype!r}')
  if cfg.param_dtype not in PARAM_DTYPES:
    raise ValueError(
        f'model.param_dtype must be one of {PARAM_DTYPES}, got {cfg.param_dtype!r}')
  if cfg.attention not in ATTENTION_IMPLS:
    raise ValueError(
        f'model.attention must be one of {ATTENTION_IMPLS}, got {cfg.attention!r}')
  if not isinstance(cfg.scan_layers, bool):
    raise ValueError(f'model.scan_layers must be a bool, got {cfg.scan_layers!r}')
  if cfg.scan_unroll > cfg.num_layers or cfg.scan_unroll == 0:
    raise ValueError(
        f'model.scan_unroll={cfg.scan_unroll} must be -1 (per backend) or in [1, num_layers='
        f'{cfg.num_layers}] (1 = rolled, num_layers = fully unrolled)')
  if not isinstance(cfg.remat, bool) and cfg.remat not in REMAT_POLICY_NAMES:
    raise ValueError(
        f'model.remat must be a bool or one of {REMAT_POLICY_NAMES}, '
        f'got {cfg.remat!r}')


# scan_unroll=-1 for a static step, per platform: a GPU runs the layers unrolled, as the routed
# step does and as MaxText's H100 recipe does (scan_layers=false). A scanned GPU step pays for
# its loop in memory traffic and memory an unrolled one does not have (compiled for an H200:
# zero-filled stacked outputs and gradients, residual stacks copied in and sliced out, layout
# transposes of whole stacks; 60m without remat 1.38x the unrolled step's modelled time; 1b and
# 7b under remat ~1% slower with 18-21% more temporaries: BENCHMARKS.md), for a compile a few
# times faster. TPU and CPU stay rolled (no measurement says otherwise; an unrolled TPU step
# compiles ~2x longer).
UNROLLED_STATIC_PLATFORMS = ('gpu', 'cuda', 'rocm')


def static_scan_unroll(cfg: ml_collections.ConfigDict, platform: str) -> int:
  """The layer scan's `unroll=` for a static (unrouted) step of `cfg` on `platform`.

  `cfg.scan_unroll` itself unless it is -1 (per backend): then `num_layers` on a GPU, else 1.

  Example:
    >>> cfg = model_config('60m')
    >>> static_scan_unroll(cfg, 'gpu'), static_scan_unroll(cfg, 'tpu')
    (8, 1)
    >>> cfg.scan_unroll = 2   # a layout asked for is kept
    >>> static_scan_unroll(cfg, 'gpu')
    2
  """
  if cfg.scan_unroll != -1:
    return cfg.scan_unroll
  return cfg.num_layers if platform in UNROLLED_STATIC_PLATFORMS else 1


def param_count(cfg: ml_collections.ConfigDict) -> int:
  """Number of parameters from the shapes alone.

  V*d (embedding) + d*V (untied head) + d (final norm)
  + L * (2d (norms) + 2*d*d (q, o) + 2*d*kv_heads*head_dim (k, v) + 3*d*ffn).
  """
  d, head_dim = cfg.d_model, cfg.d_model // cfg.num_heads
  per_layer = (2 * d + 2 * d * d + 2 * d * cfg.num_kv_heads * head_dim
               + 3 * d * cfg.ffn_dim)
  return 2 * cfg.vocab_size * d + d + cfg.num_layers * per_layer
