"""Writes THRESHOLDS.md: false recoveries on a clean run against detection of injected spikes.

  .venv/bin/python scripts/threshold_sweep.py                       # trains 300 steps, then sweeps
  .venv/bin/python scripts/threshold_sweep.py --workdir workdirs/threshold_sweep  # reuses its log
  .venv/bin/python scripts/threshold_sweep.py --alphas 2,3 --betas 1.5 --draws 50 --out /tmp/t.md

1. Trains configs/tiny.py for --steps steps with precision.mode='static' (every unit runs the
   low-cost path, so the gradients do not depend on any controller setting) and gnmr.enabled=True
   (the controller still measures), logging every unit's GNMR at every step
   (logging.unit_log_every=1) to <workdir>/units.jsonl. A --workdir whose log already covers
   steps 1..--steps of a static run is reused without training.
2. Reconstructs each unit's gradient-norm sequence from its GNMR series: GNMR_t = n_t /
   mean(n_1..n_{t-1}) and GNMR is scale-free, so with n_1 = 1, n_t = GNMR_t * mean(n_1..n_{t-1}).
3. Replays the library's own controller (gnmr_jax.gnmr under jax.jit) on those norms for every
   setting of the grid, on the clean sequence and on copies with one injected spike (one unit's
   norm at one step after warmup times k).
4. Writes the report (--out) and the raw numbers (--json).

Definitions (as in gnmr_jax.faults.detection_report): row s of a mask array is the mask the
controller chose at step s, used by step s + 1. A spike at step s is detected if its unit is in the
mask chosen at step s or s + 1; latency = steps from the spike to the first step that runs the unit
on the recovery path (1 or 2). Chance = the same rule applied to the clean run for the same
(unit, step) draws: how often the unit would have been recovered there anyway.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_RECORD_FILE = "threshold_sweep_run.json"
SETTING_FIELDS = ("alpha", "beta", "delta", "max_o", "t_lock", "warmup")
PAPER_THRESHOLDS = (2.0, 1.5)  # alpha, beta of the paper (and of the config default until 2026-12-02)


def parse_floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x.strip()]


def parse_ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------------- the run


def make_config(steps: int):
  """configs/tiny.py in static precision mode, the controller measuring, units logged each step."""
  sys.path.insert(0, os.path.join(REPO, "configs"))
  import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.train.steps = steps
  config.precision.mode = "static"
  config.gnmr.enabled = True
  config.gnmr.priority = "gnmr"  # the run logs the paper's statistics; the sweep replays them
  config.diagnostics.recovery_gap_every = 0
  config.logging.unit_log_every = 1
  config.logging.plots = False
  config.logging.tensorboard = False
  return config


def train(config, workdir: str) -> dict:
  """Trains into an empty workdir with train_and_evaluate; records the config beside the logs."""
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  summary = train_loop.train_and_evaluate(config, workdir)
  record = {"config": config.to_dict(), "train_seconds": time.perf_counter() - started,
            "trained_by": "scripts/threshold_sweep.py",
            "trained_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
  with open(os.path.join(workdir, RUN_RECORD_FILE), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
  return summary


def load_unit_log(workdir: str, steps: int) -> dict:
  """The per-unit series of a run: gnmr, delta_gnmr and mask [T, N], unit names.

  Raises:
    ValueError: if the log is missing, does not start at step 1, skips a step, ends before
      `steps`, or holds a non-finite GNMR (logged as 1e30), from which no norm follows.
  """
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, metrics_log.UNITS_FILE)
  rows = metrics_log.read_jsonl(path)
  if not rows:
    raise ValueError(f"{path} is missing or empty: no per-unit GNMR series to reconstruct.")
  logged = [int(r["step"]) for r in rows]
  if logged[0] != 1:
    raise ValueError(f"{path} starts at step {logged[0]}, not 1: the norms are reconstructed "
                     f"from GNMR_1 on (train with logging.unit_log_every=1 from scratch).")
  gaps = [(a, b) for a, b in zip(logged, logged[1:]) if b != a + 1]
  if gaps:
    shown = ", ".join(f"{a}->{b}" for a, b in gaps[:5])
    raise ValueError(f"{path} skips steps ({shown}{', ...' if len(gaps) > 5 else ''}): every step "
                     f"is needed (train with logging.unit_log_every=1).")
  if logged[-1] < steps:
    raise ValueError(f"{path} ends at step {logged[-1]}, before --steps={steps}.")
  rows = rows[:steps]
  out = {k: np.asarray([r[k] for r in rows], np.float64) for k in ("gnmr", "delta_gnmr")}
  out["mask_used"] = np.asarray([r["mask"] for r in rows], bool)
  if not np.all(out["gnmr"] < 1e29):
    step, unit = np.argwhere(~(out["gnmr"] < 1e29))[0]
    raise ValueError(f"{path}: unit {unit} has a non-finite GNMR at step {step + 1}; its norm "
                     f"cannot be reconstructed.")
  names_path = os.path.join(workdir, metrics_log.UNIT_NAMES_FILE)
  with open(names_path, encoding="utf-8") as f:
    out["unit_names"] = json.load(f)
  return out


def is_complete(workdir: str, steps: int) -> bool:
  try:
    load_unit_log(workdir, steps)
  except (ValueError, OSError):
    return False
  return True


def read_json(path: str):
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def obtain_run(workdir: str, steps: int) -> dict:
  """Reuses a complete static run in workdir, or trains one into an empty workdir."""
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  summary_path = os.path.join(workdir, metrics_log.SUMMARY_FILE)
  if is_complete(workdir, steps):
    summary = read_json(summary_path) or {}
    if summary.get("precision_mode") != "static":
      raise ValueError(f"{workdir} holds a run with precision.mode="
                       f"{summary.get('precision_mode')!r}, not 'static': its gradients depend on "
                       f"the recovery masks of the controller setting it ran with. Use another "
                       f"--workdir.")
    return {"reused": True, "summary": summary,
            "record": read_json(os.path.join(workdir, RUN_RECORD_FILE))}
  if os.path.isdir(workdir) and os.listdir(workdir):
    raise ValueError(f"{workdir} is not empty but holds no complete unit log for steps "
                     f"1..{steps} (see the error of load_unit_log); give an empty or new "
                     f"--workdir to train into.")
  config = make_config(steps)
  summary = train(config, workdir)
  return {"reused": False, "summary": summary,
          "record": read_json(os.path.join(workdir, RUN_RECORD_FILE))}


# ------------------------------------------------------------------------- reconstruction


def norms_from_gnmr(gnmr_TxN: np.ndarray) -> np.ndarray:
  """Gradient norms (n_1 = 1 per unit) whose GNMR series is gnmr_TxN, in float64.

  n_1 = 1 and n_t = GNMR_t * mean(n_1 .. n_{t-1}); exact up to rounding because GNMR is
  invariant to scaling a unit's norms.

  Args:
    gnmr_TxN: GNMR_t of each unit, [steps, units], finite.

  Returns:
    float64 [steps, units].

  Example:
    >>> norms_from_gnmr(np.array([[1.0], [2.0], [0.5]]))[:, 0].tolist()
    [1.0, 2.0, 0.75]
  """
  gnmr_TxN = np.asarray(gnmr_TxN, np.float64)
  norms = np.empty_like(gnmr_TxN)
  norms[0] = 1.0
  total = norms[0].copy()
  for t in range(1, gnmr_TxN.shape[0]):
    norms[t] = gnmr_TxN[t] * (total / t)
    total += norms[t]
  return norms


def gnmr_from_norms(norms_TxN: np.ndarray) -> np.ndarray:
  """GNMR_t = n_t / mean(n_1 .. n_{t-1}), GNMR_1 = 1, in float64 (positive finite norms)."""
  norms_TxN = np.asarray(norms_TxN, np.float64)
  past_mean = np.cumsum(norms_TxN, axis=0)[:-1] / np.arange(1, norms_TxN.shape[0])[:, None]
  return np.concatenate([np.ones_like(norms_TxN[:1]), norms_TxN[1:] / past_mean], axis=0)


def max_relative_error(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))


# --------------------------------------------------------------------------------- replay


def replay(norms_BxTxN: np.ndarray, *, alpha: float, beta: float, delta: int, max_o: int,
           t_lock: int, warmup: int, priority: str = "gnmr") -> dict:
  """Runs the library's controller over batches of norm sequences, jitted.

  gnmr_jax.replay.replay: each step feeds one gradient leaf whose slice u holds n_t of
  unit u, so the controller's own norm of that slice is n_t.

  Args:
    norms_BxTxN: B independent sequences of T steps for N units (float32 after casting).
    alpha, beta, delta, max_o, t_lock, warmup: the controller setting (gnmr_jax.gnmr).
    priority: a `config.gnmr.priority` (gnmr_jax.control.from_config): 'gnmr' (the paper's
      rule, gnmr_jax.gnmr), 'norm' (gnmr_jax.norm_level), 'noise' (whose noise fraction is 0
      here: the static run measured no recovery gap, so only its transient alarm and non-finite
      rule act), 'hybrid' ('norm' with that alarm first; both gnmr_jax.control.research).

  Returns:
    numpy arrays [B, T, N]: mask (chosen at step t, used at t + 1), risky, gnmr, delta_gnmr.
  """
  from gnmr_jax import replay as replay_lib  # pylint: disable=g-import-not-at-top
  fields = ("mask", "risky", "gnmr", "delta_gnmr")
  return replay_lib.replay(dict(priority=priority, alpha=alpha, beta=beta, delta=delta,
                                max_o=max_o, t_lock=t_lock, warmup=warmup),
                           norms_BxTxN, fields=fields)


def draw_spikes(num_units: int, steps: int, warmup: int, draws: int, seed: int) -> np.ndarray:
  """[draws, 2] (unit, step) pairs; step in warmup + 1 .. steps - 1, so the next mask exists."""
  if steps - 1 <= warmup:
    raise ValueError(f"--steps={steps} leaves no step after warmup={warmup} with a next step.")
  rng = np.random.default_rng(seed)
  units = rng.integers(0, num_units, size=draws)
  spike_steps = rng.integers(warmup + 1, steps, size=draws)  # 1-based, <= steps - 1
  return np.stack([units, spike_steps], axis=1)


def inject(norms_TxN: np.ndarray, spikes: np.ndarray, factor: float) -> np.ndarray:
  """[len(spikes), T, N] copies of norms_TxN, each with one (unit, step) norm times factor."""
  batch = np.repeat(np.asarray(norms_TxN, np.float64)[None], len(spikes), axis=0)
  batch[np.arange(len(spikes)), spikes[:, 1] - 1, spikes[:, 0]] *= factor
  return batch


def detection(mask_BxTxN: np.ndarray, spikes: np.ndarray) -> dict:
  """Per spike b (unit u, step s): detected (u in the mask chosen at s or s + 1), latency."""
  idx = np.arange(len(spikes))
  units, rows = spikes[:, 0], spikes[:, 1] - 1
  at_spike = mask_BxTxN[idx, rows, units]
  at_next = mask_BxTxN[idx, rows + 1, units]
  already = np.where(rows > 0, mask_BxTxN[idx, np.maximum(rows - 1, 0), units], False)
  latency = np.where(at_spike, 1, np.where(at_next, 2, 0))
  return {"detected": at_spike | at_next, "latency": latency, "already_in_mask": already}


def sweep_setting(norms_TxN, spikes, factors, setting) -> dict:
  """Clean cost and spike detection of one controller setting."""
  batch = [np.asarray(norms_TxN, np.float64)[None]] + [inject(norms_TxN, spikes, k)
                                                       for k in factors]
  out = replay(np.concatenate(batch, axis=0), **setting)
  steps, num_units = norms_TxN.shape
  unit_steps = steps * num_units
  clean_mask = out["mask"][0]
  chance = detection(np.repeat(clean_mask[None], len(spikes), axis=0), spikes)
  row = dict(setting)
  row.update(recovered_pct=100.0 * clean_mask.sum() / unit_steps,
             exceedance_pct=100.0 * out["risky"][0].sum() / unit_steps,
             recovered_unit_steps=int(clean_mask.sum()),
             risky_unit_steps=int(out["risky"][0].sum()),
             chance_pct=100.0 * chance["detected"].mean(), spikes=[])
  for i, factor in enumerate(factors):
    masks = out["mask"][1 + i * len(spikes):1 + (i + 1) * len(spikes)]
    det = detection(masks, spikes)
    fresh = ~det["already_in_mask"]
    lat = det["latency"][det["detected"]]
    row["spikes"].append({
        "factor": factor, "draws": len(spikes), "detected": int(det["detected"].sum()),
        "detected_pct": 100.0 * det["detected"].mean(),
        "not_already_in_mask": int(fresh.sum()),
        "detected_not_already_in_mask": int((det["detected"] & fresh).sum()),
        "latency_1": int((lat == 1).sum()), "latency_2": int((lat == 2).sum()),
        "mean_latency": float(lat.mean()) if lat.size else None})
  return row


def cross_check(log: dict, norms_TxN: np.ndarray, setting: dict) -> dict:
  """Reconstruction errors, and the replay at the run's own setting against the run's log."""
  out = replay(norms_TxN[None], **setting)
  recomputed64 = gnmr_from_norms(norms_TxN)
  check = {"setting": setting,
           "gnmr_rel_err_float64": max_relative_error(recomputed64, log["gnmr"]),
           "gnmr_rel_err_library_float32": max_relative_error(out["gnmr"][0], log["gnmr"]),
           "delta_gnmr_rel_err_library_float32": max_relative_error(out["delta_gnmr"][0],
                                                                     log["delta_gnmr"])}
  # The log holds the mask *used* at each step = the mask chosen at the step before.
  chosen, used = out["mask"][0][:-1], log["mask_used"][1:]
  check.update(mask_unit_steps_compared=int(used.size),
               mask_mismatches=int(np.sum(chosen != used)),
               recovered_pct_replay=100.0 * out["mask"][0].sum() / out["mask"][0].size,
               exceedance_pct_replay=100.0 * out["risky"][0].sum() / out["risky"][0].size)
  return check


# --------------------------------------------------------------------------------- report


def _fmt_setting(r: dict) -> str:
  return (f"alpha {r['alpha']:g}, beta {r['beta']:g}, delta {r['delta']}, max_o {r['max_o']}, "
          f"t_lock {r['t_lock']}, warmup {r['warmup']}")


def _detect(r: dict, factor: float) -> float:
  return next(s["detected_pct"] for s in r["spikes"] if s["factor"] == factor)


def cost_key(r: dict):
  return (r["recovered_pct"], r["exceedance_pct"], -sum(s["detected_pct"] for s in r["spikes"]))


def conclusions(result: dict) -> list[str]:
  """The 'what follows' sentences, computed from the rows."""
  rows = sorted(result["rows"], key=cost_key)
  factors = result["factors"]
  default = result["default_setting"]
  lines = []

  def detections(r):
    return ", ".join(f"x{k:g} {_detect(r, k):.1f}%" for k in factors)

  match = [r for r in rows if all(r[k] == default[k] for k in default)]
  if match:
    d = match[0]
    lines.append(f"- The current default ({_fmt_setting(d)}) recovers {d['recovered_pct']:.2f}% of "
                 f"the clean run's unit-steps (exceedance {d['exceedance_pct']:.2f}%) and detects "
                 f"{detections(d)} (chance {d['chance_pct']:.1f}%).")
  for k in [f for f in (5.0, 10.0) if f in factors]:
    ok = [r for r in rows if _detect(r, k) >= 95.0]
    if ok:
      r = ok[0]
      edge = [f for f in ("alpha", "beta") if r[f] == max(result["grid"][f])]
      lines.append(f"- Cheapest setting with >= 95% detection of x{k:g} spikes: {_fmt_setting(r)}: "
                   f"{r['recovered_pct']:.2f}% recovered, {r['exceedance_pct']:.2f}% exceedance; "
                   f"detects {detections(r)}."
                   + (f" Its {' and '.join(edge)} {'are' if len(edge) > 1 else 'is'} the grid's "
                      f"largest: a wider grid may find a cheaper one." if edge else ""))
    else:
      best = max(rows, key=lambda r, k=k: _detect(r, k))
      lines.append(f"- No setting of the grid detects >= 95% of x{k:g} spikes; the best "
                   f"({_fmt_setting(best)}) detects {_detect(best, k):.1f}% at "
                   f"{best['recovered_pct']:.2f}% recovered.")
  spreads = ", ".join(f"x{k:g} {min(_detect(r, k) for r in rows):.1f}-"
                      f"{max(_detect(r, k) for r in rows):.1f}%" for k in factors)
  lines.append(f"- Detection across the grid: {spreads}; recovered % spans "
               f"{rows[0]['recovered_pct']:.2f}-{rows[-1]['recovered_pct']:.2f}%.")
  locks = sorted(result["grid"]["t_lock"])
  if len(locks) > 1:
    lo, hi = locks[0], locks[-1]
    pairs = [(a, b) for a in rows if a["t_lock"] == lo for b in rows if b["t_lock"] == hi
             and all(a[k] == b[k] for k in SETTING_FIELDS if k != "t_lock")]
    ratios = [b["recovered_pct"] / a["recovered_pct"] for a, b in pairs if a["recovered_pct"] > 0]
    gain = max(abs(_detect(b, k) - _detect(a, k)) for a, b in pairs for k in factors)
    if ratios:
      lines.append(f"- t_lock {hi} instead of {lo} (same other fields) multiplies recovered % by "
                   f"{min(ratios):.1f}-{max(ratios):.1f}x and changes detection (which only looks "
                   f"one step ahead) by at most {gain:.1f} points.")
  target = result["paper_target_pct"]
  under = [r for r in rows if r["recovered_pct"] < target]
  if under:
    r = max(under, key=lambda r: (sum(s["detected_pct"] for s in r["spikes"]), -r["recovered_pct"]))
    lines.append(f"- {len(under)} of {len(rows)} settings recover under the paper's "
                 f"{target:g}% of unit-steps; the best-detecting of them ({_fmt_setting(r)}) "
                 f"recovers {r['recovered_pct']:.3f}% and detects {detections(r)}.")
  else:
    r = rows[0]
    lines.append(f"- No setting recovers under the paper's {target:g}% of unit-steps on this "
                 f"run; the cheapest ({_fmt_setting(r)}) recovers {r['recovered_pct']:.2f}% and "
                 f"detects {detections(r)}.")
  return lines


def render(result: dict) -> str:
  v, run, check = result["versions"], result["run"], result["cross_check"]
  factors = result["factors"]
  cfg = run["config"]
  from gnmr_jax.control.config import t_lock_of  # pylint: disable=g-import-not-at-top
  grid = result["grid"]
  varying = [k for k in ("alpha", "beta", "delta", "max_o", "t_lock") if len(grid[k]) > 1]
  fixed = ", ".join(f"{k} {grid[k][0]:g}" for k in ("alpha", "beta", "delta", "max_o", "t_lock")
                    if len(grid[k]) == 1)
  lines = [
      "# GNMR thresholds: false recoveries against spike detection", "",
      f"Generated by `scripts/threshold_sweep.py` (do not edit by hand) on "
      f"{result['started'][:16].replace('T', ' ')} UTC: `{result['command']}`; "
      f"{v['cpu']}, {v['cores']} cores, jax backend {v['backend']}; Python {v['python']}, "
      f"jax {v['jax']}, optax {v['optax']}, flax {v['flax']}, numpy {v['numpy']}; "
      f"git {v['git']}. Replay + report took {result['sweep_seconds']:.0f} s.", "",
      "## The run", ""]
  if cfg:
    lines.append(
        f"`configs/tiny.py` with precision.mode='{cfg['precision']['mode']}' (every unit on "
        f"the {cfg['precision']['low_cost_path']} low-cost path, so the gradients do not depend "
        f"on the controller), gnmr.enabled=True (it only measures), "
        f"logging.unit_log_every={cfg['logging']['unit_log_every']}: model d_model "
        f"{cfg['model']['d_model']}, {cfg['model']['num_layers']} layers, "
        f"{cfg['model']['num_heads']} heads, ffn {cfg['model']['ffn_dim']}; data "
        f"`{cfg['data']['dataset']}` "
        f"({cfg['data']['tokenizer']}), sequence {cfg['data']['seq_len']}, batch "
        f"{cfg['data']['batch_size']}, seed {cfg['train']['seed']}; {cfg['train']['steps']} steps, "
        f"peak lr {cfg['optimizer']['learning_rate']:g} (warmup "
        f"{cfg['optimizer']['warmup_steps']}), grad clip {cfg['optimizer']['grad_clip']:g}; the "
        f"run's own controller setting: alpha {cfg['gnmr']['alpha']:g}, beta "
        f"{cfg['gnmr']['beta']:g}, delta {cfg['gnmr']['delta']}, max_o {cfg['gnmr']['max_o']}, "
        f"t_lock {t_lock_of(cfg['gnmr'])}, warmup {cfg['gnmr']['warmup']}.")
  summary = run["summary"]
  if not run["reused"]:
    origin = "trained by this invocation"
  elif run.get("trained_at"):
    origin = f"reused; trained by this script on {run['trained_at'][:16].replace('T', ' ')} UTC"
  else:
    origin = "reused"
  lines += ["", f"Workdir `{run['workdir']}` ({origin}"
            + (f", training took {run['train_seconds']:.0f} s" if run.get("train_seconds") else "")
            + f"); {result['num_units']} units x {result['steps']} steps = "
            f"{result['num_units'] * result['steps']} unit-steps; final validation perplexity "
            f"{summary.get('eval_perplexity', float('nan')):.3f}.", ""]
  lines += [
      "## How the numbers are made", "",
      "Each unit's gradient norms are rebuilt from its logged GNMR series (n_1 = 1, n_t = GNMR_t x "
      "mean(n_1..n_{t-1}); GNMR is scale-free) and fed to `gnmr_jax.gnmr` itself (one [N, 1, 1] "
      "leaf, one slice per unit, `units=`/`layer_axis=` selecting it; jitted, scanned over the "
      "steps). Checks on this run:", "",
      f"- GNMR recomputed from the rebuilt norms vs the log: max relative error "
      f"{check['gnmr_rel_err_float64']:.1e} (float64), "
      f"{check['gnmr_rel_err_library_float32']:.1e} (the library, float32). The log rounds GNMR "
      f"to 5 decimals, so the rebuilt norms are exact for the logged (rounded) series, which "
      f"differs from the run's own float32 values by at most 5e-6.",
      f"- Replaying the run's own setting ({_fmt_setting(check['setting'])}) reproduces the "
      f"logged recovery masks with {check['mask_mismatches']} mismatches in "
      f"{check['mask_unit_steps_compared']} unit-steps (dGNMR max relative error "
      f"{check['delta_gnmr_rel_err_library_float32']:.1e}, from the rounded GNMR); recovered "
      f"{check['recovered_pct_replay']:.3f}% / exceedance {check['exceedance_pct_replay']:.3f}% "
      f"(the run's summary: "
      f"{summary.get('recovered_unit_steps_pct', float('nan')):.3f}% / "
      f"{summary.get('threshold_exceedance_pct', float('nan')):.3f}%).", "",
      f"Columns: **recovered %** = unit-steps in the recovery mask on the clean run (false "
      f"recoveries: the cost); **exceedance %** = unit-steps over alpha or beta; for each spike "
      f"factor k, **xk** = % of {result['draws']} injected spikes detected (one unit's norm at one "
      f"step in {result['warmup'] + 1}..{result['steps'] - 1} times k, one spike per replay; the "
      f"same (unit, step) draws, seed {result['seed']}, for every k and setting); detected = the "
      f"unit is in the mask chosen at the spike step or the next (it runs on the recovery path "
      f"one or two steps after the spike; the mask chosen at step s is used at s + 1); **chance "
      f"%** = how often the same rule fires on the clean run for those draws; **lat xk** = mean "
      f"steps from the spike to its first recovered step. Fixed: {fixed}, warmup "
      f"{result['warmup']}. Sorted by recovered %.", ""]
  head = varying + ["recovered %", "exceedance %", "chance %"] + [f"x{k:g}" for k in factors]
  lat_k = 5.0 if 5.0 in factors else factors[0]
  head.append(f"lat x{lat_k:g}")
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in sorted(result["rows"], key=cost_key):
    cells = [f"{r[k]:g}" for k in varying]
    cells += [f"{r['recovered_pct']:.2f}", f"{r['exceedance_pct']:.2f}", f"{r['chance_pct']:.1f}"]
    cells += [f"{_detect(r, k):.1f}" for k in factors]
    lat = next(s["mean_latency"] for s in r["spikes"] if s["factor"] == lat_k)
    cells.append("-" if lat is None else f"{lat:.2f}")
    is_default = all(r[k] == v for k, v in result["default_setting"].items())
    if is_default:
      cells[0] = f"**{cells[0]}** (default)"
    lines.append("| " + " | ".join(cells) + " |")
  if result.get("priority_rows"):
    lines += ["", "## The budgeted priorities (`config.gnmr.priority`)", "",
              f"The same clean run and spike draws replayed through the budgeted priorities "
              f"(`config.gnmr.priority`; the default is '{result['default_priority']}'), max_o "
              f"{result['priority_rows'][0]['max_o']}, delta {result['priority_rows'][0]['delta']}, "
              f"warmup {result['warmup']}. 'norm' (the default until 2026-12-02) fills max_o every step after warmup by the "
              "gradient-norm level, so its recovered % is its budget; a spike is detected when "
              "the spiked unit enters its mask. 'noise' (issue 23) recovers by its noise fraction "
              "pi_u, which is 0 here (a static run measures no recovery gap: in int8 / bf16 the "
              "measured pi stays below 0.02, RESULTS.md 'Noise fraction'), so what acts is its "
              "copy of the paper's alarm at alpha / beta (and the non-finite rule); max_o is a "
              "cap. 'hybrid' is 'norm' with that alarm first: a unit over alpha / beta takes "
              "the budget before the norm level fills it (same spend as 'norm').", ""]
    head = ["priority", "alpha", "beta", "t_lock", "recovered %", "chance %"] + [
        f"x{k:g}" for k in factors] + [f"lat x{lat_k:g}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["priority_rows"]:
      lat = next(s["mean_latency"] for s in r["spikes"] if s["factor"] == lat_k)
      name = r["priority"] + (" (default)" if r["priority"] == result["default_priority"] else "")
      lines.append("| " + " | ".join(
          [name, f"{r['alpha']:g}", f"{r['beta']:g}", f"{r['t_lock']}",
           f"{r['recovered_pct']:.2f}", f"{r['chance_pct']:.1f}"]
          + [f"{_detect(r, k):.1f}" for k in factors]
          + ["-" if lat is None else f"{lat:.2f}"]) + " |")
  lines += ["", "## What follows", ""] + conclusions(result) + [
      "", f"These come from one {result['steps']}-step run of the tiny model in static mode, "
      "with synthetic single-step spikes; a routed (precision.mode='gnmr') run changes the "
      "gradients of the units it recovers, and real faults need not look like one-step "
      "multiplicative spikes. Raw "
      f"numbers, per spike factor: `{os.path.basename(result['json_path'])}`.", ""]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--workdir", default=os.path.join(REPO, "workdirs", "threshold_sweep"),
                      help="reused if its unit log covers steps 1..--steps, else trained into "
                           "(must then be empty or new)")
  parser.add_argument("--alphas", type=parse_floats, default=parse_floats("1.5,2,3,4"))
  parser.add_argument("--betas", type=parse_floats, default=parse_floats("1.5,2,3"))
  parser.add_argument("--deltas", type=parse_ints, default=parse_ints("8"))
  parser.add_argument("--max_os", type=parse_ints, default=parse_ints("4"))
  parser.add_argument("--t_locks", type=parse_ints, default=parse_ints("0,1,2,5"))
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--factors", type=parse_floats, default=parse_floats("2,5,10,100"))
  parser.add_argument("--priorities", default="norm,noise,hybrid",
                      help="budgeted priorities replayed beside the paper's rule (their own "
                           "table): at the default setting and, for 'noise' and 'hybrid' (the "
                           "ones with the paper's alarm), at alpha 4 / beta 3, each at every "
                           "--t_locks")
  parser.add_argument("--draws", type=int, default=200, help="spikes per factor")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=os.path.join(REPO, "THRESHOLDS.md"))
  parser.add_argument("--json", default=os.path.join(REPO, "threshold_sweep.json"))
  args = parser.parse_args()
  for name in ("steps", "draws"):
    if getattr(args, name) < 1:
      raise SystemExit(f"threshold_sweep.py: --{name} must be >= 1.")
  started = datetime.datetime.now(datetime.timezone.utc)
  workdir = os.path.abspath(args.workdir)
  try:
    run = obtain_run(workdir, args.steps)
    log = load_unit_log(workdir, args.steps)
  except ValueError as e:
    raise SystemExit(f"threshold_sweep.py: {e}") from None
  t0 = time.perf_counter()
  norms = norms_from_gnmr(log["gnmr"])
  steps, num_units = norms.shape
  from gnmr_jax.config import gnmr_config  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from gnmr_jax.control.config import t_lock_of  # pylint: disable=g-import-not-at-top
  from gnmr_jax import versions  # pylint: disable=g-import-not-at-top
  config = (run["record"] or {}).get("config")
  if not config:
    raise SystemExit(f"threshold_sweep.py: {workdir} holds no run record, so the controller "
                     "settings it ran with are unknown: use a fresh --workdir")
  run_gnmr = ml_collections.ConfigDict(config["gnmr"])
  run_gnmr.t_lock = t_lock_of(run_gnmr)
  check = cross_check(log, norms, {k: run_gnmr[k] for k in SETTING_FIELDS})
  spikes = draw_spikes(num_units, steps, args.warmup, args.draws, args.seed)
  rows = []
  grid = {"alpha": args.alphas, "beta": args.betas, "delta": args.deltas, "max_o": args.max_os,
          "t_lock": args.t_locks}
  for alpha, beta, delta, max_o, t_lock in itertools.product(*grid.values()):
    setting = {"alpha": alpha, "beta": beta, "delta": delta, "max_o": max_o, "t_lock": t_lock,
               "warmup": args.warmup}
    row = sweep_setting(norms, spikes, args.factors, setting)
    rows.append(row)
    print(f"{_fmt_setting(row)}: recovered {row['recovered_pct']:.2f}%, detected "
          + ", ".join(f"x{s['factor']:g} {s['detected_pct']:.0f}%" for s in row["spikes"]),
          file=sys.stderr)
  defaults = gnmr_config()
  defaults.t_lock = t_lock_of(defaults)
  priority_rows = []
  for priority in [p for p in args.priorities.split(",") if p]:
    # The paper's thresholds, and the alarm's (the config default since 2026-12-02) for the
    # priorities that carry the paper's alarm.
    alphas = (PAPER_THRESHOLDS, (4.0, 3.0)) if priority in ("noise", "hybrid") else (
        PAPER_THRESHOLDS,)
    for (alpha, beta), t_lock in itertools.product(alphas, args.t_locks):
      setting = {"alpha": alpha, "beta": beta, "delta": defaults.delta,
                 "max_o": defaults.max_o, "t_lock": t_lock, "warmup": args.warmup}
      row = sweep_setting(norms, spikes, args.factors, {**setting, "priority": priority})
      row["priority"] = priority
      priority_rows.append(row)
      print(f"{priority}: {_fmt_setting(row)}: recovered {row['recovered_pct']:.2f}%, detected "
            + ", ".join(f"x{s['factor']:g} {s['detected_pct']:.0f}%" for s in row["spikes"]),
            file=sys.stderr)
  result = {
      "started": started.isoformat(), "command": "python " + " ".join(
          [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
      "versions": versions.versions(("jax", "optax", "flax", "numpy"), repo=REPO,
                                    with_machine=True), "steps": steps, "num_units": num_units,
      "unit_names": log["unit_names"], "warmup": args.warmup, "draws": args.draws,
      "seed": args.seed, "factors": args.factors, "grid": grid, "paper_target_pct": 0.2,
      "default_setting": {k: defaults[k] for k in SETTING_FIELDS},
      "run": {"workdir": os.path.relpath(workdir, REPO) if workdir.startswith(REPO) else workdir,
              "reused": run["reused"], "config": config, "summary": run["summary"],
              "train_seconds": (run["record"] or {}).get("train_seconds"),
              "trained_at": (run["record"] or {}).get("trained_at")},
      "cross_check": check, "spike_draws": spikes.tolist(), "rows": rows,
      "priority_rows": priority_rows, "default_priority": defaults.priority,
      "json_path": args.json}
  result["sweep_seconds"] = time.perf_counter() - t0
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(render(result))
  print(f"wrote {args.out} and {args.json}")


if __name__ == "__main__":
  main()
