"""Tests for gnmr_jax.model against a float64 NumPy reference."""

import functools
import json
import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from gnmr_jax import model as model_lib
from gnmr_jax.model_configs import REMAT_POLICY_NAMES, model_config
from tests.tolerances import (BF16_EPS, F32_EPS, assert_allclose, chain_ulps, f32_atol,
                              mean_square_atol, transformer_reductions)

BATCH, SEQ = 2, 12


class StaticF32Policy:
  """Static policy stand-in: a float32 matmul, `recover` ignored."""
  routed = False

  def dot(self, x, kernel, recover=None):
    return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32
                   ).astype(x.dtype)


class DoublingRoutedPolicy:
  """Routed stand-in: a recovered unit computes 2 * x @ k, so bits are visible."""
  routed = True

  def dot(self, x, kernel, recover=None):
    kernel = kernel.astype(x.dtype)
    if recover is None:
      return x @ kernel
    return jax.lax.cond(recover, lambda: 2 * (x @ kernel), lambda: x @ kernel)


def small_config(**overrides):
  cfg = model_config('tiny')
  cfg.update(dict(vocab_size=64, d_model=32, num_layers=4, num_heads=4,
                  num_kv_heads=2, ffn_dim=48, max_seq_len=32, init_std=0.2))
  cfg.update(overrides)
  return cfg


@functools.lru_cache(maxsize=None)
def _jitted(cfg_json, policy_cls, method):
  """One jitted function per (config, policy, method), reused across tests."""
  model = model_lib.Transformer(ml_collections.ConfigDict(json.loads(cfg_json)),
                                policy_cls())
  if method == 'init':
    return jax.jit(lambda key, tokens: nn.unbox(model.init(key, tokens)['params']))
  if method == 'apply':
    return jax.jit(lambda p, t, m: model.apply({'params': p}, t, recovery_mask=m))
  loss = lambda p, t: jnp.mean(model.apply({'params': p}, t) ** 2)
  return jax.jit(jax.value_and_grad(loss))


def init_params(cfg, seed=0):
  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
  return _jitted(cfg.to_json(), StaticF32Policy, 'init')(jax.random.key(seed), tokens)


def forward(cfg, params, tokens, policy=StaticF32Policy, recovery_mask=None):
  return _jitted(cfg.to_json(), policy, 'apply')(params, tokens, recovery_mask)


def loss_and_grad(cfg, params, tokens):
  return _jitted(cfg.to_json(), StaticF32Policy, 'grad')(params, tokens)


def random_tokens(cfg, seed=1):
  return jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, cfg.vocab_size,
                            jnp.int32)


def forward_ulps(cfg):
  """Float32 drift of a logit in eps of max|logits|: the chain of sums it comes from.

  Used both for float32 vs the float64 reference and for two float32 programs of
  the same math (scan layouts, GQA vs repeated heads), which XLA fuses and
  reorders differently per program and per CPU target (tests/tolerances.py).
  """
  return chain_ulps(transformer_reductions(cfg, SEQ))


def forward_atol(cfg, logits):
  return f32_atol(logits, forward_ulps(cfg))


# ---------------------------------------------------------------- NumPy reference

def np_rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x_BxSxHxD, theta):
  """Rotation as complex multiplication of (x[i], x[i + D/2]) by e^{i p w_i}."""
  half = x_BxSxHxD.shape[-1] // 2
  z = x_BxSxHxD[..., :half] + 1j * x_BxSxHxD[..., half:]
  freqs = theta ** (-2.0 * np.arange(half) / (2 * half))
  positions = np.arange(x_BxSxHxD.shape[1])
  z = z * np.exp(1j * positions[:, None] * freqs[None, :])[None, :, None, :]
  return np.concatenate([z.real, z.imag], axis=-1)


