"""Tests for gnmr_jax.loss: the chunked head + cross-entropy against float64 NumPy and optax.

Tolerances (tests/tolerances.py's models; u = eps / 2 the unit roundoff). For a float32
program on inputs exactly representable in float32 (bfloat16 inputs are, and their products
are exact in float32: 8 + 8 significant bits):
* logits: |dz_bsv| <= gamma_D (|x| @ |head|)_bsv (one D-term dot product);
* a token's loss lse - z_t: both terms move by at most max_v |dz_bsv| (lse is 1-Lipschitz in
  the max norm), lse's own sum of V exponentials adds gamma_{V+2} (the sum, exp, log), and
  the subtractions of the max and of z_t round relative to max_v |z_bsv| (2 eps of it);
  call this e_bs. The loss: sum_bs |w| e_bs + gamma_{BS} sum_bs |w l| (the sum over tokens);
* dlogits = w (p - onehot) with p = exp(z - lse): the exponent is off by at most e_bs, so
  |dp| <= p expm1(e_bs + eps) (with exp's rounding), and p - onehot, times w, round once
  each: |d dlogits| <= |w| (p expm1(e_bs + eps) + tiny) + eps |dlogits| (tiny: a p below
  the smallest normal float32 may be flushed to 0, as with |logits| ~ 1e4). In bfloat16 the dlogits are
  rounded to bf16 before the gradient GEMMs: + u_bf16 |dlogits| = 2^-8 |dlogits|;
* dx = dlogits @ head^T: the dlogits' error carried through, |d dlogits| @ |head|^T, plus the
  V-term dot's gamma_V (|dlogits| @ |head|^T); dhead = sum_chunks x^T dlogits: |x|^T
  |d dlogits| plus gamma_{BS} (|x|^T |dlogits|) (B*S terms accumulated in float32 in any
  order, chunk after chunk). A bfloat16 result is rounded once more: + u_bf16 |result|,
  the result being within the bound above of the float64 value.
Two float32 programs (ours and optax's) each lie within their bound of the exact value, so
they differ by at most the sum of the two bounds.
"""
import re
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gnmr_jax import precision, sharding
from gnmr_jax.loss import chunked_cross_entropy, chunked_token_losses
from gnmr_jax.model import PROJECTIONS, Transformer
from gnmr_jax.model_configs import model_config
from tests.tolerances import (BF16_EPS, F32_EPS, assert_allclose, chain_ulps, f32_atol, gamma,
                              transformer_reductions)

B, S, D, V = 2, 12, 16, 40
U_BF16 = BF16_EPS / 2  # unit roundoff of bfloat16, 2^-8
# Smallest normal float32: a probability below it may come out 0 (XLA flushes subnormals).
F32_TINY = float(np.finfo(np.float32).tiny)


class Reference(NamedTuple):
  """float64 values at the given (already rounded) inputs."""
  loss: float
  losses_BxS: np.ndarray
  dx_BxSxD: np.ndarray
  dhead_DxV: np.ndarray
  logits_BxSxV: np.ndarray
  probs_BxSxV: np.ndarray
  dlogits_BxSxV: np.ndarray


def reference(x_BxSxD, head_DxV, targets_BxS, weights_BxS) -> Reference:
  x, head = np.asarray(x_BxSxD, np.float64), np.asarray(head_DxV, np.float64)
  w = np.asarray(weights_BxS, np.float64)
  targets = np.asarray(targets_BxS)
  logits = x @ head
  top = logits.max(-1, keepdims=True)
  lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
  losses = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  probs = np.exp(logits - lse[..., None])
  dlogits = w[..., None] * (probs - np.eye(head.shape[1])[targets])
  return Reference(loss=float((w * losses).sum()), losses_BxS=losses,
                   dx_BxSxD=dlogits @ head.T, dhead_DxV=np.einsum('bsd,bsv->dv', x, dlogits),
                   logits_BxSxV=logits, probs_BxSxV=probs, dlogits_BxSxV=dlogits)


