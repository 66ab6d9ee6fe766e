"""GNMR controller against the NumPy reference, step by step, under jax.jit."""
import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest

import gnmr_jax
from tests.gnmr_reference import library_rtols, run_reference
from tests.tolerances import F32_EPS, assert_allclose

FIELDS = ("mask", "lock", "gnmr", "delta_gnmr", "score", "risky")
PARAMS = {"a": jnp.zeros((4, 4)), "b": jnp.zeros((1, 1)), "bias": jnp.zeros(4),
          "stack": jnp.zeros((3, 1, 1))}
N_UNITS = 5  # a, b, stack[0], stack[1], stack[2]


def updates_with_norms(norms):
  """A gradient tree whose 5 unit norms are exactly `norms` (bias is not a unit)."""
  norms = jnp.asarray(norms, jnp.float32)
  return {"a": jnp.zeros((4, 4)).at[0, 0].set(norms[0]), "b": norms[1].reshape(1, 1),
          "bias": jnp.full((4,), 7.0), "stack": norms[2:].reshape(3, 1, 1)}


def flat_units(tree):
  return np.concatenate([np.ravel(tree["a"]), np.ravel(tree["b"]), np.ravel(tree["stack"])])


def run_transform(norm_seq, **hparams):
  tx = gnmr_jax.gnmr(layer_axis="stack", **hparams)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  out = {k: [] for k in FIELDS}
  for norms in norm_seq:
    _, state = update(updates_with_norms(norms), state)
    for k in FIELDS:
      out[k].append(flat_units(getattr(state, k)))
  return {k: np.asarray(v) for k, v in out.items()}, state


def assert_agrees(norm_seq, **hparams):
  got, state = run_transform(norm_seq, **hparams)
  # The reference sees the norms exactly as the library computes them (sqrt of a square).
  seen = np.sqrt(np.square(np.asarray(norm_seq, np.float32)))
  want = run_reference(seen, **hparams)
  rtols = library_rtols(hparams["delta"])
  for t in range(len(norm_seq)):
    # Exact: the masks are the controller's output, and the reference makes the same
    # float32 decisions; none of these sequences puts a value within rounding of a
    # threshold or a tie, so any mismatch is a logic bug.
    for k in ("mask", "lock", "risky"):
      np.testing.assert_array_equal(got[k][t], want[k][t], err_msg=f"{k} at step {t + 1}")
    for k in ("gnmr", "delta_gnmr", "score"):
      assert_allclose(got[k][t], want[k][t], rtol=rtols[k], err_msg=f"{k} at step {t + 1}")
  return got, want, state


def random_sequence(rng, steps, spikes=0.05, nonfinite=0.0, zeros=0.0):
  base = rng.lognormal(0.0, 0.3, size=(steps, N_UNITS)).astype(np.float32)
  spike = rng.random((steps, N_UNITS)) < spikes
  base = np.where(spike, base * rng.uniform(3, 1000, size=base.shape), base)
  base = np.where(rng.random(base.shape) < zeros, 0.0, base)
  bad = rng.random(base.shape) < nonfinite
  base = np.where(bad, rng.choice([np.nan, np.inf], size=base.shape), base)
  return base.astype(np.float32)


@pytest.mark.parametrize("seed,hp", [
    (0, dict(alpha=2.0, beta=1.5, delta=3, max_o=2, t_lock=2)),
    (1, dict(alpha=1.3, beta=1.2, delta=1, max_o=1, t_lock=0)),
    (2, dict(alpha=3.0, beta=2.0, delta=8, max_o=5, t_lock=4, warmup=5)),
    (3, dict(alpha=1.1, beta=1.05, delta=4, max_o=0, t_lock=3)),
])
def test_random_sequences_match_reference(seed, hp):
  rng = np.random.default_rng(seed)
  got, _, _ = assert_agrees(random_sequence(rng, 60, nonfinite=0.03, zeros=0.03), **hp)
  assert got["mask"].sum(axis=1).max() <= hp["max_o"]


