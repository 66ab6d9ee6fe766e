"""scripts/threshold_sweep.py: norms <-> GNMR reconstruction against float64 NumPy, and the replay
(the library's controller, jitted) against the NumPy reference. No training."""
import json
import os
import sys

import numpy as np
import pytest

from tests.gnmr_reference import library_rtols, run_reference
from tests.tolerances import assert_allclose

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import threshold_sweep  # noqa: E402  pylint: disable=g-import-not-at-top

F64_EPS = float(np.finfo(np.float64).eps)

SETTING = {"alpha": 2.0, "beta": 1.5, "delta": 8, "max_o": 4, "t_lock": 5, "warmup": 20}


def gnmr_float64(norms_TxN):
  """GNMR_t = n_t / mean(n_1..n_{t-1}), GNMR_1 = 1, one unit and step at a time in float64."""
  norms_TxN = np.asarray(norms_TxN, np.float64)
  out = np.ones_like(norms_TxN)
  for u in range(norms_TxN.shape[1]):
    total = 0.0
    for t in range(norms_TxN.shape[0]):
      if t:
        out[t, u] = norms_TxN[t, u] / (total / t)
      total += norms_TxN[t, u]
  return out


def synthetic_norms(seed, steps=120, units=6, spikes=0.03):
  """Drifting lognormal norms with a different scale per unit and a few x3..x50 spikes."""
  rng = np.random.default_rng(seed)
  drift = np.exp(np.linspace(0.0, -1.0, steps))[:, None]
  norms = rng.lognormal(0.0, 0.25, size=(steps, units)) * drift * rng.uniform(0.01, 100, units)
  hit = rng.random((steps, units)) < spikes
  return np.where(hit, norms * rng.uniform(3, 50, size=norms.shape), norms)


@pytest.mark.parametrize("seed", [0, 1])
def test_norms_gnmr_round_trip_matches_float64(seed):
  norms = synthetic_norms(seed)
  steps = norms.shape[0]
  gnmr = gnmr_float64(norms)
  # Float64 both: the same step-order sums, then two divisions (<= eps each).
  assert_allclose(threshold_sweep.gnmr_from_norms(norms), gnmr, rtol=2 * F64_EPS)
  rebuilt = threshold_sweep.norms_from_gnmr(gnmr)
  # Scale-free: the rebuilt norms are the originals divided by n_1, unit by unit. The
  # rebuild n_t = GNMR_t * mean_{t-1} carries the mean's error on and adds <= 5
  # roundings per step (GNMR's two divisions, the product, the mean, the sum): 5 T eps.
  rebuilt_rtol = 5 * steps * F64_EPS
  assert_allclose(rebuilt, norms / norms[0], rtol=rebuilt_rtol)
  # GNMR of the rebuilt norms: their error in the norm and in the mean, + 2 divisions.
  assert_allclose(gnmr_float64(rebuilt), gnmr, rtol=2 * rebuilt_rtol + 2 * F64_EPS)
  # From a log rounded to 5 decimals, the rebuilt norms reproduce the rounded series
  # (to float64 rounding, which is far below the log's 1e-5).
  rounded = np.round(gnmr, 5)
  assert threshold_sweep.max_relative_error(
      threshold_sweep.gnmr_from_norms(threshold_sweep.norms_from_gnmr(rounded)),
      rounded) < 2 * rebuilt_rtol + 2 * F64_EPS


def write_log(workdir, steps, num_units=3):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "units.jsonl"), "w", encoding="utf-8") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "mask": [0] * num_units, "score": [0.5] * num_units,
                          "gnmr": [1.0] * num_units, "delta_gnmr": [1.0] * num_units}) + "\n")
  with open(os.path.join(workdir, "unit_names.json"), "w", encoding="utf-8") as f:
    json.dump([f"u{i}" for i in range(num_units)], f)


@pytest.mark.parametrize("steps, message", [
    (range(2, 11), "starts at step 2"),
    ([1, 2, 3, 5, 6, 7, 8, 9, 10], "skips steps (3->5)"),
    (range(1, 8), "ends at step 7"),
])
def test_incomplete_unit_logs_are_refused(tmp_path, steps, message):
  write_log(str(tmp_path), steps)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    threshold_sweep.load_unit_log(str(tmp_path), 10)
  write_log(str(tmp_path / "ok"), range(1, 11))
  assert threshold_sweep.load_unit_log(str(tmp_path / "ok"), 10)["gnmr"].shape == (10, 3)


