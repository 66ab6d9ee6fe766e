"""The 'noise' priority (noise fraction, hysteresis, a budget that is a cap) and the split-half
measurement, against NumPy references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gnmr_jax
from gnmr_jax import control
from gnmr_jax.control import recovery_gap, research
from tests.tolerances import F32_EPS

N, MAX_O, T_LOCK, WARMUP, DECAY, UPPER, LOWER = 6, 2, 1, 1, 0.5, 1 / 3, 1 / 6


def _run(norms, gaps, recs, valid, **kwargs):
  """Masks used at steps 1..T (row t: the mask before update t) and pi after each update."""
  hp = dict(max_o=MAX_O, t_lock=T_LOCK, warmup=WARMUP, gap_decay=DECAY, layer_axis=r"^u$",
            alpha=1e9, beta=1e9)
  hp.update(kwargs)
  tx = research.noise(**hp)
  params = {"u": jnp.zeros((N, 1), jnp.float32)}

  @jax.jit
  def step(state, norm, gap, rec, ok):
    rg = recovery_gap.RecoveryGap({"u": gap}, {"u": rec}, {"u": ok})
    return tx.update({"u": norm[:, None]}, state, params, recovery_gap=rg)[1]

  state = tx.init(params)
  masks, pis = [], []
  for t in range(len(norms)):
    masks.append(np.asarray(gnmr_jax.recovery_mask(state)["u"]))
    state = step(state, *(jnp.asarray(x[t]) for x in (norms, gaps, recs, valid)))
    pis.append(np.asarray(control.priorities.noise_fraction(state.noise_sq["u"],
                                                            state.rec_sq["u"])))
  return np.asarray(masks), np.asarray(pis), state


def _reference(norms, gaps, recs, valid, rank="pi", gate="unit"):
  """The rule in float64 NumPy, written from the module docstring."""
  noise, rec, count = np.zeros(N), np.zeros(N), np.zeros(N, int)
  lock, mask = np.zeros(N, int), np.zeros(N, bool)
  masks, pis = [], []
  for t in range(len(norms)):
    masks.append(mask.copy())
    ok = valid[t]
    e2, r2 = gaps[t].astype(np.float64) ** 2, recs[t].astype(np.float64) ** 2
    noise = np.where(ok, np.where(count > 0, DECAY * noise + (1 - DECAY) * e2, e2), noise)
    rec = np.where(ok, np.where(count > 0, DECAY * rec + (1 - DECAY) * r2, r2), rec)
    count = count + ok
    pi = np.where(noise == 0, 0.0, noise / np.where(rec > 0, rec, 1.0))
    pis.append(pi)
    finite = np.isfinite(norms[t])
    above = (pi > UPPER) | (mask & (pi >= LOWER))
    if gate == "any":
      above = np.full(N, above.any())
    candidate = ~finite | (lock > 0) | above
    tier = np.where(~finite, 3, np.where(lock > 0, 1, 0))
    by = pi if rank == "pi" else np.where(finite, norms[t].astype(np.float64), 0.0)
    order = sorted(range(N), key=lambda u: (not candidate[u], -tier[u], -by[u], u))
    selected = np.zeros(N, bool)
    if t + 1 > WARMUP:
      for u in [u for u in order if candidate[u]][:MAX_O]:
        selected[u] = True
    lock = np.where(selected & ~mask, T_LOCK, np.maximum(lock - 1, 0))
    mask = selected
  return np.asarray(masks), np.asarray(pis)


def test_noise_priority_follows_the_numpy_reference_and_its_mask_may_be_empty():
  rng = np.random.default_rng(3)
  steps = 24
  recs = rng.uniform(0.5, 2.0, (steps, N)).astype(np.float32)
  # Relative gaps drawn from a few levels around the thresholds, changing over time: units
  # cross 1/3 at different steps and fall back below 1/6.
  levels = np.array([0.05, 0.2, 0.45, 0.8])
  rel = levels[rng.integers(0, 4, (steps, N))]
  rel[:, 0] = 0.05  # one unit that never needs recovery
  gaps = (rel * recs).astype(np.float32)
  valid = np.zeros((steps, N), bool)
  valid[::3] = True  # measured every 3 steps, constant in between
  norms = np.ones((steps, N), np.float32)
  masks, pis, _ = _run(norms, gaps, recs, valid)
  want_masks, want_pis = _reference(norms, gaps, recs, valid)
  # pi: a few float32 roundings of squares and an EMA (<= 8 eps relative).
  np.testing.assert_allclose(pis, want_pis, rtol=8 * F32_EPS)
  # Masks are exact where no pi is within float32 rounding of a threshold (checked).
  margin = np.min(np.abs(want_pis[:, :, None] - np.array([UPPER, LOWER])[None, None]))
  assert margin > 1e-4
  np.testing.assert_array_equal(masks, want_masks)
  assert not masks[:, 0].any()
  sizes = masks.sum(axis=1)
  assert sizes.max() <= MAX_O and (sizes[WARMUP + 1:] < MAX_O).any()  # a cap, not a quota
  assert (np.diff(masks.astype(int), axis=0) < 0).any()  # units leave (hysteresis releases)

  # Nothing above the threshold: after warmup the mask stays empty, whatever the budget.
  quiet = (0.1 * recs).astype(np.float32)
  masks, _, state = _run(norms, quiet, recs, valid)
  assert not masks.any()
  assert int(gnmr_jax.controller_state(state).telemetry.active_unit_steps) == 0


def test_noise_rank_norm_ranks_the_same_candidates_by_the_norm_level():
  """noise_rank='norm': the candidates are pi's (the same gate), ranked by the gradient norm."""
  rng = np.random.default_rng(5)
  steps = 24
  recs = rng.uniform(0.5, 2.0, (steps, N)).astype(np.float32)
  rel = np.array([0.05, 0.2, 0.45, 0.8])[rng.integers(1, 4, (steps, N))]  # crowded: > max_o
  gaps = (rel * recs).astype(np.float32)
  valid = np.zeros((steps, N), bool)
  valid[::3] = True
  # Distinct norm levels whose order is not pi's: unit 5 largest, then 0, ...
  norms = np.tile(np.array([5.0, 1.0, 2.0, 0.5, 3.0, 8.0], np.float32), (steps, 1))
  norms *= rng.uniform(0.9, 1.1, norms.shape).astype(np.float32)
  masks, _, _ = _run(norms, gaps, recs, valid, noise_rank="norm")
  want, want_pis = _reference(norms, gaps, recs, valid, rank="norm")
  margin = np.min(np.abs(want_pis[:, :, None] - np.array([UPPER, LOWER])[None, None]))
  assert margin > 1e-4
  np.testing.assert_array_equal(masks, want)
  by_pi, _ = _reference(norms, gaps, recs, valid, rank="pi")
  assert (want != by_pi).any()  # the ranking matters in this draw: the check has teeth
  with pytest.raises(ValueError, match="noise_rank"):
    research.noise(max_o=1, t_lock=0, noise_rank="gap")