class Bounds(NamedTuple):
  loss: float
  losses_BxS: np.ndarray
  dx_BxSxD: np.ndarray
  dhead_DxV: np.ndarray


def bounds(ref: Reference, x_BxSxD, head_DxV, weights_BxS, *, dlogits_u=0.0, out_u=0.0
           ) -> Bounds:
  """Elementwise bounds of a float32-accumulating program against `ref` (module docstring).

  dlogits_u: unit roundoff of the dlogits fed to the gradient GEMMs (0: float32, kept);
  out_u: unit roundoff of the returned gradients' dtype (0: float32).
  """
  ax = np.abs(np.asarray(x_BxSxD, np.float64))
  ah = np.abs(np.asarray(head_DxV, np.float64))
  aw = np.abs(np.asarray(weights_BxS, np.float64))
  d, v = ah.shape
  tokens = aw.size
  dz_BxSxV = gamma(d) * (ax @ ah)
  e_BxS = (2 * dz_BxSxV.max(-1) + gamma(v + 2)
           + 2 * F32_EPS * np.abs(ref.logits_BxSxV).max(-1))
  loss = float((aw * e_BxS).sum() + gamma(tokens) * np.abs(ref.losses_BxS * aw).sum())
  adl = np.abs(ref.dlogits_BxSxV)
  ddl = (aw[..., None] * (ref.probs_BxSxV * np.expm1(e_BxS[..., None] + F32_EPS) + F32_TINY)
         + (F32_EPS + dlogits_u) * adl)
  dx = ddl @ ah.T + gamma(v) * (adl @ ah.T)
  dhead = np.einsum('bsd,bsv->dv', ax, ddl) + gamma(tokens) * np.einsum('bsd,bsv->dv', ax, adl)
  # The final rounding is relative to the computed value, |ref| + its error above.
  dx = dx + out_u * (np.abs(ref.dx_BxSxD) + dx)
  dhead = dhead + out_u * (np.abs(ref.dhead_DxV) + dhead)
  return Bounds(loss, e_BxS, dx, dhead)


def inputs(dtype=jnp.float32, seq=S, vocab=V, scale=1.0, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = (scale * jax.random.normal(keys[0], (B, seq, D))).astype(dtype)
  head = (jax.random.normal(keys[1], (D, vocab)) / np.sqrt(D)).astype(dtype)
  targets = jax.random.randint(keys[2], (B, seq), 0, vocab)
  # Weights in [0, 2), a quarter of them exactly 0 (masked tokens).
  u = jax.random.uniform(keys[3], (B, seq))
  weights = jnp.where(u < 0.25, 0.0, 2 * u)
  return x, head, targets, weights


def chunked_value_and_grads(x, head, targets, weights, num_chunks):
  """(loss, dx, dhead) of the differentiated program, and the loss of the forward-only one
  (no differentiation: the primal, without the gradient GEMMs)."""
  f = lambda x, head: chunked_cross_entropy(x, head, targets, weights, num_chunks=num_chunks)
  loss, (dx, dhead) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, head)
  return loss, dx, dhead, jax.jit(f)(x, head)


def optax_value_and_grads(x, head, targets, weights):
  """Today's path: float32 logits [B, S, V], then optax's integer-label cross entropy."""
  def f(x, head):
    logits = jnp.einsum('bsd,dv->bsv', x, head, preferred_element_type=jnp.float32)
    return jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(logits, targets))
  loss, (dx, dhead) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, head)
  return loss, dx, dhead


def check(got, ref: Reference, tol: Bounds, what: str):
  loss, dx, dhead = got[:3]
  for forward_only in got[3:]:
    assert_allclose(forward_only, ref.loss, atol=tol.loss, err_msg=f'{what}: forward-only loss')
  assert np.isfinite(np.asarray(loss)) and np.all(np.isfinite(np.asarray(dx, np.float32)))
  assert np.all(np.isfinite(np.asarray(dhead, np.float32)))
  assert_allclose(loss, ref.loss, atol=tol.loss, err_msg=f'{what}: loss')
  assert_allclose(np.asarray(dx, np.float32), ref.dx_BxSxD, atol=tol.dx_BxSxD,
                  err_msg=f'{what}: dx')
  assert_allclose(np.asarray(dhead, np.float32), ref.dhead_DxV, atol=tol.dhead_DxV,
                  err_msg=f'{what}: dhead')


