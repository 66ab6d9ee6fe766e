"""Tests for gnmr_jax.model_configs: named sizes, parameter counts, validation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax import model_configs
from gnmr_jax.model import Transformer
from gnmr_jax.model_configs import (default_seq_len, model_config, param_count,
                                     static_scan_unroll, validate_model_config)


class _Policy:
  routed = False

  def dot(self, x, kernel, recover=None):
    return x @ kernel.astype(x.dtype)


# (d_model, num_layers, num_heads, ffn_dim, params): shapes from GaLore's
# configs/llama_*.json and LLaMA-2-13B; counts from the closed-form formula
# 2*V*d + d + L*(2d + 4d^2 + 3*d*ffn) with V = 32000 and no GQA.
PAPER_SIZES = {
    '60m': (512, 8, 8, 1376, 58_073_600),
    '130m': (768, 12, 12, 2048, 134_105_856),
    '350m': (1024, 24, 16, 2736, 367_969_280),
    '1b': (2048, 24, 32, 5461, 1_339_082_752),
    '7b': (4096, 32, 32, 11008, 6_738_415_616),
    '13b': (5120, 40, 40, 13824, 13_015_864_320),
}


def _shape_param_count(cfg):
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  shapes = jax.eval_shape(
      lambda t: Transformer(cfg, _Policy()).init(jax.random.key(0), t), tokens)
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(shapes)))


@pytest.mark.parametrize('name', sorted(PAPER_SIZES))
def test_paper_sizes(name):
  cfg = model_config(name)
  d_model, layers, heads, ffn, count = PAPER_SIZES[name]
  assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.ffn_dim) == (
      d_model, layers, heads, ffn)
  # LLaMA-2's context accepted; the literature's 256 tokens trained by default.
  assert (cfg.vocab_size, cfg.max_seq_len, cfg.num_kv_heads) == (32000, 4096, heads)
  assert default_seq_len(name) == 256
  assert (cfg.attention, cfg.loss_chunks) == ('auto', 16)
  assert param_count(cfg) == count
  assert _shape_param_count(cfg) == count


@pytest.mark.parametrize('name, low, high', [('tiny', 3e6, 4e6), ('small', 20e6, 30e6)])
def test_dev_sizes(name, low, high):
  cfg = model_config(name)
  assert cfg.vocab_size == 256
  assert low < param_count(cfg) == _shape_param_count(cfg) < high


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match="'tiny', 'small', '60m'|tiny, small, 60m"):
    model_config('65m')


@pytest.mark.parametrize('overrides, field', [
    (dict(num_heads=6), 'num_heads'),
    (dict(num_kv_heads=3), 'num_kv_heads'),
    (dict(d_model=264, num_heads=8), 'head_dim'),
    (dict(scan_unroll=5), 'scan_unroll'),
    (dict(scan_unroll=0), 'scan_unroll'),
    (dict(dtype='float16'), 'dtype'),
    (dict(param_dtype='bfloat16'), 'param_dtype'),
    (dict(remat='sometimes'), 'remat'),
    (dict(norm_eps=0.0), 'norm_eps'),
    (dict(vocab_size=-1), 'vocab_size'),
    (dict(attention='flash'), 'attention'),
    (dict(loss_chunks=0), 'loss_chunks'),
])
def test_validation_names_the_field(overrides, field):
  cfg = model_config('tiny')
  cfg.update(overrides)
  with pytest.raises(ValueError, match=field):
    validate_model_config(cfg)


def test_validation_missing_and_unknown_fields():
  cfg = model_config('tiny')
  del cfg['rope_theta']
  with pytest.raises(ValueError, match='rope_theta'):
    validate_model_config(cfg)
  cfg = model_config('tiny')
  cfg.scan_unrol = 2
  with pytest.raises(ValueError, match='scan_unrol'):
    validate_model_config(cfg)


def test_every_named_config_validates():
  for name in model_configs.MODEL_NAMES:
    validate_model_config(model_config(name))


@pytest.mark.parametrize('name, platform, expect', [
    ('60m', 'gpu', 8), ('60m', 'cuda', 8), ('60m', 'tpu', 1), ('60m', 'cpu', 1),
    ('1b', 'gpu', 24), ('1b', 'tpu', 1),
])
def test_a_static_step_unrolls_its_layers_on_a_gpu_only(name, platform, expect):
  cfg = model_config(name)
  assert cfg.scan_unroll == -1
  assert static_scan_unroll(cfg, platform) == expect
  cfg.scan_unroll = 2  # a layout asked for is kept everywhere
  assert static_scan_unroll(cfg, platform) == 2
