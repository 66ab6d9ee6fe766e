"""The baseline transforms (gnmr_jax.baselines) against float64 NumPy references, jitted."""

import jax
import numpy as np
import optax
import pytest

import gnmr_jax
from gnmr_jax import baselines

SHAPES = {'a': (3, 4), 'b': (5,), 'layers': {'w': (2, 3, 3)}}


def _gradients(num_steps, seed=0, spikes=()):
  """A list of gradient trees (float32) with norm spikes at the given steps (0-based)."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(num_steps):
    scale = 20.0 if t in spikes else 1.0
    out.append(jax.tree_util.tree_map(
        lambda shape: (scale * rng.standard_normal(shape)).astype(np.float32), SHAPES,
        is_leaf=lambda x: isinstance(x, tuple)))
  return out


def _run(tx, grads):
  params = jax.tree_util.tree_map(np.zeros_like, grads[0])
  state = tx.init(params)
  update = jax.jit(tx.update)
  outs, states = [], []
  for g in grads:
    u, state = update(g, state, params)
    outs.append(u)
    states.append(state)
  return outs, states


def _global_norm(tree):
  return np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                     for x in jax.tree_util.tree_leaves(tree)))


def zclip_reference(norms, z_threshold, ema_decay, warmup, eps):
  """Per step: (factor applied to the gradient, mean, var) in float64."""
  mean = var = 0.0
  count, out = 0, []
  for norm in norms:
    if not np.isfinite(norm):
      out.append((1.0, mean, var))
      continue
    count += 1
    if count <= warmup:
      new_mean = mean + (norm - mean) / count
      var = var + ((norm - mean) * (norm - new_mean) - var) / count
      mean, factor = new_mean, 1.0
    else:
      std = np.sqrt(var + eps)
      z = (norm - mean) / std
      clipped = mean + z_threshold * std if z > z_threshold else norm
      factor = clipped / norm
      mean = ema_decay * mean + (1 - ema_decay) * clipped
      var = ema_decay * var + (1 - ema_decay) * (clipped - mean) ** 2
    out.append((factor, mean, var))
  return out


def test_zclip_matches_numpy_reference_and_clips_only_the_spikes():
  grads = _gradients(30, spikes=(15, 22))
  tx = baselines.zclip(z_threshold=2.0, ema_decay=0.9, warmup=8, eps=1e-6)
  outs, states = _run(tx, grads)
  ref = zclip_reference([_global_norm(g) for g in grads], 2.0, 0.9, 8, 1e-6)
  clipped_steps = []
  for t, (g, u, s, (factor, mean, var)) in enumerate(zip(grads, outs, states, ref)):
    for leaf_g, leaf_u in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(u)):
      np.testing.assert_allclose(leaf_u, factor * np.asarray(leaf_g, np.float64),
                                 rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(s.mean), mean, rtol=2e-5)
    np.testing.assert_allclose(float(s.var), var, rtol=2e-4)
    if factor < 1.0:
      clipped_steps.append(t)
  assert clipped_steps == [15, 22]
  assert int(states[-1].num_clipped) == 2
  assert int(states[-1].count) == 30


def test_zclip_passes_non_finite_gradients_and_keeps_statistics():
  grads = _gradients(12)
  grads[10] = jax.tree_util.tree_map(lambda x: np.full_like(x, np.nan), grads[10])
  _, states = _run(baselines.zclip(warmup=3), grads)
  assert int(states[10].count) == 10
  assert float(states[10].mean) == float(states[9].mean)
  assert np.isfinite(float(states[11].mean))


def adagc_reference(grads, ratio, ema_decay, warmup, warmup_clip):
  """Per step: the clipped gradient leaves (float64 list) and the EMAs."""
  leaves0 = jax.tree_util.tree_leaves(grads[0])
  ema = [0.0] * len(leaves0)
  count, out = 0, []
  for g in grads:
    leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(g)]
    norms = [np.linalg.norm(x) for x in leaves]
    count += 1
    if count <= warmup:
      total = np.sqrt(sum(n ** 2 for n in norms))
      factors = [min(1.0, warmup_clip / total)] * len(leaves)
      ema = [e + (n * f - e) / count for e, n, f in zip(ema, norms, factors)]
    else:
      factors = [ratio * e / n if n > ratio * e else 1.0 for e, n in zip(ema, norms)]
      ema = [ema_decay * e + (1 - ema_decay) * n * f for e, n, f in zip(ema, norms, factors)]
    out.append(([x * f for x, f in zip(leaves, factors)], list(ema)))
  return out


def test_adagc_matches_numpy_reference_and_clips_per_tensor():
  grads = _gradients(20)
  # A spike in one tensor only: AdaGC clips that tensor and leaves the others alone.
  grads[14]['a'] = grads[14]['a'] * 30.0
  tx = baselines.adagc(ratio=3.0, ema_decay=0.9, warmup=5, warmup_global_clip=2.0)
  outs, states = _run(tx, grads)
  ref = adagc_reference(grads, 3.0, 0.9, 5, 2.0)
  for u, s, (leaves, ema) in zip(outs, states, ref):
    for got, want in zip(jax.tree_util.tree_leaves(u), leaves):
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose([float(e) for e in jax.tree_util.tree_leaves(s.ema_norm)], ema,
                               rtol=2e-5)
  np.testing.assert_array_equal(outs[14]['b'], grads[14]['b'])
  assert np.linalg.norm(outs[14]['a']) < 0.1 * np.linalg.norm(grads[14]['a'])
  # During warmup the whole gradient is clipped to global norm 2.
  np.testing.assert_allclose(_global_norm(outs[0]), 2.0, rtol=1e-5)


@pytest.mark.parametrize('factory,kwargs', [
    (baselines.zclip, {'z_threshold': 0.0}), (baselines.zclip, {'ema_decay': 1.0}),
    (baselines.zclip, {'warmup': 0}), (baselines.adagc, {'ratio': -1.0}),
    (baselines.adagc, {'warmup_global_clip': -1.0}),
    (baselines.random_recovery, {'max_o': -1}),
])
def test_invalid_arguments_raise_value_error_naming_them(factory, kwargs):
  name = next(iter(kwargs))
  args = {'max_o': 1} if factory is baselines.random_recovery else {}
  args.update(kwargs)
  with pytest.raises(ValueError, match=name):
    factory(**args)


def test_random_recovery_draws_max_o_units_per_step_from_a_gnmr_state():
  max_o, warmup, seed = 2, 3, 7
  grads = _gradients(40, seed=1)
  tx = optax.chain(baselines.random_recovery(max_o, seed, units=r'^(a|layers/w)$',
                                             layer_axis=r'^layers/', warmup=warmup),
                   optax.sgd(0.1))
  _, states = _run(tx, grads)
  counts = np.zeros(3)
  total = 0
  for t, state in enumerate(states, start=1):
    ctl = gnmr_jax.controller_state(state)
    mask = gnmr_jax.recovery_mask(state)
    flat = np.concatenate([np.atleast_1d(np.asarray(mask['a'])),
                           np.asarray(mask['layers']['w'])])
    assert not bool(mask['b'])  # not a unit
    expected = np.zeros(3, bool)
    if t > warmup:
      order = np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(seed), t), 3))
      expected[order[:max_o]] = True
    np.testing.assert_array_equal(flat, expected)
    total += expected.sum()
    counts += flat
    assert int(ctl.telemetry.num_active) == expected.sum()
    assert int(ctl.telemetry.active_unit_steps) == total
    assert int(ctl.telemetry.num_units) == 3
  # Every unit is drawn, close to the uniform rate max_o / N.
  rates = counts / (len(states) - warmup)
  assert np.all(np.abs(rates - max_o / 3) < 0.25), rates
  assert len({tuple(np.asarray(gnmr_jax.recovery_mask(s)['layers']['w'])) for s in states}) > 1