def np_forward(cfg, params, tokens):
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  layers = p['layers']
  heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
  head_dim = cfg.d_model // heads
  batch, seq_len = tokens.shape
  x = p['embed']['embedding'][np.asarray(tokens)]
  causal = np.tril(np.ones((seq_len, seq_len), bool))
  for l in range(cfg.num_layers):
    h = np_rms_norm(x, layers['attn_norm']['scale'][l], cfg.norm_eps)
    q, k, v = (h @ layers['attn'][n]['kernel'][l] for n in 'qkv')
    q = np_rope(q.reshape(batch, seq_len, heads, head_dim), cfg.rope_theta)
    k = np_rope(k.reshape(batch, seq_len, kv_heads, head_dim), cfg.rope_theta)
    v = v.reshape(batch, seq_len, kv_heads, head_dim)
    k = np.repeat(k, heads // kv_heads, axis=2)
    v = np.repeat(v, heads // kv_heads, axis=2)
    scores = np.einsum('bshd,bthd->bhst', q, k) / np.sqrt(head_dim)
    scores = np.where(causal, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum('bhst,bthd->bshd', probs, v).reshape(batch, seq_len, -1)
    x = x + attn @ layers['attn']['o']['kernel'][l]
    h = np_rms_norm(x, layers['mlp_norm']['scale'][l], cfg.norm_eps)
    gate = h @ layers['mlp']['gate']['kernel'][l]
    up = h @ layers['mlp']['up']['kernel'][l]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ layers['mlp']['down']['kernel'][l]
  x = np_rms_norm(x, p['final_norm']['scale'], cfg.norm_eps)
  return x @ p['lm_head']


# ---------------------------------------------------------------- components

def test_rope_matches_numpy():
  x = jax.random.normal(jax.random.key(0), (2, 7, 3, 16), jnp.float32)
  sin, cos = model_lib.rope_tables(7, 16, 10000.0)
  got = jax.jit(model_lib.apply_rope)(x, sin, cos)
  want = np_rope(np.asarray(x, np.float64), 10000.0)
  # Float32 vs float64: the angle p * theta^(-2i/D) <= p <= 6 rad is off by <= 3u p
  # (pow as exp(y log theta), then the product), sin/cos add 1 ulp, and each output
  # mixes two inputs with two roundings: |err| <= 2 (1.5 * 6 + 2) eps max|x|.
  assert_allclose(got, want, atol=f32_atol(x, 2 * (1.5 * 6 + 2)))
  # Position 0 is not rotated, bit for bit: sin 0 = 0 and cos 0 = 1 are exact, so
  # x1 * 1 - x2 * 0 is x1 in any float arithmetic.
  np.testing.assert_array_equal(got[:, 0], x[:, 0])
  # Position 3 is rotated by 3 rad in its first pair: O(|x|) moves, not rounding.
  assert np.max(np.abs(got[:, 3] - x[:, 3])) > 0.5 * np.max(np.abs(x[:, 3]))


def test_rmsnorm_matches_numpy():
  norm = model_lib.RMSNorm(1e-6, jnp.float32, jnp.float32)
  x = 3.0 * jax.random.normal(jax.random.key(0), (4, 5, 24), jnp.float32)
  scale = jax.random.uniform(jax.random.key(1), (24,), jnp.float32, 0.5, 1.5)
  got = jax.jit(norm.apply)({'params': {'scale': scale}}, x)
  want = np_rms_norm(np.asarray(x, np.float64), np.asarray(scale, np.float64), 1e-6)
  # Each output is x times a positive factor, so its error is relative: the mean of
  # n = 24 squares is within (n + 2) u (gamma_n, the division, + eps), rsqrt halves
  # that and adds its own <= 2 eps (XLA's is within ~1 ulp), and two products add 2u.
  n = x.shape[-1]
  assert_allclose(got, want, rtol=((n + 2) / 4 + 3) * F32_EPS)


def test_forward_matches_numpy_reference_gqa():
  cfg = small_config()
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  logits = forward(cfg, params, tokens)
  assert logits.shape == (BATCH, SEQ, cfg.vocab_size)
  assert logits.dtype == jnp.float32
  want = np_forward(cfg, params, tokens)
  assert_allclose(logits, want, atol=forward_atol(cfg, want))
  assert np.std(want) > 0.1  # the comparison is not between two near-zero arrays


def test_param_shapes_and_layout():
  cfg = small_config()
  params = init_params(cfg)
  L, d, f = cfg.num_layers, cfg.d_model, cfg.ffn_dim
  kv = cfg.num_kv_heads * (d // cfg.num_heads)
  shapes = {
      'q': (L, d, d), 'k': (L, d, kv), 'v': (L, d, kv), 'o': (L, d, d),
      'gate': (L, d, f), 'up': (L, d, f), 'down': (L, f, d)}
  for group, names in model_lib.PROJECTIONS.items():
    for name in names:
      assert params['layers'][group][name]['kernel'].shape == shapes[name]
  assert params['embed']['embedding'].shape == (cfg.vocab_size, d)
  assert params['lm_head'].shape == (d, cfg.vocab_size)
  # Every leaf is float32 and carries logical axis names.
  variables = jax.eval_shape(
      lambda t: model_lib.Transformer(cfg, StaticF32Policy()).init(jax.random.key(0), t),
      jax.ShapeDtypeStruct((1, 4), jnp.int32))
  specs = nn.get_partition_spec(variables)['params']
  assert specs['layers']['attn']['q']['kernel'] == jax.sharding.PartitionSpec(
      'layers', 'embed', 'heads')
  assert specs['lm_head'] == jax.sharding.PartitionSpec('embed', 'vocab')
  assert all(s is not None and len(s) > 0 for s in jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


def test_init_scales():
  cfg = small_config()  # init_std 0.2, 4 layers, d_model 32
  params = init_params(cfg)
  layers = params['layers']
  # Sample std of N normal draws: relative standard error 1 / sqrt(2N), 0.9% for the
  # N = 6144 MLP kernels and 1.6% for the 2048 head entries; 5% is >= 3 of those.
  np.testing.assert_allclose(np.std(layers['mlp']['up']['kernel']), 0.2, rtol=0.05)
  np.testing.assert_allclose(np.std(layers['mlp']['down']['kernel']), 0.2 / 8 ** 0.5,
                             rtol=0.05)
  np.testing.assert_allclose(np.std(params['lm_head']), 32 ** -0.5, rtol=0.05)
  np.testing.assert_array_equal(layers['attn_norm']['scale'], 1.0)


def test_unit_regex_matches_exactly_the_projection_kernels():
  params = init_params(small_config())
  paths = ['params/' + '/'.join(k.key for k in path)
           for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  matched = sorted(p for p in paths if re.search(model_lib.PROJECTION_UNITS_REGEX, p))
  assert matched == sorted(
      f'params/layers/{g}/{n}/kernel'
      for g, names in model_lib.PROJECTIONS.items() for n in names)
  assert re.fullmatch(model_lib.PROJECTION_UNITS_REGEX, 'layers/mlp/down/kernel')
  assert re.fullmatch(model_lib.PROJECTION_UNITS_REGEX, 'params/layers/attn/q/kernel')
  assert not re.search(model_lib.PROJECTION_UNITS_REGEX, 'params/layers/attn_norm/scale')
  assert model_lib.LAYER_AXIS == 0


# ---------------------------------------------------------------- properties

def test_causal():
  cfg = small_config()
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  j = 7
  changed = tokens.at[:, j].set((tokens[:, j] + 1) % cfg.vocab_size)
  before, after = forward(cfg, params, tokens), forward(cfg, params, changed)
  # Exact: the same compiled program, and masked positions add exact zeros
  # (exp(-huge) = 0), so positions before j compute on bit-identical inputs.
  np.testing.assert_array_equal(before[:, :j], after[:, :j])
  # Later positions change by more than any float32 rounding could: a real dependence.
  assert np.all(np.max(np.abs(before[:, j:] - after[:, j:]), axis=-1)
                > forward_atol(cfg, before))


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa_cfg = small_config(num_kv_heads=2)
  mha_cfg = small_config(num_kv_heads=4)
  params = init_params(gqa_cfg)
  L, d = gqa_cfg.num_layers, gqa_cfg.d_model
  head_dim = d // gqa_cfg.num_heads
  assert params['layers']['attn']['k']['kernel'].shape == (L, d, 2 * head_dim)

  def repeat_heads(kernel):
    return jnp.repeat(kernel.reshape(L, d, 2, head_dim), 2, axis=2).reshape(L, d, d)

  mha_params = jax.tree.map(lambda a: a, params)
  for name in 'kv':
    mha_params['layers']['attn'][name] = {
        'kernel': repeat_heads(params['layers']['attn'][name]['kernel'])}
  tokens = random_tokens(gqa_cfg)
  want = forward(mha_cfg, mha_params, tokens)
  # The same math in two programs (grouped vs repeated heads): float32 reordering only.
  assert_allclose(forward(gqa_cfg, params, tokens), want, atol=forward_atol(gqa_cfg, want))


@pytest.mark.parametrize('overrides', [dict(scan_unroll=4), dict(remat='full')])
def test_layouts_give_same_logits_and_grads(overrides):
  base_cfg, cfg = small_config(), small_config(**overrides)
  params = init_params(base_cfg)
  tokens = random_tokens(base_cfg)
  (loss, grads), (base_loss, base_grads) = (
      loss_and_grad(cfg, params, tokens), loss_and_grad(base_cfg, params, tokens))
  # Not bit-identical: XLA fuses and reorders the float32 sums per layout and CPU.
  # loss = mean(z^2) of logits z within forward_atol (tests/tolerances.py).
  logits = forward(base_cfg, params, tokens)
  n = logits.size
  assert_allclose(loss, base_loss, atol=mean_square_atol(logits, forward_ulps(base_cfg)))
  # Gradients run the forward chain back again, after the loss's mean and before
  # the weight gradients' sum over the B * S tokens; per leaf, in eps of its max.
  ulps = 2 * forward_ulps(base_cfg) + chain_ulps([n, BATCH * SEQ])
  jax.tree.map(lambda a, b: assert_allclose(a, b, atol=f32_atol(b, ulps)), grads, base_grads)
  # The gradients are not vanishingly small (the loss really depends on the layers).
  assert np.max(np.abs(grads['layers']['mlp']['down']['kernel'])) > 1e-4


@pytest.mark.parametrize('overrides', [
    dict(scan_unroll=2), dict(scan_unroll=3), dict(scan_layers=False)])
def test_layouts_give_same_logits(overrides):
  base_cfg, cfg = small_config(), small_config(**overrides)
  params = init_params(base_cfg)
  tokens = random_tokens(base_cfg)
  want = forward(base_cfg, params, tokens)
  # Not bit-identical (issue 11): per layout and CPU target XLA fuses and reorders the
  # float32 sums, which moves even the smallest logits by a few eps of the largest.
  assert_allclose(forward(cfg, params, tokens), want, atol=forward_atol(base_cfg, want))


def test_every_remat_name_maps_to_a_policy():
  assert set(model_lib._REMAT_POLICIES) | {'none'} == set(REMAT_POLICY_NAMES)


def test_bfloat16_compute_close_to_float32():
  cfg32 = small_config()
  cfg16 = small_config(dtype='bfloat16')
  params = init_params(cfg32)
  tokens = random_tokens(cfg32)
  logits16 = forward(cfg16, params, tokens)
  assert logits16.dtype == jnp.float32
  ref = forward(cfg32, params, tokens)
  # Norm-wise: about 17 bfloat16 roundings per layer lie on a logit's path (activations
  # and weight casts) and 3 more outside the layers, each <= u = eps / 2 relative;
  # as a random walk they add up to sqrt(R) u, bounded here by sqrt(R) eps.
  roundings = 17 * cfg32.num_layers + 3
  err = np.linalg.norm(logits16 - ref) / np.linalg.norm(ref)
  assert 0 < err < np.sqrt(roundings) * BF16_EPS, err


# ---------------------------------------------------------------- recovery mask plumbing

def random_mask(cfg, params, seed=3):
  """Controller-shaped mask for p: bool[L] per projection, False elsewhere."""
  rng = np.random.default_rng(seed)
  mask = jax.tree.map(lambda a: np.zeros(a.shape[:1] if a.ndim == 3 else (), bool),
                      params)
  for group, names in model_lib.PROJECTIONS.items():
    for name in names:
      mask['layers'][group][name]['kernel'] = rng.random(cfg.num_layers) < 0.5
  return mask


def test_recovery_bits_reach_the_right_units():
  cfg = small_config()
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  mask = random_mask(cfg, params)
  bits = [mask['layers'][g][n]['kernel'] for g, ns in model_lib.PROJECTIONS.items()
          for n in ns]
  assert 0 < np.mean(bits) < 1
  # A recovered unit computes 2 x @ k == x @ (2 k): scale exactly those kernels.
  doubled = jax.tree.map(lambda a: a, params)
  for group, names in model_lib.PROJECTIONS.items():
    for name in names:
      scale = 1.0 + mask['layers'][group][name]['kernel'].astype(np.float32)
      doubled['layers'][group][name] = {
          'kernel': params['layers'][group][name]['kernel'] * scale[:, None, None]}
  got = forward(cfg, params, tokens, DoublingRoutedPolicy,
                {'params': jax.tree.map(jnp.asarray, mask)})
  # Float32 vs the float64 reference (doubling is exact in both): the forward chain.
  want = np_forward(cfg, doubled, tokens)
  assert_allclose(got, want, atol=forward_atol(cfg, want))
  # No mask, or a static policy: nothing is recovered.
  plain = np_forward(cfg, params, tokens)
  assert_allclose(forward(cfg, params, tokens, DoublingRoutedPolicy), plain,
                  atol=forward_atol(cfg, plain))
  assert_allclose(forward(cfg, params, tokens, StaticF32Policy, mask), plain,
                  atol=forward_atol(cfg, plain))


def test_mask_tree_for_params_or_for_variables():
  cfg = small_config()
  mask = random_mask(cfg, init_params(cfg))
  for tree in (mask, {'params': mask}):
    bits = model_lib.projection_recover_bits(tree, cfg.num_layers)
    for group, names in model_lib.PROJECTIONS.items():
      for name in names:
        assert bits[group][name].dtype == jnp.bool_
        np.testing.assert_array_equal(bits[group][name],
                                      mask['layers'][group][name]['kernel'])


def _walk_eqns(jaxpr, in_loop=False):
  """Yields (eqn, inside_scan_or_while) over a closed jaxpr, recursively."""
  for eqn in jaxpr.eqns:
    yield eqn, in_loop
    inner = in_loop or eqn.primitive.name in ('scan', 'while')
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _walk_eqns(sub, inner)


def _jaxpr(cfg, policy, params, tokens, mask):
  model = model_lib.Transformer(cfg, policy)
  return jax.make_jaxpr(lambda p, m: model.apply({'params': p}, tokens, recovery_mask=m))(
      params, mask).jaxpr


def test_routed_program_has_scalar_conds_inside_scan_and_static_has_none():
  cfg = small_config()
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  mask = jax.tree.map(jnp.asarray, random_mask(cfg, params))
  eqns = list(_walk_eqns(_jaxpr(cfg, DoublingRoutedPolicy(), params, tokens, mask)))
  conds = [(e, in_loop) for e, in_loop in eqns if e.primitive.name == 'cond']
  assert len(conds) == 7  # one per projection, in the scan body
  for eqn, in_loop in conds:
    assert in_loop
    assert eqn.invars[0].aval.shape == ()  # unbatched scalar predicate
  assert not any(e.primitive.name == 'select_n' and e.invars[0].aval.dtype == jnp.bool_
                 and e.invars[0].aval.ndim == 0 for e, _ in eqns)
  for policy, m in ((StaticF32Policy(), mask), (DoublingRoutedPolicy(), None)):
    names = {e.primitive.name for e, _ in _walk_eqns(_jaxpr(cfg, policy, params, tokens, m))}
    assert 'cond' not in names and 'scan' in names


@pytest.mark.parametrize('unroll, has_while', [(1, True), (4, False)])
def test_full_unroll_compiles_without_a_loop(unroll, has_while):
  cfg = small_config(scan_unroll=unroll)
  params = init_params(small_config())  # same params for every layout
  mask = jax.tree.map(jnp.asarray, random_mask(cfg, params))
  hlo = _jitted(cfg.to_json(), DoublingRoutedPolicy, 'apply').lower(
      params, random_tokens(cfg), mask).as_text()
  assert ('while' in hlo) == has_while
  assert hlo.count('conditional') + hlo.count('case') > 0


@pytest.mark.parametrize('overrides', [dict(scan_unroll=4), dict(scan_layers=False),
                                       dict(scan_unroll=2, remat='full')])
def test_init_with_the_scan_rolled_gives_the_unrolled_params_bit_for_bit(overrides):
  """sharding.init_unboxed initialises a Transformer with its layer scan rolled
  (model.for_init): the same params as the unrolled model's own init, from a program that
  holds one layer (a while loop) instead of num_layers copies."""
  from gnmr_jax import sharding  # pylint: disable=g-import-not-at-top
  cfg = small_config(**overrides)
  model = model_lib.Transformer(cfg, DoublingRoutedPolicy())
  rolled = model_lib.for_init(model)
  assert (rolled.config.scan_unroll, rolled.config.scan_layers) == (1, True)
  assert model.config.to_dict() == cfg.to_dict()  # the caller's model is left as it was
  tokens, key = jnp.zeros((BATCH, SEQ), jnp.int32), jax.random.key(3)
  unrolled = jax.jit(lambda k: nn.unbox(model.init(k, tokens)['params']))
  got = jax.jit(lambda k: sharding.init_unboxed(model, k, tokens))
  want = unrolled(key)
  assert jax.tree.structure(got(key)) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got(key), want)
  rolled_lines, unrolled_lines = (len(f.lower(key).compile().as_text().splitlines())
                                  for f in (got, unrolled))
  print(f'init HLO lines: rolled {rolled_lines}, unrolled {unrolled_lines}')
  assert rolled_lines < unrolled_lines  # 4 layers, fully unrolled: 5.5k vs 13.8k (CPU)
  assert model_lib.for_init(rolled) is rolled
  assert model_lib.for_init(nn.Dense(3)) == nn.Dense(3)


# ---------------------------------------------------------------- bad input

def test_bad_mask_shape_is_a_clear_error():
  cfg = small_config()
  params = init_params(cfg)
  mask = random_mask(cfg, params)
  mask['layers']['mlp']['up']['kernel'] = np.zeros((cfg.num_layers + 1,), bool)
  with pytest.raises(ValueError, match='mlp/up/kernel'):
    forward(cfg, params, random_tokens(cfg), DoublingRoutedPolicy, mask)
  del mask['layers']['attn']['q']
  with pytest.raises(ValueError, match='attn/q/kernel'):
    forward(cfg, params, random_tokens(cfg), DoublingRoutedPolicy, mask)


def test_bad_tokens_are_clear_errors():
  cfg = small_config(max_seq_len=8)
  model = model_lib.Transformer(cfg, StaticF32Policy())
  with pytest.raises(ValueError, match='max_seq_len'):
    model.init(jax.random.key(0), jnp.zeros((1, 9), jnp.int32))
  with pytest.raises(ValueError, match='integer'):
    model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.float32))
