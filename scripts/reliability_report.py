"""Writes RELIABILITY.md from measurements, never by hand.

  .venv/bin/python scripts/reliability_report.py            # tests + detection experiment
  .venv/bin/python scripts/reliability_report.py --skip_tests --steps 64

1. Runs the reliability tests with pytest --junitxml and reads, per test, its outcome, its wall
   time and the counts it recorded (record_property: faults injected / detected, runs resumed,
   bad inputs tried / refused).
2. Runs a detection experiment on configs/tiny.py:runlocal (CPU, seconds per run): one run per
   fault kind with a fault every `--every` steps on a rotating unit, plus a clean run; reports
   the fraction detected (unit in the mask within one step), recovery latency and false
   recoveries (mask entries no injected fault explains; on the clean run, every entry).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = ["tests/test_faults.py", "tests/test_reliability_checkpoints.py",
              "tests/test_reliability_preemption.py", "tests/test_multiprocess.py",
              "tests/test_reliability_config.py"]
COUNTS = ("faults_injected", "faults_detected", "runs_resumed", "bad_inputs_tried",
          "bad_inputs_refused")
KINDS = [("scale", 2.0), ("scale", 5.0), ("scale", 10.0), ("scale", 100.0), ("nan", None),
         ("inf", None), ("corrupt_output", 10.0)]

# What each fault is, how it is injected, what the system does, and the test proving it.
FAULTS = [
    ("Gradient spike (x10, x100) on one unit",
     "`faults.schedule='STEP:UNIT:scale:F'`: the unit's gradient times F inside the jitted step",
     "controller puts the unit in the recovery mask at that step (used from the next)",
     "test_faults.py::test_injected_faults_are_detected_and_nan_never_reaches_params"),
    ("NaN / Inf gradient on one unit", "`STEP:UNIT:nan` / `STEP:UNIT:inf`",
     "unit ranked first (score inf), history stays finite; `optimizer.nonfinite='skip'` skips "
     "the update, `'zero'` zeroes only that unit's update; params and AdamW moments stay finite",
     "test_faults.py::test_injected_faults_are_detected_and_nan_never_reaches_params"),
    ("Corrupted low-cost path (transient)", "`STEP:UNIT:corrupt_output:F:D`: the unit's low-cost "
     "output times F for D steps unless it is on the recovery path",
     "unit enters the mask at once; on the (clean) recovery path its GNMR falls below alpha",
     "test_faults.py::test_injected_faults_are_detected_and_nan_never_reaches_params"),
    ("Idle fault hook", "a schedule that never fires", "bit-identical trajectory to no hook",
     "test_faults.py::test_faults_off_or_idle_change_nothing"),
    ("NaN loss for many steps", "`STEP:-:nan_loss::D`",
     "after `train.max_consecutive_nonfinite` bad steps: FloatingPointError (train.py exit 3) "
     "with a checkpoint whose params equal the last finite step's",
     "test_faults.py::test_nan_loss_raises_after_n_steps_with_last_good_checkpoint"),
    ("SIGTERM", "signal to train.py mid-run",
     "step finishes, checkpoint saved, summary says preempted, exit 0",
     "test_reliability_preemption.py::test_sigterm_then_sigkill_then_restart_matches_"
     "uninterrupted_run"),
    ("SIGKILL at a random step", "signal to train.py mid-run, then the same command again",
     "resumes from the last periodic checkpoint; final params, optimizer + GNMR state, data "
     "position, every logged loss and the eval loss equal an uninterrupted run bit for bit",
     "test_reliability_preemption.py::test_sigterm_then_sigkill_then_restart_matches_"
     "uninterrupted_run"),
    ("Truncated latest checkpoint", "largest state file cut in half",
     "reported (warning + summary), moved to checkpoints_corrupted/, resumed from the previous "
     "one, ends bit for bit at the unbroken run's state",
     "test_reliability_checkpoints.py::test_truncated_latest_checkpoint_falls_back_and_resumes_"
     "exactly"),
    ("Corrupted latest checkpoint", "64 bytes flipped in place; a checksum that does not match; "
     "every checkpoint broken", "falls back to the previous one; none intact: ValueError",
     "test_reliability_checkpoints.py::test_flipped_bytes_and_bad_checksums_are_detected"),
    ("Checkpoint of another config / shape", "other model.num_layers; other optimizer state "
     "structure; other leaf shape", "refused with a ValueError naming the fields or leaves",
     "test_reliability_checkpoints.py::test_checkpoint_of_another_config_or_shape_is_refused"),
    ("Two processes", "train.py x2 with JAX_COORDINATOR_ADDRESS on localhost (gloo), 1 device "
     "each", "same losses, eval loss and checkpoint as one process with two devices",
     "test_multiprocess.py::test_two_processes_match_one_process_with_two_devices"),
    ("Bad config values", "hypothesis: 1-3 random overrides of any field (wrong types, "
     "out of range, NaN/Inf, unknown names, bad regexes and fault schedules)",
     "refused before tracing (TypeError at assignment, or ValueError naming the field), "
     "otherwise the train step traces",
     "test_reliability_config.py::test_random_overrides_are_refused_up_front_or_trace"),
]


def run_tests(junit: str) -> list[dict]:
  cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
         f"--junitxml={junit}", "-o", "junit_family=xunit1", *TEST_FILES]
  subprocess.run(cmd, cwd=REPO, check=False)
  rows = []
  for case in ET.parse(junit).getroot().iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
      if case.find(tag) is not None:
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    rows.append({"name": f"{case.get('file') or case.get('classname')}::{case.get('name')}",
                 "outcome": outcome, "seconds": float(case.get("time", 0)), "props": props})
  return rows


# The controllers of the detection experiment: the default (the paper's rule at the config's
# alpha 4 / beta 3, t_lock 2), the paper's rule at the paper's thresholds, 'norm' (the default
# until 2026-12-02, at its settings then), the noise-fraction priority (its alarm at the
# thresholds it runs with in experiments/: alpha 4, beta 3; the noise fraction itself needs the
# 'uniform' measuring pass, every 50 steps, so it is measured once in 64 steps here) and
# 'hybrid' ('norm' with that alarm first).
PAPER = {"alpha": 2.0, "beta": 1.5, "t_lock": 5}
PRIORITIES = {
    "gnmr": {"priority": "gnmr"},
    "gnmr_paper": {"priority": "gnmr", **PAPER},
    "norm": {"priority": "norm", **PAPER},
    "noise": {"priority": "noise", "alpha": 4.0, "beta": 3.0, "gap_decay": 0.5, "t_lock": 2},
    "hybrid": {"priority": "hybrid", "alpha": 4.0, "beta": 3.0, "t_lock": 2},
}


def detection_experiment(steps: int, every: int, priority: str = "gnmr") -> dict:
  sys.path.insert(0, os.path.join(REPO, "configs"))
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tiny  # pylint: disable=g-import-not-at-top
  from gnmr_jax import faults, train_loop  # pylint: disable=g-import-not-at-top
  from gnmr_jax.control.config import t_lock_of  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top

  base = tiny.get_config("runlocal")
  base.mesh.fsdp, base.mesh.data = 1, -1
  base.train.steps = steps
  base.gnmr.warmup = 5
  base.gnmr.update(PRIORITIES[priority])
  base.diagnostics.recovery_gap_every = 0
  if priority == "noise":
    base.diagnostics.update(recovery_gap_every=50, recovery_gap_pass="uniform",
                            recovery_gap_split=True)
  data = make_data(base.data)

  def run(schedule):
    config = base.copy_and_resolve_references()
    config.faults.enabled = bool(schedule)
    config.faults.schedule = schedule
    built = train_loop.build(config, data=data, devices=jax.devices()[:1])
    it = data.train_iterator()
    masks = []
    with train_loop.sharding.activation_sharding(built.mesh):
      state = built.init_state(jax.random.key(0))
      for _ in range(steps):
        state, m = built.train_step(state, train_loop.device_batch(built, next(it)))
        masks.append(np.asarray(m["unit_mask_next"]))
    injected = built.faults.faults if built.faults else []
    return faults.detection_report(injected, np.stack(masks), config.gnmr.warmup), len(
        built.unit_names)

  out = {"priority": priority, "controller": base.gnmr.priority, "steps": steps, "every": every, "warmup": base.gnmr.warmup,
         "alpha": base.gnmr.alpha, "beta": base.gnmr.beta,
         "max_o": base.gnmr.max_o, "t_lock": t_lock_of(base.gnmr), "kinds": []}
  clean, num_units = run("")
  out["clean"] = clean
  out["num_units"] = num_units
  for kind, factor in KINDS:
    items = []
    for i, step in enumerate(range(every, steps - 2, every)):
      unit = (3 * i + 1) % num_units
      spec = f"{step}:{unit}:{kind}"
      if kind == "corrupt_output":
        spec += f":{factor:g}:3"
      elif factor is not None:
        spec += f":{factor:g}"
      items.append(spec)
    report, _ = run(";".join(items))
    out["kinds"].append({"kind": kind, "factor": factor, **report})
  return out


def _default_priority() -> str:
  from gnmr_jax.config import gnmr_config  # pylint: disable=g-import-not-at-top
  return gnmr_config().priority


DEFAULT_PRIORITY = _default_priority()
PRIORITY_TEXT = {
    "gnmr": "The paper's rule (`gnmr_jax.gnmr`) at the config default's thresholds (alpha 4 / "
            "beta 3, t_lock 2): a unit over alpha or beta (or non-finite) is a candidate, the "
            "top max_o by score run the recovery path, each locked t_lock steps; max_o is a cap.",
    "gnmr_paper": "The paper's rule at the paper's thresholds (alpha 2 / beta 1.5, t_lock 5).",
    "norm": "The budgeted default until 2026-12-02 (`gnmr_jax.norm_level`, t_lock "
            "5): the max_o units with the "
            "largest gradient-norm level every step after warmup, non-finite units first. A "
            "finite spike is caught only if it lifts the unit into the top max_o past the locked "
            "ones, and the budget is spent whether or not anything is at risk.",
    "noise": "The noise-fraction priority (issue 23): candidates by the measured noise fraction "
             "(above 1/3) or by the paper's alarm at alpha 4 / beta 3 (and non-finite units), "
             "max_o a cap: the mask may be empty.",
    "hybrid": "'norm' with the paper's alarm first (`gnmr_jax.control.research.hybrid`, alpha 4 / "
              "beta 3): a unit over a threshold (or non-finite) takes the budget before the "
              "norm level fills it; the same spend as 'norm'.",
}


def render(tests, detection, started) -> str:
  lines = ["# Reliability", "",
           "Generated by `scripts/reliability_report.py` (do not edit by hand) on "
           f"{started:%Y-%m-%d %H:%M} UTC, {platform.machine()} CPU, {os.cpu_count()} cores, "
           f"Python {platform.python_version()}, jax "
           f"{__import__('jax').__version__}.", ""]
  if tests is not None:
    totals = collections.Counter()
    for t in tests:
      for k in COUNTS:
        totals[k] += int(t["props"].get(k, 0))
    passed = sum(t["outcome"] == "passed" for t in tests)
    lines += ["## Counts from the test run", "",
              f"{passed} of {len(tests)} reliability tests passed "
              f"({sum(t['seconds'] for t in tests):.0f} s of test time).", "",
              "| faults injected | detected / survived | runs resumed | bad inputs tried | "
              "bad inputs refused |", "|---|---|---|---|---|",
              "| " + " | ".join(str(totals[k]) for k in COUNTS) + " |", ""]
    lines += ["## Faults", "", "| fault | how it is injected | what the system does | test | "
              "result |", "|---|---|---|---|---|"]
    for fault, how, what, test in FAULTS:
      name = test.split("::")[1]
      cases = [t for t in tests if t["name"].split("::")[-1].split("[")[0] == name]
      result = (", ".join(sorted({c["outcome"] for c in cases})) +
                f" ({sum(c['seconds'] for c in cases):.0f} s)") if cases else "not run"
      lines.append(f"| {fault} | {how} | {what} | `{test}` | {result} |")
    lines += ["", "Per test (recorded counts):", ""]
    for t in tests:
      props = ", ".join(f"{k}={v}" for k, v in sorted(t["props"].items()))
      lines.append(f"- `{t['name']}`: {t['outcome']}, {t['seconds']:.1f} s"
                   + (f"; {props}" if props else ""))
    lines.append("")
  for d in detection or []:
    clean = d["clean"]
    lines += [f"## Detection experiment: priority '{d['priority']}'"
              + (" (the default)" if d["priority"] == DEFAULT_PRIORITY else ""), "",
              PRIORITY_TEXT[d["priority"]], "",
              f"`configs/tiny.py:runlocal` ({d['num_units']} units, alpha {d['alpha']}, beta "
              f"{d.get('beta', 'default')}, max_o "
              f"{d['max_o']}, t_lock {d['t_lock']}, controller warmup {d['warmup']}), "
              f"{d['steps']} steps per run, one fault every {d['every']} steps on a rotating "
              f"unit, `optimizer.nonfinite='skip'`. Detected = the unit is in the mask chosen "
              f"at the faulty step or the next (so it runs on the recovery path within one "
              f"step); latency = steps from the faulty step to the first step run on the "
              f"recovery path; false recoveries = mask entries after warmup that no injected "
              f"fault explains.", "",
              "| fault | injected | detected | detection rate | not already in the mask: detected "
              "| latency (steps) | false recoveries |", "|---|---|---|---|---|---|---|"]
    for k in d["kinds"]:
      lat = [r["latency"] for r in k["faults"] if r["latency"] is not None]
      lat_s = (f"{min(lat)}-{max(lat)} (mean {sum(lat) / len(lat):.2f})" if lat else "-")
      name = k["kind"] + (f" x{k['factor']:g}" if k["factor"] is not None else "")
      rate = 100.0 * k["detected"] / max(k["injected"], 1)
      fresh = [r for r in k["faults"] if not r["already_in_mask"]]
      lines.append(f"| {name} | {k['injected']} | {k['detected']} | {rate:.0f}% | "
                   f"{sum(r['detected'] for r in fresh)} of {len(fresh)} | {lat_s} | "
                   f"{k['false_recoveries']} |")
    lines += ["", f"Clean run (no fault): {clean['false_recoveries']} mask entries after warmup "
              f"over {clean['unit_steps']} unit-steps "
              f"({100.0 * clean['false_recoveries'] / max(clean['unit_steps'], 1):.2f}%): the "
              f"controller's own recoveries, not injected ones.", ""]
  lines += ["## Using the fault hook", "",
            "`--config.faults.enabled=True --config.faults.schedule='30:3:scale:10;40:mlp/up/"
            "kernel\\[1\\]:nan;50:-:nan_loss::2'` (format `STEP:UNIT:KIND[:FACTOR[:DURATION]]`, "
            "KIND in scale, nan, inf, corrupt_output, nan_loss; UNIT an index into "
            "`unit_names.json`, a regex over the names or `*`). Off by default; when off the "
            "train step has no fault code.", ""]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip_tests", action="store_true")
  parser.add_argument("--skip_detection", action="store_true")
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--every", type=int, default=8)
  parser.add_argument("--priorities", default=",".join(PRIORITIES),
                      help=f"controllers of the detection experiment, of {list(PRIORITIES)}")
  parser.add_argument("--out", default=os.path.join(REPO, "RELIABILITY.md"))
  parser.add_argument("--json", default=os.path.join(REPO, "reliability_results.json"))
  args = parser.parse_args()
  started = datetime.datetime.now(datetime.timezone.utc)
  tests = None
  if not args.skip_tests:
    with tempfile.TemporaryDirectory() as tmp:
      tests = run_tests(os.path.join(tmp, "junit.xml"))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  detection = None if args.skip_detection else [
      detection_experiment(args.steps, args.every, p) for p in args.priorities.split(",") if p]
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump({"started": started.isoformat(), "tests": tests, "detection": detection}, f,
              indent=1)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(render(tests, detection, started))
  print(f"wrote {args.out} and {args.json}")
  if tests is not None and any(t["outcome"] in ("failed", "error") for t in tests):
    sys.exit(1)


if __name__ == "__main__":
  main()