def test_adversarial_sequences_match_reference():
  hp = dict(alpha=2.0, beta=1.5, delta=3, max_o=2, t_lock=2, warmup=2)
  plateau = np.ones((8, N_UNITS), np.float32)
  all_spike = np.full((1, N_UNITS), 50.0, np.float32)        # 5 risky units, budget 2
  zeros = np.zeros((3, N_UNITS), np.float32)                  # 0/0 and x/0 rules
  restart = np.ones((2, N_UNITS), np.float32)
  nonfinite = np.array([[np.nan, np.inf, -np.inf, 1.0, 1.0]], np.float32)
  ties = np.array([[4.0, 4.0, 4.0, 4.0, 4.0]], np.float32)
  seq = np.concatenate([zeros, restart, plateau, all_spike, plateau, nonfinite,
                        plateau, ties, plateau], axis=0)
  got, want, state = assert_agrees(seq, **hp)
  # More risky units than max_o: exactly max_o active, ranked by score then tree order.
  spike_step = len(zeros) + len(restart) + len(plateau)
  assert want["risky"][spike_step].sum() == N_UNITS
  assert got["mask"][spike_step].sum() == 2
  # Non-finite norms are ranked first: units 0, 1, 2 are NaN/Inf/-Inf, budget picks 0 and 1.
  nf_step = spike_step + 1 + len(plateau)
  np.testing.assert_array_equal(got["mask"][nf_step], [True, True, False, False, False])
  assert np.isinf(got["score"][nf_step][:3]).all()
  # No poisoning: the history stays finite.
  for leaf in jax.tree_util.tree_leaves((state.norm_sum, state.window)):
    assert np.isfinite(np.asarray(leaf)).all()


def test_zero_history_edge_rules():
  hp = dict(alpha=2.0, beta=2.0, delta=2, max_o=5, t_lock=0)
  seq = np.array([[0.0] * 5, [0.0] * 5, [1.0] * 5, [1.0] * 5], np.float32)
  got, _, _ = assert_agrees(seq, **hp)
  np.testing.assert_array_equal(got["gnmr"][1], 1.0)       # 0 / 0 = 1: calm
  assert np.isinf(got["gnmr"][2]).all()                    # 1 / 0 = inf: risky
  assert got["mask"][2].all() and not got["mask"][1].any()


def test_isolated_spike_gives_t_lock_plus_one_steps():
  t_lock, spike_at = 3, 6
  seq = np.ones((15, N_UNITS), np.float32)
  seq[spike_at - 1, 3] = 20.0
  got, _, _ = assert_agrees(seq, alpha=2.0, beta=2.0, delta=3, max_o=2, t_lock=t_lock)
  on = np.nonzero(got["mask"][:, 3])[0] + 1
  np.testing.assert_array_equal(on, np.arange(spike_at, spike_at + t_lock + 1))
  assert got["mask"][:, [0, 1, 2, 4]].sum() == 0


def test_warmup_keeps_mask_false_but_accumulates():
  seq = np.ones((6, N_UNITS), np.float32)
  seq[2] = 100.0
  seq[3, 0] = 100.0   # step 4 = warmup: risky but not selected
  seq[4, 1] = 100.0   # step 5 = warmup + 1: selected
  got, _, state = assert_agrees(seq, alpha=2.0, beta=2.0, delta=2, max_o=5, t_lock=2, warmup=4)
  assert not got["mask"][:4].any() and got["risky"][2].all() and got["risky"][3, 0]
  np.testing.assert_array_equal(got["mask"][4], [False, True, False, False, False])
  np.testing.assert_array_equal(flat_units(state.norm_count), 6)


def test_schedules_for_thresholds():
  alpha = optax.linear_schedule(10.0, 1.5, transition_steps=20)
  beta = optax.constant_schedule(1.4)
  rng = np.random.default_rng(5)
  assert_agrees(random_sequence(rng, 30), alpha=alpha, beta=beta, delta=3, max_o=2, t_lock=1)


def test_float64_values_for_a_known_sequence():
  # Hand-checkable: norms 1, 3, 2 for one unit -> GNMR 1, 3, 1; dGNMR (delta=2) 1, 3, 0.5.
  seq = np.ones((3, N_UNITS), np.float32)
  seq[:, 0] = [1.0, 3.0, 2.0]
  got, _ = run_transform(seq, alpha=2.5, beta=2.5, delta=2, max_o=1, t_lock=0)
  # Exact: every norm, sum, mean and ratio here is a small integer or a half, which
  # float32 holds exactly whatever the order of operations.
  np.testing.assert_array_equal(got["gnmr"][:, 0], [1.0, 3.0, 1.0])
  np.testing.assert_array_equal(got["delta_gnmr"][:, 0], [1.0, 3.0, 0.5])
  # x / 2.5 is rounded once, or twice as x * (1 / 2.5): <= eps relative.
  assert_allclose(got["score"][:, 0], [0.4, 1.2, 0.4], rtol=F32_EPS)
  np.testing.assert_array_equal(got["mask"][:, 0], [False, True, False])