def combined(a: Bounds, b: Bounds) -> Bounds:
  return Bounds(*(p + q for p, q in zip(a, b)))


def check_pair(got, want, tol: Bounds):
  """Two programs each within `tol` of the float64 values: within the sum of theirs apart."""
  atols = (tol.loss, tol.dx_BxSxD, tol.dhead_DxV)
  for a, b, t, name in zip(got, want, atols, ('loss', 'dx', 'dhead')):
    assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=t,
                    err_msg=f'against optax: {name}')


# chunks: one; dividing S; not dividing S (padded); S; more than S (clamped), weighted or not.
@pytest.mark.parametrize('num_chunks, weighted', [(1, False), (3, True), (5, False),
                                                  (12, True), (20, False)])
def test_float32_matches_float64_and_optax(num_chunks, weighted):
  x, head, targets, weights = inputs()
  if not weighted:
    weights = jnp.ones((B, S), jnp.float32)
  got = chunked_value_and_grads(x, head, targets, weights if weighted else None, num_chunks)
  assert got[0].dtype == jnp.float32 and got[1].dtype == x.dtype and got[2].dtype == head.dtype
  ref = reference(x, head, targets, weights)
  tol = bounds(ref, x, head, weights)
  check(got, ref, tol, 'float64')
  want = optax_value_and_grads(x, head, targets, weights)
  check(want, ref, tol, 'optax vs float64')
  both = combined(tol, tol)
  check_pair(got, want, both)


@pytest.mark.parametrize('num_chunks', [1, 5])
def test_bfloat16_matches_float64_and_optax(num_chunks):
  x, head, targets, weights = inputs(jnp.bfloat16, seed=2)
  got = chunked_value_and_grads(x, head, targets, weights, num_chunks)
  assert got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.bfloat16
  ref = reference(x, head, targets, weights)  # at the bf16 inputs, exactly
  # Ours: dlogits rounded to bf16 for the two gradient GEMMs, gradients returned in bf16.
  ours = bounds(ref, x, head, weights, dlogits_u=U_BF16, out_u=U_BF16)
  check(got, ref, ours, 'float64')
  # optax's path: float32 dlogits in the (mixed) gradient GEMMs, gradients returned in bf16.
  theirs = bounds(ref, x, head, weights, out_u=U_BF16)
  want = optax_value_and_grads(x, head, targets, weights)
  check(want, ref, theirs, 'optax vs float64')
  both = combined(ours, theirs)
  check_pair(got, want, both)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_extreme_logits_stay_finite(dtype):
  # |logits| ~ 1e4: exp would overflow without the max subtracted; softmax is one-hot-like.
  x, head, targets, weights = inputs(dtype, scale=3e3, seed=3)
  got = chunked_value_and_grads(x, head, targets, weights, 5)
  ref = reference(x, head, targets, weights)
  assert np.abs(ref.logits_BxSxV).max() > 1e3
  u = U_BF16 if dtype == jnp.bfloat16 else 0.0
  check(got, ref, bounds(ref, x, head, weights, dlogits_u=u, out_u=u), 'float64')


def test_cotangent_scales_the_gradients():
  # The backward is a scale of the forward's gradients by the cotangent (here 1 / 7).
  x, head, targets, weights = inputs(seed=4)
  f = lambda x, head: chunked_cross_entropy(x, head, targets, weights, num_chunks=5) / 7
  dx, dhead = jax.jit(jax.grad(f, argnums=(0, 1)))(x, head)
  ref = reference(x, head, targets, weights)
  tol = bounds(ref, x, head, weights)
  # The scale rounds once more (u of the result) on top of the gradients' bounds / 7.
  assert_allclose(dx, ref.dx_BxSxD / 7, atol=tol.dx_BxSxD / 7 + F32_EPS * np.abs(ref.dx_BxSxD))
  assert_allclose(dhead, ref.dhead_DxV / 7,
                  atol=tol.dhead_DxV / 7 + F32_EPS * np.abs(ref.dhead_DxV))


