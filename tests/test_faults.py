"""Injected faults (gnmr_jax.faults): detection by the controller, NaN/Inf never reaching the
parameters ('skip' and 'zero'), the controller's history staying finite, and a NaN loss ending the
run with its last good checkpoint."""
import os
import sys

import jax
import numpy as np
import pytest

from gnmr_jax import checkpointing, faults, train_loop
from gnmr_jax.config import validate_config
from gnmr_jax.control.state import maybe_controller_state
from gnmr_jax.data import make_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top
from tests.train_helpers import small_config  # noqa: E402

# Fault injection, detection and the NaN-loss stop: plumbing, run without XLA optimizations
# (conftest.py).
pytestmark = pytest.mark.plumbing

# Units (of the 14 in runlocal): 3 = attn/o[1], 5 = attn/q[1], 7 = attn/v[1], 9 = mlp/down[1],
# 11 = mlp/gate[1], 12 = mlp/up[0]. Steps are spread out so one fault's lock has ended (t_lock=5)
# before the next; warmup is 2.
SCHEDULE = ("5:3:scale:10;9:5:nan;13:7:inf;17:9:corrupt_output:8:3;23:12:scale:100;"
            "27:11:scale:10")
STEPS = 28


@pytest.fixture(scope="module")
def data(data_dirs):
  config = small_config(data_dirs)
  return config.data, make_data(config.data)


def run_steps(config, data, steps):
  """Runs `steps` jitted train steps; returns the run, per-step host metrics and states."""
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  it = data.train_iterator()
  metrics, states = [], []
  with train_loop.sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(0))
    states.append(jax.tree.map(np.asarray, state))
    for _ in range(steps):
      state, m = run.train_step(state, train_loop.device_batch(run, next(it)))
      metrics.append(jax.tree.map(np.asarray, m))
      states.append(jax.tree.map(np.asarray, state))
  return run, metrics, states


def test_schedule_parsing_and_errors():
  specs = faults.parse_schedule(r" 5:3:scale:10 ; 9:mlp/up/kernel\[1\]:nan;12:-:nan_loss::4;")
  assert specs == [faults.FaultSpec(5, "3", "scale", 10.0, 1),
                   faults.FaultSpec(9, r"mlp/up/kernel\[1\]", "nan", 10.0, 1),
                   faults.FaultSpec(12, "-", "nan_loss", 10.0, 4)]
  names = [f"layers/mlp/up/kernel[{i}]" for i in range(2)] + ["layers/attn/q/kernel[0]"] * 2
  resolved = faults.resolve(specs, names)
  assert [f.units for f in resolved] == [(3,), (1,), ()] and resolved[2].duration == 4
  assert faults.resolve(faults.parse_schedule("1:*:inf"), names)[0].units == (0, 1, 2, 3)
  with pytest.raises(ValueError, match="out of range"):
    faults.resolve(specs, names[:3])  # unit index 3 of 3 units
  with pytest.raises(ValueError, match="matches no unit"):
    faults.resolve(faults.parse_schedule("2:embed:nan"), names)
  for bad, match in [("0:1:nan", "STEP"), ("2:1:explode", "KIND"), ("2:1:scale:inf", "FACTOR"),
                     ("2:1:scale:-1", "FACTOR"), ("2:1:scale:2:0", "DURATION"),
                     ("2:(:nan", "regex"), ("2:1", "fields")]:
    with pytest.raises(ValueError, match=f"config.faults.schedule.*{match}"):
      faults.parse_schedule(bad)
  config = tiny.get_config("runlocal")
  config.faults.schedule = "3:1:explode"
  with pytest.raises(ValueError, match="config.faults.schedule"):
    validate_config(config, device_count=8)


