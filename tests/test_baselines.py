"""The baselines (gnmr_jax.clipping, control.research.random) against float64 NumPy references,
jitted."""

import jax
import numpy as np
import optax
import pytest

import gnmr_jax
from gnmr_jax import clipping
from gnmr_jax.control import research
from tests.tolerances import F32_EPS, assert_allclose, gamma

U = F32_EPS / 2  # unit roundoff: one float32 rounding moves a value x by <= U |x|

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


def zclip_reference(norms, z_threshold, ema_decay, warmup, eps, norm_size):
  """Per step: (factor applied to the gradient, mean, var) in float64, and error bounds.

  The bounds (of factor, mean, var) are a running first-order error analysis of the
  library's float32 evaluation of the same formulas (Higham, Accuracy and
  Stability of Numerical Algorithms, sec. 3.3): each operation adds its inputs'
  propagated errors and one rounding, U |result|; the global norm of norm_size
  entries is within gamma_n / 2 + U of its value (tests/tolerances.py).
  """
  mean = var = 0.0
  e_mean = e_var = 0.0  # error bounds of the library's float32 mean and var
  count, out = 0, []
  for norm in norms:
    if not np.isfinite(norm):
      out.append((1.0, mean, var, (0.0, e_mean, e_var)))
      continue
    e_norm = (gamma(norm_size) / 2 + U) * norm
    count += 1
    if count <= warmup:
      dev = norm - mean
      new_mean = mean + dev / count
      e_dev = e_norm + e_mean + U * abs(dev)
      e_new_mean = e_mean + e_dev / count + U * abs(dev / count) + U * abs(new_mean)
      dev2 = norm - new_mean
      e_dev2 = e_norm + e_new_mean + U * abs(dev2)
      inner = dev * dev2 - var
      e_inner = abs(dev2) * e_dev + abs(dev) * e_dev2 + U * abs(dev * dev2) + e_var + U * abs(inner)
      var = var + inner / count
      e_var = e_var + e_inner / count + U * abs(inner / count) + U * abs(var)
      mean, e_mean, factor, e_factor = new_mean, e_new_mean, 1.0, 0.0
    else:
      std = np.sqrt(var + eps)
      e_std = e_var / (2 * std) + 2 * U * std
      z = (norm - mean) / std
      if z > z_threshold:
        clipped = mean + z_threshold * std
        e_clipped = e_mean + z_threshold * e_std + U * z_threshold * std + U * clipped
        factor = clipped / norm
        e_factor = (e_clipped + factor * e_norm) / norm + U * factor
      else:
        clipped, e_clipped, factor, e_factor = norm, e_norm, 1.0, 0.0
      # The decay constants are float32 too: one rounding each, like a product's.
      d, one_minus_d = ema_decay, 1 - ema_decay
      mean = d * mean + one_minus_d * clipped
      e_mean = (d * e_mean + one_minus_d * e_clipped + 2 * U * d * abs(mean)
                + 2 * U * one_minus_d * clipped + U * mean)
      dev = clipped - mean
      e_dev = e_clipped + e_mean + U * abs(dev)
      var = d * var + one_minus_d * dev ** 2
      e_var = (d * e_var + one_minus_d * (2 * abs(dev) * e_dev + U * dev ** 2)
               + 2 * U * d * var + 2 * U * one_minus_d * dev ** 2 + U * var)
    out.append((factor, mean, var, (e_factor, e_mean, e_var)))
  return out


def test_zclip_matches_numpy_reference_and_clips_only_the_spikes():
  grads = _gradients(30, spikes=(15, 22))
  tx = clipping.zclip(z_threshold=2.0, ema_decay=0.9, warmup=8, eps=1e-6)
  outs, states = _run(tx, grads)
  size = sum(x.size for x in jax.tree_util.tree_leaves(grads[0]))
  ref = zclip_reference([_global_norm(g) for g in grads], 2.0, 0.9, 8, 1e-6, size)
  clipped_steps = []
  for t, (g, u, s, (factor, mean, var, bounds)) in enumerate(zip(grads, outs, states, ref)):
    e_factor, e_mean, e_var = bounds  # the running float32 error bounds of the reference
    for leaf_g, leaf_u in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(u)):
      want = factor * np.asarray(leaf_g, np.float64)
      # g * factor: the factor's error times |g|, and one rounding.
      assert_allclose(leaf_u, want, atol=e_factor * np.abs(leaf_g) + U * np.abs(want))
    assert_allclose(float(s.mean), mean, atol=e_mean)
    assert_allclose(float(s.var), var, atol=e_var)
    if factor < 1.0:
      clipped_steps.append(t)
  assert clipped_steps == [15, 22]
  assert int(states[-1].num_clipped) == 2
  assert int(states[-1].count) == 30


def test_zclip_passes_non_finite_gradients_and_keeps_statistics():
  grads = _gradients(12)
  grads[10] = jax.tree_util.tree_map(lambda x: np.full_like(x, np.nan), grads[10])
  _, states = _run(clipping.zclip(warmup=3), grads)
  assert int(states[10].count) == 10
  assert float(states[10].mean) == float(states[9].mean)
  assert np.isfinite(float(states[11].mean))