def test_targets_and_weights_get_no_gradient():
  x, head, targets, weights = inputs()
  dweights = jax.grad(lambda w: chunked_cross_entropy(x, head, targets, w, num_chunks=3))(
      weights)
  np.testing.assert_array_equal(dweights, 0.0)
  bool_weights = weights > 0
  got = jax.jit(lambda w: chunked_cross_entropy(x, head, targets, w, num_chunks=3))(
      bool_weights)
  ref = reference(x, head, targets, bool_weights)
  assert_allclose(got, ref.loss, atol=bounds(ref, x, head, bool_weights).loss)


@pytest.mark.parametrize('num_chunks', [1, 5])
def test_token_losses(num_chunks):
  x, head, targets, weights = inputs(seed=5)
  got = jax.jit(lambda x, h, t: chunked_token_losses(x, h, t, num_chunks=num_chunks))(
      x, head, targets)
  assert got.shape == (B, S) and got.dtype == jnp.float32
  ref = reference(x, head, targets, weights)
  assert_allclose(got, ref.losses_BxS, atol=bounds(ref, x, head, weights).losses_BxS)


@pytest.mark.parametrize('call, match', [
    (lambda x, h, t: chunked_cross_entropy(x, h, t, num_chunks=0), 'num_chunks'),
    (lambda x, h, t: chunked_cross_entropy(x, h, t, num_chunks=2.0), 'num_chunks'),
    (lambda x, h, t: chunked_cross_entropy(x, h, t, num_chunks=True), 'num_chunks'),
    (lambda x, h, t: chunked_cross_entropy(x[0], h, t, num_chunks=1), 'x_BxSxD'),
    (lambda x, h, t: chunked_cross_entropy(x, h.T, t, num_chunks=1), 'head_DxV'),
    (lambda x, h, t: chunked_cross_entropy(x, h, t.astype(jnp.float32), num_chunks=1),
     'targets_BxS must be an integer'),
    (lambda x, h, t: chunked_cross_entropy(x, h, t[:, 1:], num_chunks=1), 'targets_BxS'),
    (lambda x, h, t: chunked_cross_entropy(x, h, t, jnp.ones((B, S + 1)), num_chunks=1),
     'weights_BxS'),
    (lambda x, h, t: chunked_token_losses(x, h, t, num_chunks=-1), 'num_chunks'),
    (lambda x, h, t: chunked_token_losses(x.astype(jnp.int32), h, t, num_chunks=1),
     'x_BxSxD must be a float'),
])
def test_argument_errors(call, match):
  x, head, targets, _ = inputs()
  with pytest.raises(ValueError, match=match):
    call(x, head, targets)


def _vocab_shapes(hlo: str, vocab: int) -> set:
  return set(re.findall(rf'f32\[[0-9,]*\b{vocab}\]', hlo))


def test_compiled_gradient_holds_one_chunk_of_logits():
  # A vocabulary size that no other dimension has, so every array with it is a logits array.
  vocab, seq, num_chunks = 1013, 24, 4
  x, head, targets, weights = inputs(seq=seq, vocab=vocab)
  whole = {f'f32[{B},{seq},{vocab}]', f'f32[{B * seq},{vocab}]'}
  chunk = {f'f32[{B},{seq // num_chunks},{vocab}]', f'f32[{B * seq // num_chunks},{vocab}]'}

  def grad_hlo(loss_fn):
    grad = jax.grad(loss_fn, argnums=(0, 1))
    return jax.jit(grad).lower(x, head).compile().as_text()

  hlo = grad_hlo(lambda x, h: chunked_cross_entropy(x, h, targets, weights,
                                                    num_chunks=num_chunks))
  shapes = _vocab_shapes(hlo, vocab)
  assert not shapes & whole, shapes
  assert shapes & chunk, shapes
  # The check can fail: today's path (whole float32 logits, then optax) has them.
  baseline = grad_hlo(lambda x, h: jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(
      jnp.einsum('bsd,dv->bsv', x, h, preferred_element_type=jnp.float32), targets)))
  assert _vocab_shapes(baseline, vocab) & whole