def test_noise_gate_any_opens_every_unit_while_one_is_over_the_threshold():
  """noise_gate='any' with noise_rank='norm': while any unit's pi is over 1/3 (or a unit in the
  mask stays >= 1/6), the max_o largest norms are recovered; when none is, nothing is."""
  rng = np.random.default_rng(7)
  steps = 30
  recs = rng.uniform(0.5, 2.0, (steps, N)).astype(np.float32)
  rel = np.full((steps, N), 0.05)
  rel[6:15, 4] = 0.8    # one unit over the threshold from step 7 to 15, then below 1/6
  rel[21:24, 2] = 0.45  # another, later
  gaps = (rel * recs).astype(np.float32)
  valid = np.zeros((steps, N), bool)
  valid[::2] = True
  norms = np.tile(np.array([5.0, 1.0, 2.0, 0.5, 3.0, 8.0], np.float32), (steps, 1))
  masks, _, _ = _run(norms, gaps, recs, valid, noise_rank="norm", noise_gate="any")
  want, want_pis = _reference(norms, gaps, recs, valid, rank="norm", gate="any")
  margin = np.min(np.abs(want_pis[:, :, None] - np.array([UPPER, LOWER])[None, None]))
  assert margin > 1e-4
  np.testing.assert_array_equal(masks, want)
  open_steps = masks.any(axis=1)
  assert open_steps.any() and not open_steps.all()  # it spends only while the gate is open
  # While open, the largest norms (units 5 and 0) are recovered, not the unit whose pi opened it.
  assert masks[open_steps][:, [5, 0]].all() and not masks[open_steps][:, 4].all()
  unit_gate, _ = _reference(norms, gaps, recs, valid, rank="norm", gate="unit")
  assert (unit_gate != want).any()
  with pytest.raises(ValueError, match="noise_gate"):
    research.noise(max_o=1, t_lock=0, noise_gate="all")


def test_noise_priority_keeps_the_papers_alarm_and_recovers_nonfinite_units_first():
  steps = 30
  norms = np.ones((steps, N), np.float32)
  norms[20, 3] = 10.0     # a finite 10x spike on unit 3 at step 21
  norms[25, 4] = np.nan   # a non-finite gradient on unit 4 at step 26
  recs = np.ones((steps, N), np.float32)
  gaps = np.full((steps, N), 0.05, np.float32)  # pi = 0.0025: nothing from the signal
  valid = np.ones((steps, N), bool)
  masks, _, _ = _run(norms, gaps, recs, valid, alpha=4.0, beta=3.0)
  # The mask made after step t is used at step t + 1 (rows are steps 1..T).
  assert masks[21, 3] and masks[21].sum() == 1  # the spike, recovered at the next step
  assert masks[26, 4]                           # the non-finite unit at the next step
  quiet_rows = [t for t in range(steps) if t not in (21, 22, 26, 27)]  # t_lock = 1
  assert not masks[quiet_rows].any()