def adagc_reference(grads, ratio, ema_decay, warmup, warmup_clip):
  """Per step: the clipped gradient leaves (float64 list), the EMAs, and error bounds.

  The bounds (per leaf: of the clip factor, of the EMA) are a running first-order
  error analysis of the library's float32 evaluation, as in zclip_reference.
  """
  leaves0 = jax.tree_util.tree_leaves(grads[0])
  ema = [0.0] * len(leaves0)
  e_ema = [0.0] * len(leaves0)
  count, out = 0, []
  for g in grads:
    leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(g)]
    norms = [np.linalg.norm(x) for x in leaves]
    r_norms = [gamma(x.size) / 2 + U for x in leaves]  # relative, tests/tolerances.py
    count += 1
    if count <= warmup:
      total = np.sqrt(sum(n ** 2 for n in norms))
      # Squares (2 r + U), a 3-term positive sum (gamma_2), sqrt (half, + U).
      r_total = max(r_norms) + U / 2 + gamma(len(leaves) - 1) / 2 + U
      factor = min(1.0, warmup_clip / total)
      e_factor = 0.0 if factor == 1.0 else factor * (r_total + U)
      factors, e_factors = [factor] * len(leaves), [e_factor] * len(leaves)
    else:
      factors, e_factors = [], []
      for e, err, n, r in zip(ema, e_ema, norms, r_norms):
        limit, e_limit = ratio * e, ratio * err + 2 * U * ratio * e
        if n > limit:
          factors.append(limit / n)
          e_factors.append(limit / n * (e_limit / limit + r + U))
        else:
          factors.append(1.0)
          e_factors.append(0.0)
    new_ema, new_e_ema = [], []
    for e, err, n, r, f, e_f in zip(ema, e_ema, norms, r_norms, factors, e_factors):
      clipped = n * f
      e_clipped = f * r * n + n * e_f + U * clipped
      if count <= warmup:
        step = (clipped - e) / count
        new_ema.append(e + step)
        new_e_ema.append(err + (e_clipped + err + U * abs(clipped - e)) / count
                         + U * abs(step) + U * new_ema[-1])
      else:
        d, one_minus_d = ema_decay, 1 - ema_decay
        new_ema.append(d * e + one_minus_d * clipped)
        new_e_ema.append(d * err + one_minus_d * e_clipped + 2 * U * d * e
                         + 2 * U * one_minus_d * clipped + U * new_ema[-1])
    ema, e_ema = new_ema, new_e_ema
    out.append(([x * f for x, f in zip(leaves, factors)], list(ema), e_factors, list(e_ema)))
  return out


def test_adagc_matches_numpy_reference_and_clips_per_tensor():
  grads = _gradients(20)
  # A spike in one tensor only: AdaGC clips that tensor and leaves the others alone.
  grads[14]['a'] = grads[14]['a'] * 30.0
  tx = clipping.adagc(ratio=3.0, ema_decay=0.9, warmup=5, warmup_global_clip=2.0)
  outs, states = _run(tx, grads)
  ref = adagc_reference(grads, 3.0, 0.9, 5, 2.0)
  for g, u, s, (leaves, ema, e_factors, e_ema) in zip(grads, outs, states, ref):
    for leaf_g, got, want, e_factor in zip(jax.tree_util.tree_leaves(g),
                                           jax.tree_util.tree_leaves(u), leaves, e_factors):
      # g * factor: the factor's error times |g|, and one rounding.
      assert_allclose(got, want, atol=e_factor * np.abs(leaf_g) + U * np.abs(want))
    assert_allclose([float(e) for e in jax.tree_util.tree_leaves(s.ema_norm)], ema,
                    atol=np.asarray(e_ema))
  # Exact: a leaf under its limit is multiplied by a factor of exactly 1.
  np.testing.assert_array_equal(outs[14]['b'], grads[14]['b'])
  assert np.linalg.norm(outs[14]['a']) < 0.1 * np.linalg.norm(grads[14]['a'])
  # During warmup the whole gradient is clipped to global norm 2: every entry is off
  # by the factor's relative error and one rounding.
  factor = 2.0 / _global_norm(grads[0])
  assert_allclose(_global_norm(outs[0]), 2.0, atol=2.0 * (ref[0][2][0] / factor + U))


@pytest.mark.parametrize('factory,kwargs', [
    (clipping.zclip, {'z_threshold': 0.0}), (clipping.zclip, {'ema_decay': 1.0}),
    (clipping.zclip, {'warmup': 0}), (clipping.adagc, {'ratio': -1.0}),
    (clipping.adagc, {'warmup_global_clip': -1.0}),
    (research.random, {'max_o': -1}), (research.random, {'seed': -1}),
])
def test_invalid_arguments_raise_value_error_naming_them(factory, kwargs):
  name = next(iter(kwargs))
  args = {'max_o': 1} if factory is research.random else {}
  args.update(kwargs)
  with pytest.raises(ValueError, match=name):
    factory(**args)


def test_random_recovery_draws_max_o_units_per_step_from_a_gnmr_state():
  max_o, warmup, seed = 2, 3, 7
  grads = _gradients(40, seed=1)
  tx = optax.chain(research.random(max_o=max_o, t_lock=0, seed=seed, units=r'^(a|layers/w)$',
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
  # Every unit is drawn, close to the uniform rate max_o / N: over T = 37 draws a unit's
  # rate has standard deviation sqrt(p (1 - p) / T) = 0.08 (p = 2/3); 0.25 is > 3 of those.
  rates = counts / (len(states) - warmup)
  assert np.all(np.abs(rates - max_o / 3) < 0.25), rates
  assert len({tuple(np.asarray(gnmr_jax.recovery_mask(s)['layers']['w'])) for s in states}) > 1
