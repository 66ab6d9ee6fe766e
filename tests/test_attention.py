"""gnmr_jax.attention: the resolution per device, the reference against float64, and Pallas
splash attention (in its interpreter) against the reference, alone, sharded and in the model."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax import attention, sharding
from gnmr_jax.model import Transformer
from gnmr_jax.model_configs import model_config

CPU = jax.devices('cpu')[0]


def fake_device(platform, kind, capability=None):
  device = types.SimpleNamespace(platform=platform, device_kind=kind)
  if capability is not None:
    device.compute_capability = capability
  return device


H100 = fake_device('gpu', 'NVIDIA H100 80GB HBM3', '9.0')
A100 = fake_device('gpu', 'NVIDIA A100-SXM4-40GB', '8.0')
T4 = fake_device('gpu', 'Tesla T4', '7.5')
V5E = fake_device('tpu', 'TPU v5 lite')


@pytest.mark.parametrize('device, seq_len, head_dim, dtype, expect', [
    (CPU, 256, 64, 'bfloat16', 'xla'),
    (H100, 256, 64, 'bfloat16', 'cudnn'),
    (A100, 2048, 128, 'bfloat16', 'cudnn'),
    (T4, 256, 64, 'bfloat16', 'xla'),          # cuDNN SDPA needs compute capability 8.0
    (H100, 256, 64, 'float32', 'xla'),         # cuDNN flash attention takes bf16 / fp16
    (H100, 256, 256, 'bfloat16', 'xla'),       # head dim over 128
    (H100, 256, 60, 'bfloat16', 'xla'),        # head dim not a multiple of 8
    (V5E, 256, 64, 'bfloat16', 'splash'),
    (V5E, 256, 64, 'float32', 'splash'),
    (V5E, 200, 64, 'bfloat16', 'xla'),         # not a multiple of the 128 block
])
def test_auto_resolves_to_the_kernel_the_device_runs(device, seq_len, head_dim, dtype, expect):
  assert attention.resolve('auto', device, seq_len=seq_len, head_dim=head_dim,
                           dtype=dtype) == expect


@pytest.mark.parametrize('impl, device, seq_len, match', [
    ('cudnn', CPU, 256, 'runs on NVIDIA GPUs'),
    ('cudnn', T4, 256, 'compute capability >= 8.0'),
    ('splash', H100, 256, 'TPU'),
    ('splash', V5E, 200, 'multiple of 128'),
    ('flash', CPU, 256, 'must be one of'),
])
def test_a_kernel_the_device_cannot_run_is_refused_naming_the_field(impl, device, seq_len, match):
  with pytest.raises(ValueError, match=match) as raised:
    attention.resolve(impl, device, seq_len=seq_len, head_dim=64, dtype='bfloat16')
  assert 'model.attention' in str(raised.value)


def test_explicit_kernels_resolve_to_themselves_where_they_run():
  assert attention.resolve('cudnn', H100, seq_len=256, head_dim=64, dtype='bfloat16') == 'cudnn'
  assert attention.resolve('splash', V5E, seq_len=512, head_dim=64, dtype='bfloat16') == 'splash'
  assert attention.resolve('xla', V5E, seq_len=7, head_dim=6, dtype='float32') == 'xla'
  # at least 4 blocks a side where the length allows (a causal kernel computes (n + 1) / 2n)
  assert [attention.splash_block(n) for n in (128, 256, 384, 1024, 2048, 4096)] == [
      128, 128, 128, 256, 512, 512]


def qkv(batch=2, seq_len=128, heads=4, kv_heads=2, head_dim=32, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def numpy_attention(q, k, v):
  """Causal GQA attention in float64 (query head h reads kv head h // group)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  _, seq_len, heads, head_dim = q.shape
  group = heads // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  scores = np.einsum('bshd,bthd->bhst', q, k) / np.sqrt(head_dim)
  scores = np.where(np.tril(np.ones((seq_len, seq_len), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum('bhst,bthd->bshd', probs, v)


# An output is a convex combination of values: float32 rounding of the scores (D terms), the
# softmax (S terms) and the weighted sum (S terms) puts its error at a few ulp of max|v| times
# log-ish growth; 1e-5 absolute on unit-normal values is ~100 ulp (eps 1.2e-7), reorder-proof.
F32_ATOL = 1e-5
# bf16 operands and probabilities (8 bits of mantissa, unit roundoff 2^-9 = 2e-3): each output
# averages values carrying 2^-9 relative error with weights carrying 2^-9: 4 unit roundoffs of
# max|v| (~4 for unit normals over 128 keys) bounds it with room: 4 * 2 * 2^-9 * 4 ~= 0.06.
BF16_ATOL = 0.06


def test_the_reference_equals_a_float64_causal_gqa_attention():
  q, k, v = qkv()
  np.testing.assert_allclose(attention.attention(q, k, v, 'xla'), numpy_attention(q, k, v),
                             atol=F32_ATOL, rtol=0)


def loss_of(impl, weights, **kwargs):
  def loss(q, k, v):
    out = attention.attention(q, k, v, impl, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * weights)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize('dtype, atol', [(jnp.float32, F32_ATOL), (jnp.bfloat16, BF16_ATOL)])
def test_splash_in_its_interpreter_equals_the_reference_forward_and_gradients(dtype, atol):
  q, k, v = qkv(dtype=dtype)
  weights = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  out = attention.attention(q, k, v, 'splash', interpret=True)
  assert out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float64), numpy_attention(q, k, v),
                             atol=atol, rtol=0)
  ref_loss, ref_grads = loss_of('xla', weights)(q, k, v)
  loss, grads = loss_of('splash', weights, interpret=True)(q, k, v)
  # The loss sums B*S*H*D outputs, each within atol: their errors add at most linearly.
  np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=atol * np.sqrt(q.size) * 4)
  for name, grad, ref in zip('qkv', grads, ref_grads):
    scale = float(np.abs(np.asarray(ref, np.float64)).max())
    np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(ref, np.float64),
                               atol=atol * scale * 4, rtol=0, err_msg=f'd{name}')