def test_noise_priority_refuses_bad_thresholds():
  with pytest.raises(ValueError, match="noise_upper"):
    research.noise(max_o=2, t_lock=0, noise_upper=0.0)
  with pytest.raises(ValueError, match="noise_lower"):
    research.noise(max_o=2, t_lock=0, noise_upper=0.2, noise_lower=0.3)


def test_split_halves_measure_signal_and_sampling_noise_like_numpy():
  from gnmr_jax.precision import default_precision_config, make_policy  # pylint: disable=g-import-not-at-top
  policy = make_policy(default_precision_config(), max_recovered=None)  # int8 / bf16

  def loss_fn(params, x, mask):
    bit = None if mask is None else mask["w"]
    return jnp.mean(jnp.tanh(policy.dot(x, params["w"], bit)) ** 2)

  x = jax.random.normal(jax.random.key(0), (16, 32))
  params = {"w": jax.random.normal(jax.random.key(1), (32, 8)) / 4}
  gap = control.measure(loss_fn, params, x, split_halves=True)
  full = control.measure(loss_fn, params, x)
  every = {"w": jnp.asarray(True)}
  ga = np.asarray(jax.grad(loss_fn)(params, x[:8], every)["w"], np.float64)
  gb = np.asarray(jax.grad(loss_fn)(params, x[8:], every)["w"], np.float64)
  scale = np.sum(ga * ga) + np.sum(gb * gb)  # bound on the |terms| of both sums
  np.testing.assert_allclose(float(gap.signal_sq["w"]), np.sum(ga * gb),
                             atol=16 * F32_EPS * scale)
  np.testing.assert_allclose(float(gap.sampling_sq["w"]), np.sum((ga - gb) ** 2) / 4,
                             atol=16 * F32_EPS * scale)
  # The mean of the halves is the full-batch recovery gradient (equal halves, mean loss).
  np.testing.assert_allclose(float(gap.rec_norm["w"]), float(full.rec_norm["w"]), rtol=1e-5)
  np.testing.assert_allclose(float(gap.gap["w"]), float(full.gap["w"]), rtol=1e-3)
  with pytest.raises(ValueError, match="split_halves"):
    control.measure(loss_fn, params, x, measuring_pass="swapped", split_halves=True)
  with pytest.raises(ValueError, match="even batch size"):
    control.measure(loss_fn, params, x[:15], split_halves=True)


def test_train_loop_logs_the_noise_fraction_of_its_logged_measurements(tmp_path, data_dirs):
  """'noise' through train_and_evaluate ('uniform' pass, split halves): units.jsonl's pi equals
  the EMA of recovery_gap.jsonl's e^2 over ||g_rec||^2, and both halves' estimates are logged."""
  import os  # pylint: disable=g-import-not-at-top
  from gnmr_jax import metrics_log, train_loop  # pylint: disable=g-import-not-at-top
  from tests.train_helpers import small_config  # pylint: disable=g-import-not-at-top
  config = small_config(data_dirs, **{
      "train.steps": 6, "train.eval_every": 0, "checkpoint.every_steps": 0,
      "logging.unit_log_every": 1, "gnmr.priority": "noise", "gnmr.warmup": 1,
      "gnmr.gap_decay": 0.5, "diagnostics.recovery_gap_every": 2,
      "diagnostics.recovery_gap_start": 2, "diagnostics.recovery_gap_pass": "uniform",
      "diagnostics.recovery_gap_split": True})
  summary = train_loop.train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:1])
  units = metrics_log.read_jsonl(os.path.join(tmp_path, metrics_log.UNITS_FILE))
  gaps = metrics_log.read_jsonl(os.path.join(tmp_path, metrics_log.GAP_FILE))
  assert [g["step"] for g in gaps] == [2, 4, 6]
  noise = rec = None
  for g in gaps:
    e2 = np.square(np.asarray(g["gap"], np.float64))
    r2 = np.square(np.asarray(g["gap"], np.float64) / np.asarray(g["gap_rel"], np.float64))
    noise = e2 if noise is None else 0.5 * noise + 0.5 * e2
    rec = r2 if rec is None else 0.5 * rec + 0.5 * r2
    row = next(u for u in units if u["step"] == g["step"])
    # Logged values carry 7 and 5 significant digits.
    np.testing.assert_allclose(row["noise_fraction"], noise / rec, rtol=1e-4)
    assert len(g["signal_sq"]) == len(g["sampling_sq"]) == len(g["gap"])
    assert np.all(np.asarray(g["sampling_sq"]) >= 0)
  assert 0.0 <= summary["recovered_unit_steps_pct"] <= 100.0 * config.gnmr.max_o / 14
