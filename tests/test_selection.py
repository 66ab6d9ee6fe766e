"""The budgeted controllers (gnmr_jax.norm_level, control.research) against a NumPy reference of
the rules, the gap estimate, the hybrid's precedence, jit/sharding/orbax, and the config mapping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gnmr_jax
from gnmr_jax import control, optim
from gnmr_jax.control import recovery_gap, research
from gnmr_jax.config import base_config, validate_config

N = 6  # units: slices of one layer-stacked leaf, so unit u's norm is |row[u]| exactly


def _reference(priority, norms, gaps, valid, *, max_o, t_lock, warmup, gap_decay=0.0,
               risky=None, score=None):
  """The selection rules of gnmr_jax/control/priorities.py, written again in NumPy (float64
  signals)."""
  n = norms.shape[1]
  mask, lock = np.zeros(n, bool), np.zeros(n, int)
  est, est_count = np.zeros(n), np.zeros(n, int)
  masks = []
  for t in range(len(norms)):
    step = t + 1
    ok = valid[t] & np.isfinite(gaps[t])
    blended = np.where(est_count > 0, gap_decay * est + (1 - gap_decay) * gaps[t], gaps[t])
    est = np.where(ok, blended, est)
    est_count += ok
    finite = np.isfinite(norms[t])
    value = {"norm": np.where(finite, norms[t], 0.0), "gap": est, "hybrid":
             np.where(finite, norms[t], 0.0)}[priority]
    tier = np.where(lock > 0, 1, 0)
    if priority == "hybrid":
      tier = np.where(risky[t], 2, tier)
      value = np.where(risky[t], score[t], value)
    tier = np.where(finite, tier, 3)
    order = sorted(range(n), key=lambda u: (-tier[u], -value[u], u))
    selected = np.zeros(n, bool)
    if step > warmup:
      selected[order[:max_o]] = True
    lock = np.where(selected & ~mask, t_lock, np.where(lock > 0, lock - 1, 0))
    mask = selected
    masks.append(mask.copy())
  return np.array(masks)


def _run(tx, norms, gaps=None, valid=None, rec_norms=None):
  params = {"u": jnp.zeros((N, 1), jnp.float32)}

  @jax.jit
  def step(state, norm, gap, rec, ok):
    rg = recovery_gap.RecoveryGap({"u": gap}, {"u": rec}, {"u": ok})
    return tx.update({"u": norm[:, None]}, state, params, recovery_gap=rg)[1]

  state, states = tx.init(params), []
  for t in range(len(norms)):
    g = np.zeros(N, np.float32) if gaps is None else gaps[t]
    rec = g if rec_norms is None else rec_norms[t]
    ok = np.zeros(N, bool) if valid is None else valid[t]
    state = step(state, jnp.asarray(norms[t]), jnp.asarray(g), jnp.asarray(rec), jnp.asarray(ok))
    states.append(state)
  return states


def _norms(steps, seed, nonfinite=True):
  rng = np.random.default_rng(seed)
  norms = (rng.lognormal(0, 1, size=(steps, N)) * np.arange(1, N + 1)).astype(np.float32)
  norms[rng.random(norms.shape) < 0.1] = 2.0  # exact ties
  if nonfinite:
    norms[7, 2], norms[12, 4] = np.nan, np.inf
  return norms


@pytest.mark.parametrize("max_o,t_lock,warmup", [(2, 3, 4), (1, 0, 0), (3, 1, 2), (7, 2, 0)])
def test_norm_priority_matches_the_numpy_reference(max_o, t_lock, warmup):
  norms = _norms(30, seed=max_o + t_lock)
  tx = gnmr_jax.norm_level(max_o=max_o, t_lock=t_lock, warmup=warmup, layer_axis="u")
  states = _run(tx, norms)
  want = _reference("norm", norms.astype(np.float64), np.zeros_like(norms, np.float64),
                    np.zeros(norms.shape, bool), max_o=max_o, t_lock=t_lock, warmup=warmup)
  got = np.array([np.asarray(gnmr_jax.recovery_mask(s)["u"]) for s in states])
  np.testing.assert_array_equal(got, want)  # a selection: exact
  # The budget and its accounting: min(max_o, N) units every step after warmup.
  assert all(int(m.sum()) == (min(max_o, N) if t + 1 > warmup else 0) for t, m in enumerate(got))
  tel = gnmr_jax.controller_state(states[-1]).telemetry
  assert int(tel.active_unit_steps) == int(got.sum())
  # A non-finite norm is recovered at the next step, whatever the locks.
  assert got[7, 2] and got[12, 4] if max_o and warmup < 8 else True


def test_lock_keeps_an_entering_unit_for_t_lock_plus_one_steps():
  t_lock = 3
  norms = np.ones((12, N), np.float32)
  norms[:, 0] = 5.0
  norms[4, 5] = 9.0   # unit 5 leads at step 5 only; unit 0 leads otherwise
  tx = gnmr_jax.norm_level(max_o=1, t_lock=t_lock, layer_axis="u")
  got = np.array([np.asarray(gnmr_jax.recovery_mask(s)["u"]) for s in _run(tx, norms)])
  np.testing.assert_array_equal(np.flatnonzero(got[:, 5]), np.arange(4, 4 + t_lock + 1))
  assert got[4 + t_lock + 1, 0]  # back to the largest once the lock has run out


def test_gap_estimate_blends_valid_measurements_only_and_oracle_keeps_the_last():
  rng = np.random.default_rng(3)
  steps = 25
  norms = np.ones((steps, N), np.float32)
  gaps = rng.lognormal(0, 1, size=(steps, N)).astype(np.float32)
  gaps[5, 1] = np.nan  # a non-finite measurement is ignored
  valid = rng.random((steps, N)) < 0.5
  valid[0] = False  # nothing measured yet at step 1: ties, tree order
  for priority, decay in (("gap", 0.7), ("oracle", 0.7), ("gap", 0.0)):
    if priority == "oracle":  # the last measurement alone: no gap_decay to give
      tx = research.oracle(max_o=2, t_lock=1, layer_axis="u")
    else:
      tx = research.gap(max_o=2, t_lock=1, layer_axis="u", gap_decay=decay)
    states = _run(tx, norms, gaps, valid)
    eff = 0.0 if priority == "oracle" else decay
    want = _reference("gap", norms.astype(np.float64), gaps.astype(np.float64), valid, max_o=2,
                      t_lock=1, warmup=0, gap_decay=eff)
    got = np.array([np.asarray(gnmr_jax.recovery_mask(s)["u"]) for s in states])
    np.testing.assert_array_equal(got, want)
    # The estimate itself: a float32 blend vs the float64 reference. Each blend rounds a few
    # times (2 products, 1 sum: <= 3 eps/2 relative) and carries decay x the old error, so the
    # error stays below 1.5 eps / (1 - decay) relative to the largest gap folded in.
    est, count = np.zeros(N), np.zeros(N, int)
    for t in range(steps):
      ok = valid[t] & np.isfinite(gaps[t])
      est = np.where(ok, np.where(count > 0, eff * est + (1 - eff) * gaps[t], gaps[t]), est)
      count += ok
    bound = 1.5 * np.finfo(np.float32).eps / (1 - eff) * np.nanmax(gaps)
    np.testing.assert_allclose(np.asarray(states[-1].gap["u"]), est, rtol=0, atol=bound)
    np.testing.assert_array_equal(np.asarray(states[-1].gap_count["u"]), count)


def test_gap_mask_follows_new_measurements_only_where_the_pass_measures_the_mask():
  """With the 'recovery' pass the mask's units are not valid, so their estimate is frozen at the
  measurement that selected them: the mask keeps them although their gap fell. With a pass that
  measures every unit ('uniform', 'swapped') the mask follows the new gaps."""
  norms = np.ones((3, N), np.float32)
  gaps = np.array([[3.0, 1.0, 2.0, 0.5, 0.5, 0.5],     # step 1: unit 0 is the largest
                   [0.1, 1.0, 2.0, 0.5, 0.5, 0.5],     # step 2: its gap fell below unit 2's
                   [0.1, 1.0, 2.0, 0.5, 0.5, 0.5]], np.float32)
  tx = research.gap(max_o=1, t_lock=0, layer_axis="u")
  every_unit = np.ones((3, N), bool)
  recovery_pass = every_unit.copy()
  recovery_pass[1:, 0] = False  # unit 0 ran the recovery path at steps 2 and 3
  for valid, want_after_2 in ((every_unit, 2), (recovery_pass, 0)):
    states = _run(tx, norms, gaps, valid)
    masks = np.array([np.asarray(gnmr_jax.recovery_mask(s)["u"]) for s in states])
    assert masks[0].tolist() == [True] + [False] * (N - 1)
    assert np.flatnonzero(masks[1]).tolist() == [want_after_2]
    assert np.flatnonzero(masks[2]).tolist() == [want_after_2]
  np.testing.assert_array_equal(np.asarray(states[-1].gap["u"])[0], 3.0)  # frozen at step 1


def test_relgap_ranks_the_norm_by_the_last_relative_gap():
  """'relgap' (gap_decay 0): value = ||g_u(t)|| * e_u / ||g_rec,u|| of u's last valid
  measurement (1 before any), 0/0 = 0, a gap over a zero recovery norm ignored. Reference in
  float32 with the same single roundings (one division, one product), so the mask is exact."""
  rng = np.random.default_rng(5)
  steps = 30
  norms = _norms(steps, seed=11)
  gaps = rng.lognormal(0, 1, size=(steps, N)).astype(np.float32)
  rec = (rng.lognormal(0, 1, size=(steps, N)) * 4).astype(np.float32)
  gaps[3, 0], rec[3, 0] = 0.0, 0.0     # 0 / 0: a measured relative gap of 0
  gaps[6, 3], rec[6, 3] = 1.0, 0.0     # e / 0: not finite, not folded in
  valid = rng.random((steps, N)) < 0.4
  valid[3, 0] = valid[6, 3] = True
  valid[:2] = False                    # nothing measured at first: the norm alone
  tx = research.relgap(max_o=2, t_lock=1, warmup=1, layer_axis="u")
  states = _run(tx, norms, gaps, valid, rec)
  est, count = np.zeros(N, np.float32), np.zeros(N, int)
  mask, lock, want = np.zeros(N, bool), np.zeros(N, int), []
  with np.errstate(divide="ignore", invalid="ignore"):
    for t in range(steps):
      ratio = np.where(gaps[t] == 0, np.float32(0), gaps[t] / rec[t]).astype(np.float32)
      ok = valid[t] & np.isfinite(ratio)
      est, count = np.where(ok, ratio, est).astype(np.float32), count + ok
      finite = np.isfinite(norms[t])
      value = (np.where(finite, norms[t], np.float32(0)) *
               np.where(count > 0, est, np.float32(1))).astype(np.float32)
      tier = np.where(finite, np.where(lock > 0, 1, 0), 3)
      order = sorted(range(N), key=lambda u: (-tier[u], -value[u], u))
      selected = np.zeros(N, bool)
      if t + 1 > 1:
        selected[order[:2]] = True
      lock = np.where(selected & ~mask, 1, np.where(lock > 0, lock - 1, 0))
      mask = selected
      want.append(mask.copy())
      np.testing.assert_array_equal(np.asarray(states[t].gap["u"]), est)
      np.testing.assert_array_equal(np.asarray(states[t].gap_count["u"]), count)
  got = np.array([np.asarray(gnmr_jax.recovery_mask(s)["u"]) for s in states])
  np.testing.assert_array_equal(got, np.array(want))
  assert float(states[3].gap["u"][0]) == 0.0 and int(states[6].gap_count["u"][3]) == int(
      states[5].gap_count["u"][3])


def test_hybrid_lets_a_spike_take_the_budget_from_the_persistent_leader():
  steps = 30
  norms = np.ones((steps, N), np.float32)
  norms[:, 0] = 4.0          # persistent leader
  norms[20, 3] = 40.0        # a x40 spike of a small unit
  tx = research.hybrid(max_o=1, t_lock=2, warmup=5, alpha=4.0, beta=3.0, layer_axis="u")
  states = _run(tx, norms)
  got = np.array([np.asarray(gnmr_jax.recovery_mask(s)["u"]) for s in states])
  ctl = [gnmr_jax.controller_state(s) for s in states]
  risky = np.array([np.asarray(c.risky["u"]) for c in ctl])
  score = np.array([np.asarray(c.score["u"]) for c in ctl])
  want = _reference("hybrid", norms.astype(np.float64), np.zeros((steps, N)),
                    np.zeros((steps, N), bool), max_o=1, t_lock=2, warmup=5, risky=risky,
                    score=score)
  np.testing.assert_array_equal(got, want)
  assert got[20, 3] and not got[20, 0]  # the spike wins at once ...
  assert got[5:20, 0].all() and got[23:, 0].all()  # ... the leader holds the budget otherwise
  # The paper's statistics are kept as gnmr(max_o=0) keeps them.
  ref = gnmr_jax.gnmr(alpha=4.0, beta=3.0, delta=8, max_o=0, t_lock=0, warmup=5, layer_axis="u")
  ref_states = _run(ref, norms)
  np.testing.assert_array_equal(np.asarray(ref_states[-1].gnmr["u"]),
                                np.asarray(ctl[-1].gnmr["u"]))


def test_config_priority_gnmr_is_the_paper_transform_itself():
  norms = _norms(30, seed=9)
  kwargs = dict(alpha=1.5, beta=1.3, delta=3, max_o=2, t_lock=2, warmup=3, layer_axis="u")
  config = base_config("tiny").gnmr
  config.update(priority="gnmr", units="", **kwargs)
  a = _run(control.from_config(config), norms)
  b = _run(gnmr_jax.gnmr(**kwargs), norms)
  for x, y in zip(a, b):
    jax.tree.map(lambda p, q: np.testing.assert_array_equal(np.asarray(p), np.asarray(q)), x, y)


@pytest.mark.parametrize("make,kwargs,match", [
    (research.gap, {"gap_decay": 1.0}, "gap_decay"), (gnmr_jax.norm_level, {"max_o": -1}, "max_o"),
    (research.gap, {"t_lock": 1.5}, "t_lock"), (research.random, {"seed": -2}, "seed"),
    (research.hybrid, {"alpha": 0.0}, "alpha")])
def test_invalid_arguments_raise_naming_them(make, kwargs, match):
  args = {"max_o": 1, "t_lock": 0}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    make(**args)
  config = base_config("tiny").gnmr
  config.priority = "magic"
  with pytest.raises(ValueError, match="config.gnmr.priority must be one of"):
    control.from_config(config)


def test_orbax_round_trip_and_sharded_state_continue_bitwise(tmp_path):
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  norms, rng = _norms(20, seed=4, nonfinite=False), np.random.default_rng(5)
  gaps = rng.lognormal(size=norms.shape).astype(np.float32)
  valid = rng.random(norms.shape) < 0.3
  tx = research.gap(max_o=2, t_lock=2, layer_axis="u", gap_decay=0.5)
  mid = _run(tx, norms[:10], gaps[:10], valid[:10])[-1]
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", mid)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, mid))
  assert isinstance(restored, control.PriorityState)

  def cont(state):
    params = {"u": jnp.zeros((N, 1), jnp.float32)}
    out = []
    for t in range(10, 20):
      rg = recovery_gap.RecoveryGap({"u": gaps[t]}, {"u": gaps[t]}, {"u": valid[t]})
      state = jax.jit(tx.update)({"u": jnp.asarray(norms[t])[:, None]}, state, params,
                                 recovery_gap=rg)[1]
      out.append(state)
    return out

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  replicated = jax.device_put(mid, NamedSharding(mesh, P()))
  straight = cont(mid)
  # Checkpoint round trip and a replicated 8-device state: the same states, bit for bit (the
  # same float32 program on the same values; only placement differs).
  for other in (cont(restored), cont(replicated)):
    for a, b in zip(straight, other):
      jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_config_selects_each_priority_and_refuses_a_gap_priority_without_measurements():
  config = base_config("tiny")
  for priority in control.priority_names():
    config.gnmr.priority = priority
    config.diagnostics.recovery_gap_every = 10 if control.needs_recovery_gap(priority) else 0
    config.gnmr.fixed_units = "attn/q" if priority == "fixed" else ""  # its set (1 unit)
    config.gnmr.last_blocks = 1 if priority == "last_blocks" else 0
    config.gnmr.switch_step = 5 if priority == "late_switch" else 0
    # 'noise' needs every unit re-measured
    config.diagnostics.recovery_gap_pass = "uniform" if priority == "noise" else "recovery"
    # 'saturation' reads delayed scaling's saturation
    config.precision.update(low_cost_path="fp8" if priority == "saturation" else "int8",
                            scaling="delayed" if priority == "saturation" else "row")
    validate_config(config, 1)
    tx = optim.make_optimizer(config)
    state = tx.init({"layers": {"attn": {"q": {"kernel": jnp.zeros((2, 4, 4))}}}})
    gnmr_jax.controller_state(state)  # exactly one GNMRState, found inside
    # the paper's rule and its saturation-only form keep a GNMRState, no gap estimate
    assert (control.gap_estimate(state) is None) == (priority in ("gnmr", "saturation"))
  config.gnmr.priority, config.gnmr.fixed_units, config.gnmr.switch_step = "gap", "", 0
  config.diagnostics.recovery_gap_every = 0
  with pytest.raises(ValueError, match="recovery_gap_every"):
    validate_config(config, 1)
  config.gnmr.priority = "best"
  with pytest.raises(ValueError, match="config.gnmr.priority"):
    validate_config(config, 1)
  config.gnmr.priority, config.gnmr.gap_decay = "norm", 1.5
  with pytest.raises(ValueError, match="gap_decay"):
    validate_config(config, 1)
  config.gnmr.gap_decay = 0.0
  for start in (-1, -5):  # (ConfigDict refuses a float or bool in an int field itself)
    config.diagnostics.recovery_gap_start = start
    with pytest.raises(ValueError, match="config.diagnostics.recovery_gap_start"):
      validate_config(config, 1)


def test_norm_level_chains_with_optax_and_passes_updates_through():
  tx = optax.chain(gnmr_jax.norm_level(max_o=1, t_lock=0), optax.sgd(1.0))
  params = {"a": jnp.ones((2, 2)), "b": jnp.ones((3, 3))}
  grads = {"a": 2 * jnp.ones((2, 2)), "b": jnp.ones((3, 3))}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["a"], -grads["a"])
  assert bool(gnmr_jax.recovery_mask(state)["a"]) and not bool(gnmr_jax.recovery_mask(state)["b"])