@pytest.mark.parametrize('axis_types', ['explicit', 'auto'])
def test_sharded_equals_unsharded(axis_types):
  # (data, fsdp, tensor) = (2, 2, 2): the batch over 4 devices, the vocabulary over 2.
  batch, num_chunks = 8, 5
  keys = jax.random.split(jax.random.key(6), 4)
  x = jax.random.normal(keys[0], (batch, S, D))
  head = jax.random.normal(keys[1], (D, V)) / np.sqrt(D)
  targets = jax.random.randint(keys[2], (batch, S), 0, V)
  weights = jax.random.uniform(keys[3], (batch, S))
  f = lambda x, h, t, w: chunked_cross_entropy(x, h, t, w, num_chunks=num_chunks)
  step = jax.value_and_grad(f, argnums=(0, 1))
  tokens = jax.jit(lambda x, h, t: chunked_token_losses(x, h, t, num_chunks=num_chunks))
  want, want_tokens = jax.jit(step)(x, head, targets, weights), tokens(x, head, targets)

  mesh = sharding.make_mesh(ml_collections.ConfigDict(
      dict(data=2, fsdp=2, tensor=2, axis_types=axis_types)))
  rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
  with sharding.activation_sharding(mesh):
    args = (jax.device_put(x, rows), jax.device_put(head, NamedSharding(mesh, P(None, 'tensor'))),
            jax.device_put(targets, rows), jax.device_put(weights, rows))
    loss, (dx, dhead) = jax.jit(step)(*args)
    got_tokens = tokens(*args[:3])
    unweighted = jax.jit(lambda x, h, t: chunked_cross_entropy(x, h, t, num_chunks=num_chunks))(
        *args[:3])
  assert dx.sharding.spec[0] == sharding.BATCH_AXES
  assert tuple(dhead.sharding.spec) == (None, 'tensor')
  ref = reference(x, head, targets, weights)
  tol = bounds(ref, x, head, weights)  # each program within tol of float64: 2 tol apart
  assert_allclose(loss, want[0], atol=2 * tol.loss)
  assert_allclose(dx, want[1][0], atol=2 * tol.dx_BxSxD)
  assert_allclose(dhead, want[1][1], atol=2 * tol.dhead_DxV)
  assert_allclose(got_tokens, want_tokens, atol=2 * tol.losses_BxS)
  # Weights None (ones, created with the targets' sharding): the sum of the token losses.
  ones = np.ones((batch, S))
  assert_allclose(unweighted, np.sum(ref.losses_BxS),
                  atol=bounds(ref, x, head, ones).loss)


# --- the Transformer's targets path (gnmr_jax.model) -------------------------------------------

MODEL_SEQ = 13  # loss_chunks=5: chunks of 3 positions, the last padded with 2


class F32Policy:
  routed = False

  def dot(self, x, kernel, recover=None):
    return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32
                   ).astype(x.dtype)


def small_model_config(**overrides):
  cfg = model_config('tiny')
  # A vocabulary size no other dimension has (the compiled-program check below).
  cfg.update(dict(vocab_size=67, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_dim=48, max_seq_len=16, init_std=0.2, loss_chunks=5))
  cfg.update(overrides)
  return cfg