@pytest.mark.parametrize("nonfinite", ["skip", "zero"])
def test_injected_faults_are_detected_and_nan_never_reaches_params(data, nonfinite,
                                                                   record_property):
  data_config, dataset = data
  config = small_config(data_config, **{"optimizer.nonfinite": nonfinite, "train.steps": STEPS,
                                        "faults.enabled": True, "faults.schedule": SCHEDULE})
  run, metrics, states = run_steps(config, dataset, STEPS)
  mask_next = np.stack([m["unit_mask_next"] for m in metrics])
  report = faults.detection_report(run.faults.faults, mask_next, config.gnmr.warmup)
  # Every fault (10x and 100x spikes, NaN, Inf, a corrupted low-cost path) puts its unit in the
  # mask at the faulty step itself: the next step runs it on the recovery path.
  record_property("faults_injected", report["injected"])
  record_property("faults_detected", report["detected"])
  assert report["injected"] == 6 and report["detected"] == 6, report
  assert [r["latency"] for r in report["faults"]] == [1] * 6, report
  assert not any(r["already_in_mask"] for r in report["faults"]), report
  # The corrupted unit (steps 17..19) is recovered at once: step 18 runs it on the recovery path,
  # which is clean, so its GNMR drops back below alpha while the corruption is still on.
  unit_gnmr = np.stack([m["unit_gnmr"] for m in metrics])
  assert unit_gnmr[16, 9] > 2 * config.gnmr.alpha and metrics[17]["unit_mask_used"][9]
  assert unit_gnmr[17, 9] < config.gnmr.alpha
  # NaN at step 9 (unit 5), Inf at step 13 (unit 7): the controller ranks them first (score inf),
  # the loss metric stays finite, the step is flagged non-finite.
  for step, unit in ((9, 5), (13, 7)):
    m = metrics[step - 1]
    assert np.isinf(m["unit_score"][unit]) and bool(m["nonfinite"]) and np.isfinite(m["loss"])
    assert int(m["num_nonfinite_units"]) == 1
  for s in states:  # params, AdamW moments and the controller's history stay finite
    ctl = maybe_controller_state(s.opt_state, flat=True)  # the state's own arrays
    for leaf in jax.tree.leaves((s.params, s.opt_state)):
      if leaf.dtype.kind == "f" and leaf is not None:
        finite = np.isfinite(leaf)
        if not finite.all():  # only the last step's per-unit GNMR/score may be +inf
          assert any(leaf is x for x in jax.tree.leaves((ctl.gnmr, ctl.score, ctl.delta_gnmr,
                                                         ctl.norm)))
    for hist in jax.tree.leaves((ctl.norm_sum, ctl.window)):
      assert np.isfinite(hist).all()
  before, after = states[8].params, states[9].params  # around the NaN step 9
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                      jax.tree.leaves(after))]
  q = lambda p: p["layers"]["attn"]["q"]["kernel"]  # unit 5 = attn/q[1]
  if nonfinite == "skip":  # the whole update is skipped
    assert not any(changed)
  else:  # only attn/q layer 1 keeps its value; everything else (attn/q layer 0 too) moves
    np.testing.assert_array_equal(q(before)[1], q(after)[1])
    assert not np.array_equal(q(before)[0], q(after)[0])
    assert sum(changed) == len(changed)
    zero_state = [x for x in jax.tree.leaves(states[9].opt_state, is_leaf=lambda x: hasattr(
        x, "total_zeroed")) if hasattr(x, "total_zeroed")][0]
    assert int(zero_state.num_zeroed) == 1 and int(zero_state.total_zeroed) == 1


def test_faults_off_or_idle_change_nothing(data):
  """A schedule that never fires compiles to the same trajectory as no fault injection."""
  data_config, dataset = data
  clean = small_config(data_config)
  idle = small_config(data_config, **{"faults.enabled": True, "faults.schedule": "1000:*:nan"})
  _, m1, s1 = run_steps(clean, dataset, 3)
  run, m2, s2 = run_steps(idle, dataset, 3)
  assert run.faults is not None and train_loop.build(clean, data=dataset, devices=jax.devices()[:1]).faults is None
  # Exact: an idle fault multiplies by 1.0 and selects the original values, the identity
  # in float arithmetic, so the same values reach the same ops.
  assert [float(m["loss"]) for m in m1] == [float(m["loss"]) for m in m2]
  jax.tree.map(np.testing.assert_array_equal, s1[-1].params, s2[-1].params)


def test_nan_loss_raises_after_n_steps_with_last_good_checkpoint(tmp_path, data,
                                                                 record_property):
  data_config, dataset = data
  # train.steps 8, as the other small_config runs: the good run's step is then the same program
  # as theirs (a persistent-cache hit); it stops after step 3 and the bad one raises at step 7.
  overrides = {"train.eval_every": 0, "checkpoint.every_steps": 0,
               "train.max_consecutive_nonfinite": 3, "logging.log_every": 1}
  good = small_config(data_config, **overrides)
  train_loop.train_and_evaluate(good, str(tmp_path / "good"), data=dataset,
                                devices=jax.devices()[:1], stop_at=3)
  bad = small_config(data_config, **overrides, **{"faults.enabled": True,
                                                   "faults.schedule": "4:-:nan_loss::100"})
  with pytest.raises(FloatingPointError, match=r"3 consecutive steps .*up to step 6.*"
                     r"max_consecutive_nonfinite=3.*saved at step 7 holds the last good"):
    train_loop.train_and_evaluate(bad, str(tmp_path / "bad"), data=dataset,
                                  devices=jax.devices()[:1])
  restored = {}
  for name, config in (("good", good), ("bad", bad)):
    run = train_loop.build(config, data=dataset, devices=jax.devices()[:1])
    ckpt = checkpointing.Checkpointer(str(tmp_path / name), 2)
    abstract = run.abstract_state
    step, state, _ = ckpt.restore(checkpointing.abstract_like(abstract, run.state_shardings),
                                  checkpointing.config_fingerprint(run.config, dataset.vocab_size))
    ckpt.close()
    restored[name] = (step, jax.tree.map(np.asarray, state.params))
  assert restored["good"][0] == 3 and restored["bad"][0] == 7
  record_property("faults_injected", 1)  # one NaN-loss fault (steps 4..)
  record_property("faults_detected", 1)
  # The params saved at step 7 are exactly those after step 3, the last finite one.
  jax.tree.map(np.testing.assert_array_equal, restored["good"][1], restored["bad"][1])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(restored["bad"][1]))