@pytest.mark.parametrize('axis_type', ['auto', 'explicit'])
def test_splash_sharded_over_batch_and_heads_equals_the_unsharded_kernel(axis_type):
  mesh = jax.make_mesh((2, 2, 2), sharding.MESH_AXES,
                       axis_types=(sharding.AXIS_TYPES[axis_type],) * 3)
  q, k, v = qkv(batch=4)
  weights = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  expected = loss_of('splash', weights, interpret=True)(q, k, v)
  with sharding.activation_sharding(mesh):
    step = loss_of('splash', weights, interpret=True)
    hlo = step.lower(q, k, v).as_text()
    got = step(q, k, v)
  assert 'shard_map' in hlo or 'manual' in hlo.lower()
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
  for grad, ref in zip(got[1], expected[1]):
    np.testing.assert_allclose(grad, ref, rtol=0, atol=1e-6)


def test_the_model_with_splash_attention_equals_the_model_with_the_reference():
  config = model_config('tiny')
  config.update(dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_dim=96,
                     vocab_size=64, max_seq_len=128))

  class Float32Policy:
    routed = False

    def dot(self, x, kernel, recover=None):
      return jnp.dot(x, kernel.astype(x.dtype))

  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, 64)
  models = {}
  for impl in ('xla', 'splash'):
    cfg = model_config('tiny')
    cfg.update(config.to_dict())
    cfg.attention = impl
    models[impl] = Transformer(cfg, Float32Policy(), interpret_kernels=True)
  params = nn.unbox(models['xla'].init(jax.random.key(0), tokens)['params'])

  def loss(model):
    return jax.jit(jax.value_and_grad(lambda p: jnp.mean(
        jax.nn.logsumexp(model.apply({'params': p}, tokens), axis=-1))))

  ref_loss, ref_grads = loss(models['xla'])(params)
  got_loss, got_grads = loss(models['splash'])(params)
  np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
  for path, (grad, ref) in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                               zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads))):
    scale = float(np.abs(ref).max()) or 1.0
    np.testing.assert_allclose(grad, ref, rtol=0, atol=1e-5 * scale, err_msg=str(path[0]))