def test_model_targets_path_matches_the_logits_path():
  cfg = small_model_config(num_layers=1)
  model = Transformer(cfg, F32Policy())
  keys = jax.random.split(jax.random.key(7), 4)
  tokens = jax.random.randint(keys[0], (B, MODEL_SEQ), 0, cfg.vocab_size)
  targets = jax.random.randint(keys[1], (B, MODEL_SEQ), 0, cfg.vocab_size)
  weights = jax.random.uniform(keys[2], (B, MODEL_SEQ))
  params = jax.jit(lambda key: nn.unbox(model.init(key, tokens)['params']))(keys[3])

  fused = lambda p: model.apply({'params': p}, tokens, targets=targets, loss_weights=weights)
  def from_logits(p):
    logits = model.apply({'params': p}, tokens)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(weights * losses), logits

  compiled = jax.jit(jax.value_and_grad(fused)).lower(params).compile()
  shapes = _vocab_shapes(compiled.as_text(), cfg.vocab_size)
  assert not shapes & {f'f32[{B},{MODEL_SEQ},67]', f'f32[{B * MODEL_SEQ},67]'}, shapes
  loss, grads = compiled(params)
  (want_loss, logits), want_grads = jax.jit(jax.value_and_grad(from_logits, has_aux=True))(params)
  # Two float32 programs of the same math (tests/tolerances.py's chain model): a logit drifts
  # by forward_ulps eps of max|logits|; a token's loss by twice that plus its V-term sum;
  # the loss sums B * S of them.
  forward_ulps = chain_ulps(transformer_reductions(cfg, MODEL_SEQ))
  token_atol = 2 * f32_atol(logits, forward_ulps + chain_ulps([cfg.vocab_size]))
  assert_allclose(loss, want_loss, atol=float(np.sum(np.abs(weights))) * token_atol
                  + f32_atol(want_loss, chain_ulps([weights.size])))
  # Gradients run the chain back again, after the V-term softmax and before the weight
  # gradients' sum over the B * S tokens (as tests/test_model.py); per leaf, in eps of its max.
  ulps = 2 * forward_ulps + chain_ulps([cfg.vocab_size, weights.size])
  jax.tree.map(lambda a, b: assert_allclose(a, b, atol=f32_atol(b, ulps)), grads, want_grads)
  assert np.max(np.abs(grads['layers']['mlp']['down']['kernel'])) > 1e-4
  # The logits path is unchanged without targets; weights need targets.
  assert logits.shape == (B, MODEL_SEQ, cfg.vocab_size)
  with pytest.raises(ValueError, match='loss_weights needs targets'):
    jax.eval_shape(lambda p: model.apply({'params': p}, tokens, loss_weights=weights), params)


def test_model_targets_path_with_a_side_buffer_matches_per_unit_storage():
  # The side buffer's chain ends on the loss (side_buffer.attach): its gradients must be
  # those of per-unit storage bit for bit, as on the logits path (test_precision_side_buffer).
  cfg = small_model_config(vocab_size=64, num_layers=1)
  tokens = jax.random.randint(jax.random.key(8), (B, 12), 0, cfg.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)
  mask = {'layers': {group: {name: {'kernel': jnp.array([name in ('q', 'down')])}
                             for name in names} for group, names in PROJECTIONS.items()}}

  def loss_and_grads(storage):
    config = precision.default_precision_config()
    config.update({'mode': 'gnmr', 'recovery_storage': storage,
                   'low_cost_path': 'saved_activation', 'recovery_path': 'saved_activation'})
    model = Transformer(cfg, precision.make_policy(config, max_recovered=2))
    params = jax.jit(lambda key: nn.unbox(model.init(key, tokens)['params']))(jax.random.key(1))

    def loss(p):
      total, sown = model.apply({'params': p}, tokens, mask, targets=targets,
                                mutable=['intermediates'])
      return total / targets.size, 'side_buffer_dropped' in sown.get('intermediates', {})
    (value, has_side_buffer), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert has_side_buffer == (storage == 'side_buffer')
    return value, grads

  (loss, grads), (want_loss, want_grads) = loss_and_grads('side_buffer'), loss_and_grads(
      'per_unit')
  assert float(loss) == float(want_loss)
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)
