"""gnmr_jax.lora (scenario 3): INT8 base storage, merge, and the adapter chain rule."""

import jax
import jax.numpy as jnp
import numpy as np

from gnmr_jax import lora

L, K, N, R = 2, 6, 5, 3


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {'embed': {'embedding': jnp.asarray(rng.standard_normal((7, K)), jnp.float32)},
          'layers': {'attn': {'q': {'kernel': jnp.asarray(rng.standard_normal((L, K, N)),
                                                          jnp.float32)}},
                     'mlp': {'down': {'kernel': jnp.asarray(rng.standard_normal((L, N, K)),
                                                            jnp.float32)}}}}


def test_quantize_base_int8_matches_per_output_channel_reference():
  params = _params()
  out = lora.quantize_base_int8(params)
  w = np.asarray(params['layers']['attn']['q']['kernel'], np.float64)
  scale = np.max(np.abs(w), axis=1, keepdims=True) / 127.0
  np.testing.assert_allclose(out['layers']['attn']['q']['kernel'],
                             np.round(w / scale) * scale, rtol=1e-6, atol=1e-7)
  assert len(np.unique(np.asarray(out['layers']['attn']['q']['kernel'])[0, :, 0])) <= 255
  np.testing.assert_array_equal(out['embed']['embedding'], params['embed']['embedding'])


def test_adapter_grads_equal_autodiff_through_merge():
  params = _params(1)
  adapters = lora.init_adapters(params, R, jax.random.key(0))
  assert set(adapters) == {'layers/attn/q/kernel', 'layers/mlp/down/kernel'}
  # Non-zero B so both chain-rule terms are exercised.
  adapters = {k: lora.Adapter(a.a, a.b + 0.1 * jnp.ones_like(a.b)) for k, a in adapters.items()}
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, K)), jnp.float32)
  scale = 2.0

  def loss(p):
    h = jnp.tanh(jnp.einsum('bk,kn->bn', x, p['layers']['attn']['q']['kernel'][0]))
    y = jnp.einsum('bn,nk->bk', h, p['layers']['mlp']['down']['kernel'][1])
    return jnp.sum(jnp.sin(y))

  want = jax.grad(lambda ad: loss(lora.merge(params, ad, scale)))(adapters)
  kernel_grads = jax.grad(loss)(lora.merge(params, adapters, scale))
  got = jax.jit(lora.adapter_grads, static_argnums=2)(kernel_grads, adapters, scale)
  for name in adapters:
    np.testing.assert_allclose(got[name].a, want[name].a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[name].b, want[name].b, rtol=1e-5, atol=1e-6)
  # Merge: W + s A B, computed in float64.
  merged = lora.merge(params, adapters, scale)
  ad = adapters['layers/attn/q/kernel']
  ref = (np.asarray(params['layers']['attn']['q']['kernel'], np.float64)
         + scale * np.einsum('lkr,lrn->lkn', np.asarray(ad.a, np.float64),
                             np.asarray(ad.b, np.float64)))
  np.testing.assert_allclose(merged['layers']['attn']['q']['kernel'], ref, rtol=1e-5, atol=1e-6)