@pytest.mark.parametrize("setting", [
    SETTING,
    {"alpha": 1.5, "beta": 3.0, "delta": 4, "max_o": 2, "t_lock": 0, "warmup": 5},
])
def test_replay_masks_equal_the_reference(setting):
  norms = np.stack([synthetic_norms(2, steps=80), synthetic_norms(3, steps=80)]).astype(np.float32)
  out = threshold_sweep.replay(norms, **setting)
  assert out["mask"].shape == norms.shape and out["mask"].dtype == bool
  for b in range(norms.shape[0]):
    # The reference sees the norms as the controller computes them (sqrt of a square).
    want = run_reference(np.sqrt(np.square(norms[b])), **setting)
    np.testing.assert_array_equal(out["mask"][b], want["mask"])
    np.testing.assert_array_equal(out["risky"][b], want["risky"])
    # Float32 library vs float32 reference: GNMR's two divisions (library_rtols).
    assert_allclose(out["gnmr"][b], want["gnmr"], rtol=library_rtols(setting["delta"])["gnmr"])
    assert want["mask"][setting["warmup"]:].any()  # the budget is used: the check has teeth


@pytest.mark.parametrize("t_lock", [0, 5])
def test_x100_spike_after_warmup_is_detected_at_once(t_lock):
  steps, units = 60, 5
  norms = 1.0 + 0.01 * np.random.default_rng(0).standard_normal((steps, units))
  spikes = np.array([[2, 30], [4, 45]])  # (unit, 1-based step), after warmup 20
  setting = dict(SETTING, t_lock=t_lock)
  row = threshold_sweep.sweep_setting(norms, spikes, [100.0], setting)
  assert row["recovered_pct"] == 0.0 and row["chance_pct"] == 0.0
  spike = row["spikes"][0]
  assert spike["detected"] == 2 and spike["latency_1"] == 2 and spike["mean_latency"] == 1.0
  # By hand: the spiked sequence's mask picks the unit at the spike step and holds it t_lock more.
  masks = threshold_sweep.replay(threshold_sweep.inject(norms, spikes[:1], 100.0), **setting)
  picked = np.argwhere(masks["mask"][0])
  np.testing.assert_array_equal(picked, [[t, 2] for t in range(29, 29 + t_lock + 1)])


def test_spike_draws_are_after_warmup_and_leave_a_next_step():
  spikes = threshold_sweep.draw_spikes(num_units=7, steps=40, warmup=20, draws=500, seed=0)
  assert spikes[:, 1].min() == 21 and spikes[:, 1].max() == 39
  assert set(spikes[:, 0]) == set(range(7))
  np.testing.assert_array_equal(spikes, threshold_sweep.draw_spikes(7, 40, 20, 500, 0))


@pytest.mark.parametrize("t_lock", [0, 5])
def test_budgeted_priorities_replay_by_hand(t_lock):
  """'norm' recovers the max_o largest norms every step after warmup (its budget, spike or not);
  'noise' with no measured gap recovers nothing on flat norms and only the paper's alarm on a
  spike: the unit at the spike step, held t_lock more steps."""
  steps, units, max_o = 60, 5, 2
  rng = np.random.default_rng(1)
  scale = np.array([1.0, 5.0, 2.0, 4.0, 3.0])  # 'norm' ranks units 1 and 3 first
  norms = scale * (1.0 + 0.01 * rng.standard_normal((steps, units)))
  spikes = np.array([[2, 30]])
  setting = dict(SETTING, max_o=max_o, t_lock=t_lock)
  clean = threshold_sweep.replay(norms[None], priority="norm", **setting)["mask"][0]
  assert not clean[:setting["warmup"]].any()  # the mask chosen at step t <= warmup is empty
  np.testing.assert_array_equal(np.argwhere(clean[setting["warmup"]:])[:, 1],
                                np.tile([1, 3], steps - setting["warmup"]))
  row = threshold_sweep.sweep_setting(norms, spikes, [10.0], {**setting, "priority": "norm"})
  assert row["recovered_pct"] == pytest.approx(100 * max_o * (steps - 20) / (steps * units))
  assert row["spikes"][0]["detected"] == 1  # 10 x 2.0 outranks 5.0
  noise = dict(setting, alpha=4.0, beta=3.0, priority="noise")
  row = threshold_sweep.sweep_setting(norms, spikes, [10.0], noise)
  assert row["recovered_pct"] == 0.0 and row["spikes"][0]["latency_1"] == 1
  masks = threshold_sweep.replay(threshold_sweep.inject(norms, spikes, 10.0), **noise)["mask"]
  np.testing.assert_array_equal(np.argwhere(masks[0]), [[t, 2] for t in range(29, 30 + t_lock)])
