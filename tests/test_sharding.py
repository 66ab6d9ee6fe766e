"""Tests for gnmr_jax.sharding on 8 simulated CPU devices (XLA_FLAGS in conftest.py)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gnmr_jax import sharding
from gnmr_jax.model import PROJECTIONS, Transformer
from gnmr_jax.model_configs import model_config
from tests.tolerances import assert_allclose, chain_ulps, f32_atol, transformer_reductions

BATCH, SEQ = 4, 8


class F32Policy:
  routed = False

  def dot(self, x, kernel, recover=None):
    return x @ kernel.astype(x.dtype)


class DoublingRoutedPolicy(F32Policy):
  routed = True

  def dot(self, x, kernel, recover=None):
    y = x @ kernel.astype(x.dtype)
    return y if recover is None else jax.lax.cond(recover, lambda: 2 * y, lambda: y)


def mesh_config(data, fsdp, tensor, **fields):
  return ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor, **fields))


def small_config():
  cfg = model_config('tiny')
  cfg.update(dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, ffn_dim=48, max_seq_len=SEQ, init_std=0.2))
  return cfg


@pytest.fixture(scope='module', autouse=True)
def eight_devices():
  assert jax.device_count() == 8, (
      'tests/conftest.py must set --xla_force_host_platform_device_count=8 '
      'before jax is imported')


def test_make_mesh_resolves_the_rest():
  mesh = sharding.make_mesh(mesh_config(2, -1, 2))
  assert mesh.axis_names == ('data', 'fsdp', 'tensor')
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
  assert dict(sharding.make_mesh(sharding.default_mesh_config()).shape) == {
      'data': 1, 'fsdp': 8, 'tensor': 1}


@pytest.mark.parametrize('config, match', [
    (mesh_config(2, 2, 4), '16 devices but 8'),
    (mesh_config(-1, -1, 2), 'at most one'),
    (mesh_config(3, -1, 1), 'do not divide'),
    (mesh_config(0, -1, 1), 'mesh.data'),
    (ml_collections.ConfigDict(dict(data=1, fsdp=-1)), 'tensor'),
])
def test_make_mesh_errors(config, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(config)


def test_check_model_fits_mesh():
  mesh = sharding.make_mesh(mesh_config(2, 2, 2))
  sharding.check_model_fits_mesh(small_config(), mesh, batch_size=4)
  with pytest.raises(ValueError, match='batch_size=6'):
    sharding.check_model_fits_mesh(small_config(), mesh, batch_size=6)
  cfg = small_config()
  cfg.update(dict(num_heads=2, num_kv_heads=1, d_model=16))
  with pytest.raises(ValueError, match=r'num_kv_heads=1 % tensor=2'):
    sharding.check_model_fits_mesh(cfg, mesh, batch_size=4)
  with pytest.raises(ValueError, match=r'ffn_dim=5461 % tensor=2'):
    sharding.check_model_fits_mesh(model_config('1b'), mesh, batch_size=4)
  wide_tensor = sharding.make_mesh(mesh_config(1, 1, 8))
  with pytest.raises(ValueError, match=r'num_heads=4 % tensor=8'):
    sharding.check_model_fits_mesh(small_config(), wide_tensor, batch_size=4)
  # Every paper size fits a 1 x 8 fsdp mesh.
  fsdp_mesh = sharding.make_mesh(mesh_config(1, 8, 1))
  for name in ('60m', '130m', '350m', '1b', '7b', '13b'):
    sharding.check_model_fits_mesh(model_config(name), fsdp_mesh, batch_size=8)


def test_param_shardings_follow_the_rules():
  mesh = sharding.make_mesh(mesh_config(2, 2, 2))
  shardings = sharding.param_shardings(Transformer(small_config(), F32Policy()), mesh)
  layers = shardings['layers']
  assert layers['attn']['q']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert layers['attn']['k']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert layers['attn']['o']['kernel'].spec == P(None, 'tensor', 'fsdp')
  assert layers['mlp']['down']['kernel'].spec == P(None, 'tensor', 'fsdp')
  assert layers['attn_norm']['scale'].spec == P(None, None)
  assert shardings['embed']['embedding'].spec == P('tensor', 'fsdp')
  assert shardings['lm_head'].spec == P('fsdp', 'tensor')


def _forward(cfg, policy, params, tokens, mask):
  model = Transformer(cfg, policy)
  return jax.jit(lambda p, t, m: model.apply({'params': p}, t, recovery_mask=m))(
      params, tokens, mask)


@pytest.mark.parametrize('axis_types', ['auto', 'explicit', 'explicit,auto,auto',
                                        'auto,explicit,explicit'])
@pytest.mark.parametrize('policy', [F32Policy(), DoublingRoutedPolicy()])
def test_sharded_forward_matches_single_device(policy, axis_types):
  cfg = small_config()
  mesh = sharding.make_mesh(mesh_config(2, 2, 2, axis_types=axis_types))
  rules = sharding.default_logical_rules()
  sharding.check_model_fits_mesh(cfg, mesh, BATCH)
  model = Transformer(cfg, policy)
  params = sharding.init_params(model, jax.random.key(0), mesh, rules, (BATCH, SEQ))
  q_kernel = params['layers']['attn']['q']['kernel']
  assert q_kernel.sharding.spec == P(None, 'fsdp', 'tensor')
  assert q_kernel.addressable_shards[0].data.shape == (2, 16, 16)
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, cfg.vocab_size,
                              jnp.int32)
  rng = np.random.default_rng(0)
  mask = {'layers': {g: {n: {'kernel': jnp.asarray(rng.random(cfg.num_layers) < 0.5)}
                         for n in names} for g, names in PROJECTIONS.items()}}

  # Host copies: a device_put of an explicit-sharded array keeps its mesh in its type.
  local_params = jax.tree.map(np.asarray, params)
  want = _forward(cfg, policy, local_params, tokens, mask)
  with sharding.activation_sharding(mesh, rules):
    got = _forward(cfg, policy, params,
                   jax.device_put(tokens, sharding.batch_sharding(mesh)),
                   jax.device_put(mask, sharding.replicated(mesh)))
  # Explicit axes: the model hands the loss the whole vocabulary (its integer-label gather
  # needs it there; gnmr_jax/model.py); auto axes keep the vocab-sharded logits.
  # A mixed mesh's auto axes are placed by the partitioner (its choice, not asserted).
  if len(set(mesh.axis_types)) == 1:
    vocab_axis = None if axis_types == 'explicit' else 'tensor'
    assert got.sharding.spec == P(('data', 'fsdp'), None, vocab_axis)
  # Not bit for bit: the tensor axis splits the sums into per-device partials that
  # are added in another order. Tolerance: the chain of float32 sums a logit comes
  # from (sum of sqrt(n), in eps of max|logits|; tests/tolerances.py).
  atol = f32_atol(want, chain_ulps(transformer_reductions(cfg, SEQ)))
  assert_allclose(got, want, atol=atol)
  if policy.routed:  # the mask matters (by far more than atol): the check is not vacuous
    unmasked = _forward(cfg, policy, local_params, tokens, None)
    assert np.max(np.abs(np.asarray(want) - np.asarray(unmasked))) > 100 * atol
