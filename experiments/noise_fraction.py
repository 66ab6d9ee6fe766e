"""Issue 23: does the noise-fraction controller spend precision only where it buys loss?

One JSON per (regime, arm, seed) under experiments/results/noise_fraction/<regime>/<arm>/
seed<k>.json: a run whose JSON exists is skipped, so an interrupted sweep resumes where it
stopped (sessions are 180 minutes; a sweep may take several). Each seed has its own data order
and init (config.train.seed = config.data.seed = seed); '<arm>_perturb' reruns a seed with the
initial params multiplied by (1 + 1e-7 z), the noise floor.

Regimes:
  default   configs/tiny.py as `make train` runs it (int8 low-cost, bf16 recovery, 300 steps).
            The goal: <= 1% of unit-steps recovered and the loss within the seed noise of
            static int8, where the default until 2026-12-02, 'norm', recovered ~13% for no
            measured gain.
  nvfp4, mxfp8  the scenario CPU model (experiments/scenario1_saved_activation.py base('cpu'):
            d 128, 4 layers, 200 steps) with the emulated NVFP4 / MXFP8 low-cost path and a
            bf16 recovery path: first the static gaps (is there anything to recover?).
  wsd8      issue 22's setting: 8 layers, 400 steps, warmup-stable-decay, NVFP4 (SR gradients)
            against bf16, with NVIDIA's static recipes as arms; variants wsd8rtn (RTN
            gradients), wsd8lr (lr 1e-2), wsd8long (1600 steps): WSD8_VARIANTS below. The
            report checks issue 23's goal where risk moves in each of them.
  wsd8gpu   issue 23's item 5: wsd8 at the 60m size (d 512, 8 layers, ffn 1376: 25M parameters
            besides the byte embeddings; seq 256, batch 64), 1000 steps, for a lent GPU:
            scripts/gpu_noise_fraction.sh runs its deciding arms (a dry run on CPU: --smoke).

Arms: static_low (every unit int8, no recovery), static_rec (every unit bf16), norm (the
default priority until 2026-12-02, at the paper's thresholds alpha 2 / beta 1.5, t_lock 5),
alarm (the paper's rule at alpha 4 / beta 3, t_lock 2: the config default since), noise ('noise' priority: pi_u against 1/3 and 1/6, the paper's alarm at
alpha 4 / beta 3, the 'uniform' pass every 50 steps from warmup + 1, split halves), noisenorm
(the same gate, candidates ranked by the norm level: gnmr.noise_rank='norm'), noisegate (any
unit's pi over 1/3 makes every unit a candidate, ranked by the norm level: noise_gate='any'),
and the baselines of issue 23's list at 'norm''s cap (max_o, t_lock 5; the cap, not the spend:
each arm's recovered unit-steps are reported): gnmr (the paper's rule at its thresholds alpha 2
/ beta 1.5), random (max_o units drawn uniformly, redrawn as locks expire: every t_lock + 1
steps), gap (the measured recovery gap, 'recovery' pass every 50 steps, as in RESULTS.md
"Selection").

  python experiments/noise_fraction.py --regimes default --seeds 3
  python experiments/noise_fraction.py --part report     # prints the RESULTS.md section
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

from experiments import common  # noqa: E402  pylint: disable=g-import-not-at-top
from gnmr_jax import versions as versions_lib  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import selection_report  # noqa: E402  pylint: disable=g-import-not-at-top

RESULTS = COMMITTED_RESULTS = os.path.join(common.RESULTS_DIR, "noise_fraction")
ARMS = ("static_low", "static_rec", "norm", "alarm", "noise", "noisenorm", "noisegate", "gnmr",
        "random", "gap")
PERTURBATION = 1e-7
NOISE = common.NOISE_PRIORITY
GAP = {"recovery_gap_every": 50, "recovery_gap_start": 0, "recovery_gap_pass": "uniform",
       "recovery_gap_split": True}


# wsd8 and its variants (issue 22: which setting makes an NVFP4 gap larger than the noise
# floor?): 'wsd8rtn' rounds the incoming gradient to nearest instead of stochastically (the
# biased backward that NVIDIA's recipe avoids with SR); 'wsd8lr' raises the learning rate 3.3x
# (3e-3 -> 1e-2); 'wsd8long' trains 4x longer (1600 steps, the same 20% decay), where FP4 All
# the Way's gradient-below-noise effect should show if it shows at this width.
WSD8_VARIANTS = {"wsd8": {}, "wsd8rtn": {"precision": {"nvfp4_gradient_rounding": "nearest"}},
                 "wsd8lr": {"optimizer": {"learning_rate": 1e-2}},
                 "wsd8long": {"train": {"steps": 1600, "eval_every": 200}},
                 "wsd8gpu": {"train": {"steps": 1000, "eval_every": 250}}}
GPU_REGIMES = ("wsd8gpu",)  # scenario1's 'gpu' scale: the 60m model, seq 256, batch 64
REGIMES = ("default", "nvfp4", "mxfp8", *WSD8_VARIANTS)
# wsd8: issue 22's first-measurement setting (the quick probe's): 8 layers, 400 steps,
# warmup-stable-decay (linear decay over the last 20%); NVFP4 (RTN forward, SR gradients) is the
# low-cost path, 'static_mxfp8' the MXFP8 one; static_low also measures the gap every
# PREFLIGHT_EVERY steps (the pre-flight: pi_u traces; measuring leaves the trajectory as it is).
WSD8 = {"layers": 8, "steps": 400, "decay_fraction": 0.2}
PREFLIGHT_EVERY = 10
# The static recipes at ~12.5% of unit-steps in wsd8: the last of 8 layers (7 of 56 units) for
# the whole run, or every unit for the last eighth of the steps (from step 351 of 400; the
# switch step follows train.steps in the variants).
# 'late_switch_fwd' is NVIDIA's forward-only late switch: from step 351 the forward runs in bf16
# and the backward stays NVFP4 (recovery path 'nvfp4_backward').
LATE = {"priority": "late_switch", "max_o": 56}  # switch_step: set in arm_config
STATIC_RECIPES = {"last_blocks": ({"priority": "last_blocks", "last_blocks": 1, "max_o": 7}, {}),
                  "late_switch": (LATE, {}),
                  "late_switch_fwd": (LATE, {"recovery_path": "nvfp4_backward"})}


def base_config(regime: str):
  if regime not in REGIMES:
    raise SystemExit(f"unknown regime {regime!r}; valid: {list(REGIMES)}")
  if regime == "default":
    import tiny  # pylint: disable=g-import-not-at-top
    config = tiny.get_config()
    # The controller of every arm before 2026-12-02 ('norm' at the paper's thresholds), pinned.
    config.gnmr.update(common.EXPERIMENT_CONTROLLER, priority="norm")
  else:
    from experiments import scenario1_saved_activation as scenario1  # pylint: disable=g-import-not-at-top
    config = scenario1.base("gpu" if regime in GPU_REGIMES else "cpu")
    path = "nvfp4" if regime in WSD8_VARIANTS else regime
    config.precision.update(mode="gnmr", low_cost_path=path, recovery_path="bf16")
    config.gnmr.priority = "norm"
    config.logging.unit_log_every = 0
    if regime in WSD8_VARIANTS:
      config.gnmr.max_o = 7  # the static recipes' spend (12.5% of unit-steps) as the cap
      config.model.num_layers = WSD8["layers"]
      config.train.steps, config.train.eval_every = WSD8["steps"], 100
      config.optimizer.update(schedule="wsd", decay_fraction=WSD8["decay_fraction"])
      for group, fields in WSD8_VARIANTS[regime].items():
        config[group].update(fields)
  config.logging.progress_bar = False
  config.logging.plots = False
  config.logging.tensorboard = False
  config.checkpoint.every_steps = 0
  return config


def arm_config(regime: str, arm: str, seed: int):
  config = base_config(regime)
  if arm.endswith("_perturb"):
    arm = arm[:-len("_perturb")]
    config.train.init_perturbation = PERTURBATION
  if arm == "static_low":
    config.precision.mode = "static"
    if regime in WSD8_VARIANTS:  # the pre-flight's measurements
      config.diagnostics.update(GAP, recovery_gap_every=PREFLIGHT_EVERY)
      config.logging.unit_log_every = PREFLIGHT_EVERY
  elif arm == "static_rec":
    config.precision.mode = "static"
    config.precision.low_cost_path = config.precision.recovery_path
  elif arm == "static_mxfp8" and regime in WSD8_VARIANTS:
    config.precision.update(mode="static", low_cost_path="mxfp8")
  elif arm == "alarm":  # the paper's rule as a transient alarm (the library default since 12-02)
    config.gnmr.update(common.ALARM_PRIORITY)
  elif arm in ("gnmr", "random"):  # the paper's rule at its thresholds; the same-budget draw
    config.gnmr.priority = arm
  elif arm == "gap":  # the measured recovery gap ('recovery' pass every 50 steps), as in Selection
    config.gnmr.priority = "gap"
    config.diagnostics.update(recovery_gap_every=GAP["recovery_gap_every"], recovery_gap_start=0)
  elif arm in ("noise", "noisenorm", "noisegate"):  # ranked by the norm level / gate 'any'
    config.gnmr.update(NOISE, noise_rank="pi" if arm == "noise" else "norm",
                       noise_gate="any" if arm == "noisegate" else "unit")
    config.diagnostics.update(GAP)
  elif arm in STATIC_RECIPES and regime in WSD8_VARIANTS:
    config.gnmr.update(STATIC_RECIPES[arm][0])
    config.precision.update(STATIC_RECIPES[arm][1])
    if config.gnmr.priority == "late_switch":
      config.gnmr.switch_step = config.train.steps - config.train.steps // 8 + 1
  elif arm != "norm":
    raise SystemExit(f"unknown arm {arm!r}; valid: {list(ARMS)} (+ '_perturb'; wsd8 also "
                     f"'static_mxfp8', {list(STATIC_RECIPES)})")
  config.train.seed = config.data.seed = seed
  if SMOKE["on"]:
    shrink(config)
  return config


SMOKE = {"on": False}  # --smoke: every config shrunk to seconds (dry runs of the device script)


def shrink(config):
  """The same regime and arm at a size that trains in seconds on CPU: a dry run of the code path
  (model, paths, controller, measuring pass, late switch) before device time is spent, never a
  result (--smoke writes under its own --results / --runs)."""
  config.model.update(d_model=64, ffn_dim=128, num_heads=2, num_kv_heads=2)
  config.data.update(seq_len=32, batch_size=4, num_eval_batches=2)
  config.train.steps, config.train.eval_every = 16, 8
  config.optimizer.warmup_steps = 2
  config.gnmr.warmup = 2
  if config.gnmr.get("priority") == "late_switch":
    config.gnmr.switch_step = config.train.steps - config.train.steps // 8 + 1
  if config.diagnostics.recovery_gap_every:
    config.diagnostics.recovery_gap_every = min(config.diagnostics.recovery_gap_every, 4)
  if config.logging.unit_log_every:
    config.logging.unit_log_every = min(config.logging.unit_log_every, 4)


def result_path(regime, arm, seed):
  return os.path.join(RESULTS, regime, arm, f"seed{seed}.json")


def run_one(regime, arm, seed, data=None):
  """Trains one (regime, arm, seed) unless its JSON exists; returns the JSON's dict."""
  path = result_path(regime, arm, seed)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  config = arm_config(regime, arm, seed)
  workdir = common.run_dir("noise_fraction", regime, arm, seed)
  t0 = time.time()
  summary = train_loop.train_and_evaluate(config, workdir, data=data)
  if summary.get("preempted"):  # SIGTERM: checkpointed; the next sweep resumes this run
    raise SystemExit(f"[noise_fraction] {regime} {arm} seed{seed} preempted at step "
                     f"{summary['step']} (checkpoint in {workdir}); rerun to resume")
  routed = config.precision.mode == "gnmr"
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  curve = [[r["step"], r["eval_loss"]] for r in metrics_log.read_jsonl(
      os.path.join(workdir, metrics_log.EVAL_FILE))]
  out = {"regime": regime, "arm": arm, "seed": seed, "eval_loss": summary["eval_loss"],
         "eval_curve": curve,
         "recovered_unit_steps_pct": summary.get("recovered_unit_steps_pct", 0.0) if routed
         else 0.0, "tokens_per_s": summary["tokens_per_s"], "wall_seconds": time.time() - t0,
         "steps": summary["step"], "smoke": SMOKE["on"], "date": time.strftime("%Y-%m-%d"),
         "device": common.device_description(), "versions": versions_lib.versions()}
  common.write_json(path, out)
  print(f"[noise_fraction] {regime} {arm} seed{seed}: loss {out['eval_loss']:.4f} recovered "
        f"{out['recovered_unit_steps_pct']:.2f}% ({out['wall_seconds']:.0f} s)", flush=True)
  return out


def load(regime):
  """{arm: {seed: result}} of every JSON written for ``regime``."""
  out = {}
  root = os.path.join(RESULTS, regime)
  if not os.path.isdir(root):
    return out
  for arm in sorted(os.listdir(root)):
    for name in sorted(os.listdir(os.path.join(root, arm))):
      if name.endswith(".json"):
        with open(os.path.join(root, arm, name), encoding="utf-8") as f:
          row = json.load(f)
        if row.get("smoke") and not SMOKE["on"]:  # a dry run's: a shrunk model, never a result
          raise SystemExit(f"{os.path.join(root, arm, name)} is a --smoke dry run: remove it")
        out.setdefault(arm, {})[row["seed"]] = row
  return out


def _paired(results, a, b):
  """Mean and SE of the per-seed differences loss(a) - loss(b) over their common seeds (None
  with fewer than 2)."""
  mean, se, n = selection_report.paired(results.get(a, {}).values(),
                                        results.get(b, {}).values())
  return (mean, se, n) if n >= 2 else None


def _static_gap(results, low):
  """The static gap of `low` against static_rec: final and at every evaluation (its growth)."""
  seeds = sorted(set(results.get(low, {})) & set(results.get("static_rec", {})))
  if len(seeds) < 2:
    return []
  gaps = [results[low][k]["eval_loss"] - results["static_rec"][k]["eval_loss"] for k in seeds]
  rec_sd = statistics.stdev(results["static_rec"][k]["eval_loss"] for k in seeds)
  mean = statistics.mean(gaps)
  out = [f"- static gap ({low} - static_rec, per seed): {mean:+.4f} nats, per-seed "
         f"{', '.join(f'{g:+.4f}' for g in gaps)}; seed SD of static_rec {rec_sd:.4f}: "
         f"the gap is {'more' if mean > 3 * rec_sd else 'not more'} than 3 seed SDs"]
  curves = [(dict(map(tuple, results[low][k].get("eval_curve", []))),
             dict(map(tuple, results["static_rec"][k].get("eval_curve", [])))) for k in seeds]
  steps = sorted(set.intersection(*[set(a) & set(b) for a, b in curves])) if curves else []
  if steps:
    parts = []
    for t in steps:
      d = [a[t] - b[t] for a, b in curves]
      parts.append(f"step {t}: {statistics.mean(d):+.4f} +- {statistics.stdev(d):.4f}")
    out.append(f"- its growth over training (mean +- SD over seeds): {'; '.join(parts)}")
  return out


def _closed_lines(results):
  """Per routed arm: the static_low-to-static_rec gap it closes, pooled over the seeds all three
  have: mean (L_low - L_arm) / mean (L_low - L_rec), and its mean recovered unit-steps. Not
  given where the static gap is not resolved (under 2 SE of its paired difference): a share of
  a gap that is noise is noise over noise (mxfp8's +0.0005 +- 0.0087 gave 'closes 4.24')."""
  gap = _paired(results, "static_low", "static_rec")
  if gap and not gap[0] >= 2 * gap[1]:
    return [f"- shares of the static gap not given: static_low - static_rec {gap[0]:+.4f} +- "
            f"{gap[1]:.4f} nats ({gap[2]} seeds) is under 2 SE"]
  out = []
  for arm in sorted(a for a in results if not a.startswith("static") and
                    not a.endswith("_perturb")):
    closed = _closed_share(results, arm)
    if closed:
      out.append(f"- {arm}: closes {closed[0]:.2f} of the static gap (pooled over {closed[2]} "
                 f"seeds) at {closed[1]:.2f}% of unit-steps")
  return out


def _closed_share(results, arm):
  """(pooled share of the static gap `arm` closes, its mean recovered unit-steps %, seeds)."""
  low, rec = results.get("static_low", {}), results.get("static_rec", {})
  seeds = sorted(set(low) & set(rec) & set(results.get(arm, {})))
  gap = sum(low[k]["eval_loss"] - rec[k]["eval_loss"] for k in seeds)
  if len(seeds) < 2 or gap <= 0:
    return None
  closed = sum(low[k]["eval_loss"] - results[arm][k]["eval_loss"] for k in seeds) / gap
  return closed, statistics.mean(results[arm][k]["recovered_unit_steps_pct"] for k in seeds), \
      len(seeds)


def _floor_diffs(results, arm):
  """Per seed, the perturbed minus the unperturbed final loss of `arm` (its noise floor)."""
  seeds = sorted(set(results.get(f"{arm}_perturb", {})) & set(results.get(arm, {})))
  return [results[f"{arm}_perturb"][k]["eval_loss"] - results[arm][k]["eval_loss"]
          for k in seeds]


def _floor(results, arm):
  """The largest |perturbed - unperturbed| final loss of `arm` (None if not measured)."""
  diffs = _floor_diffs(results, arm)
  return max(abs(d) for d in diffs) if diffs else None


def _goal_lines(results, arm="noise", recipes=("last_blocks", "late_switch", "late_switch_fwd")):
  """Issue 23's goal where risk moves, checked from the JSONs: `arm` closes >= 60% of the static
  gap with <= 10% of unit-steps, and beats the better static recipe (lower mean loss) by >= 2 SE
  of the paired per-seed difference and by more than the noise floor (the largest of `arm`'s
  and static_low's)."""
  closed = _closed_share(results, arm)
  present = [r for r in recipes if len(results.get(r, {})) >= 2]
  if closed is None or not present:
    return []
  # The better recipe on the seeds it shares with `arm` (the seeds the paired test uses).
  def shared_mean(recipe):
    seeds = set(results[recipe]) & set(results.get(arm, {}))
    return statistics.mean(results[recipe][k]["eval_loss"] for k in seeds) if seeds else math.inf

  best = min(present, key=shared_mean)
  paired = _paired(results, arm, best)
  floors = [f for f in (_floor(results, arm), _floor(results, "static_low")) if f is not None]
  floor = max(floors) if floors else None
  share, spend, n = closed
  checks = {"closes >= 0.60 of the gap": share >= 0.6, "<= 10% of unit-steps": spend <= 10}
  diff, se, _ = paired if paired else (math.nan, math.nan, 0)  # < 2 shared seeds: not met
  checks[f"beats {best} by >= 2 SE"] = bool(paired) and -diff >= 2 * se
  checks["by more than the noise floor"] = bool(paired) and floor is not None and -diff > floor
  verdict = "MET" if all(checks.values()) else "NOT met"
  detail = "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in checks.items())
  paired_text = (f"paired {arm} - {best} {paired[0]:+.4f} +- {paired[1]:.4f} nats "
                 f"({paired[2]} seeds)" if paired else f"fewer than 2 seeds shared with {best}")
  floor_text = f"{floor:.4f}" if floor is not None else "not measured"
  return [f"- goal (issue 23, where risk moves): {verdict}. '{arm}' closes {share:.2f} of the "
          f"gap ({n} seeds) at {spend:.2f}% of unit-steps; the better static recipe is {best}; "
          f"{paired_text}; noise floor {floor_text} nats. {detail}"]


def _nothing_hurts_lines(results, arms=("alarm", "noise")):
  """Issue 23's goal where nothing hurts (a regime whose static gap is within 3 seed SDs):
  each of `arms` (the default alarm, the adaptive priority) recovers <= 1% of unit-steps and
  ends within the seed noise of static_low: |mean paired loss difference| <= the seed SD of
  static_low over the same seeds (what changing the seed alone moves)."""
  out = []
  for arm in arms:
    seeds = sorted(set(results.get(arm, {})) & set(results.get("static_low", {})))
    if len(seeds) < 2:
      continue
    diff, se, n = selection_report.paired([results[arm][k] for k in seeds],
                                          [results["static_low"][k] for k in seeds])
    sd = statistics.stdev(results["static_low"][k]["eval_loss"] for k in seeds)
    spend = statistics.mean(results[arm][k]["recovered_unit_steps_pct"] for k in seeds)
    checks = {"<= 1% of unit-steps": spend <= 1.0, "within the seed SD of static_low":
              abs(diff) <= sd}
    verdict = "MET" if all(checks.values()) else "NOT met"
    detail = "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in checks.items())
    floor = _floor(results, "static_low")  # context only: the verdict uses the seed SD
    floor_text = f", noise floor of static_low {floor:.4f}" if floor is not None else ""
    out.append(f"- goal (issue 23, where nothing hurts): {verdict} by '{arm}': {spend:.2f}% of "
               f"unit-steps; paired {arm} - static_low {diff:+.4f} +- {se:.4f} nats ({n} seeds),"
               f" seed SD of static_low {sd:.4f}{floor_text}. {detail}")
  return out


def _preflight_lines(regime):
  root = os.path.join(RESULTS, "preflight", regime)
  if not os.path.isdir(root):
    return []
  rows = []
  for name in sorted(os.listdir(root)):
    with open(os.path.join(root, name), encoding="utf-8") as f:
      rows.append(json.load(f))
  out = [f"- pre-flight (static low-cost run, 'uniform' pass with split halves every "
         f"{rows[0]['every']} steps; pi_u = EMA(e_u^2) / EMA(||g_rec,u||^2), decay 0.5):"]
  for r in rows:
    ph = r["phases"]
    phase = "; ".join(f"{k} median e^2/||g_rec||^2 {v['median_raw_fraction']:.3g}, sampling/"
                      f"signal {v['median_sampling_over_signal']:.3g}"
                      for k, v in ph.items() if v["measurements"])
    out.append(f"  seed {r['seed']}: max pi over units and steps {max(r['pi_max']):.3g} (median "
               f"unit at the end {r['pi_median'][-1]:.3g}); units above 1/3: "
               f"{max(r['units_above_upper'])} at most, first at step "
               f"{r['first_step_above_upper']}; top-{r['top']} Jaccard early vs late "
               f"{r['jaccard_early_late']:.2f}, consecutive {r['jaccard_consecutive']:.2f}; "
               f"Spearman(pi_t, e_(t+K)) {r['spearman_pi_next_gap']:.2f}; {phase}")
  return out


def section() -> str:
  """The RESULTS.md section, from the JSONs."""
  lines = ["## Noise fraction (issue 23)", "",
           "Generated by `experiments/noise_fraction.py --part report` from "
           "experiments/results/noise_fraction/. Each seed has its own data order and init. "
           "tokens/s is each run's own figure on a shared machine (runs of one table may have "
           "run under different load): it is no speed comparison (benchmarks/ measure speed).",
           ""]
  for regime in REGIMES:
    results = load(regime)
    results.pop("preflight", None)
    if not results:
      lines += [f"Regime `{regime}`: no runs yet.", ""]
      continue
    lines += [f"### Regime `{regime}`", "",
              "| arm | seeds | eval loss (mean +- SD) | recovered unit-steps % | tokens/s |",
              "|---|---|---|---|---|"]
    for arm in sorted(results, key=lambda a: (a.endswith("_perturb"), a)):
      rows = list(results[arm].values())
      losses = [r["eval_loss"] for r in rows]
      sd = statistics.stdev(losses) if len(losses) > 1 else float("nan")
      lines.append(f"| {arm} | {len(rows)} | {statistics.mean(losses):.4f} +- {sd:.4f} | "
                   f"{statistics.mean(r['recovered_unit_steps_pct'] for r in rows):.2f} | "
                   f"{statistics.mean(r['tokens_per_s'] for r in rows):.0f} |")
    lines.append("")
    for low in ("static_low", "static_mxfp8"):
      lines += _static_gap(results, low)
    for a, b in (("noise", "static_low"), ("noise", "norm"), ("noisenorm", "static_low"),
                 ("noisenorm", "norm"), ("noisenorm", "noise"), ("noisegate", "static_low"),
                 ("noisegate", "norm"), ("norm", "static_low"),
                 ("static_rec", "static_low"), ("last_blocks", "static_low"),
                 ("late_switch", "static_low"), ("late_switch_fwd", "static_low"),
                 ("late_switch_fwd", "late_switch"), ("noise", "last_blocks"),
                 ("noise", "late_switch"), ("norm", "last_blocks"), ("norm", "late_switch"),
                 ("norm", "late_switch_fwd"), ("alarm", "static_low"), ("alarm", "norm"),
                 ("alarm", "static_rec"), ("gnmr", "static_low"), ("gnmr", "norm"),
                 ("gnmr", "late_switch"), ("random", "static_low"), ("random", "norm"),
                 ("random", "late_switch"),
                 ("gap", "static_low"), ("gap", "norm"), ("gap", "late_switch")):
      paired = _paired(results, a, b)
      if paired:
        lines.append(f"- paired {a} - {b}: {paired[0]:+.4f} +- {paired[1]:.4f} nats (SE, "
                     f"{paired[2]} seeds)")
    for arm in sorted(a[:-len("_perturb")] for a in results if a.endswith("_perturb")):
      diffs = _floor_diffs(results, arm)
      if diffs:
        lines.append(f"- noise floor {arm} (init x (1 + {PERTURBATION:g} z)): perturbed - "
                     f"unperturbed per seed {', '.join(f'{d:+.4f}' for d in diffs)}; largest "
                     f"|difference| {max(abs(d) for d in diffs):.4f} nats")
    lines += _closed_lines(results)
    if regime in WSD8_VARIANTS:
      lines += _goal_lines(results)
    else:
      lines += _nothing_hurts_lines(results)
    lines += _preflight_lines(regime)
    dates = sorted({r["date"] for rows in results.values() for r in rows.values()})
    devices = sorted({r["device"] for rows in results.values() for r in rows.values()})
    lines += ["", f"Measured {', '.join(dates)} on {', '.join(devices)}.", ""]
  return "\n".join(lines)


def preflight(regime, seed, top=7, decay=0.5, upper=1 / 3):
  """The pre-flight of issue 23 from the static low-cost run's measurements (its
  recovery_gap.jsonl: the 'uniform' pass with split halves every PREFLIGHT_EVERY steps):
  pi_u = EMA(e_u^2) / EMA(||g_rec,u||^2) (the 'noise' priority's estimate, `decay` = gap_decay)
  per measurement; its spread over units, how many units are above `upper`, the Jaccard of the
  top-`top` set by pi early (first quarter of the measurements) vs late (last quarter), whether
  pi at one measurement ranks the units' gap at the next (Spearman), and per training phase
  (warmup, stable, decay) the median over units of the raw fraction e^2 / ||g_rec||^2 and of the
  sampling noise of the half batches against the signal (sampling_sq / signal_sq). Writes
  experiments/results/noise_fraction/preflight/<regime>/seed<k>.json."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  config = arm_config(regime, "static_low", seed)
  workdir = common.run_dir("noise_fraction", regime, "static_low", seed)
  rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.GAP_FILE))
  if not rows:
    raise SystemExit(f"no measurements in {workdir}: run `--regimes {regime} --arms static_low`")
  with open(os.path.join(workdir, metrics_log.UNIT_NAMES_FILE), encoding="utf-8") as f:
    names = json.load(f)
  steps = np.array([r["step"] for r in rows])
  e = np.array([r["gap"] for r in rows], np.float64)
  rel = np.array([r["gap_rel"] for r in rows], np.float64)
  rec = np.where(rel > 0, e / np.where(rel > 0, rel, 1.0), 0.0)
  signal = np.array([r["signal_sq"] for r in rows], np.float64)
  sampling = np.array([r["sampling_sq"] for r in rows], np.float64)
  num, ema_e, ema_r = np.zeros_like(e), np.zeros(e.shape[1]), np.zeros(e.shape[1])
  for i in range(len(rows)):  # the priority's EMAs (first measurement: its own value)
    w = decay if i else 0.0
    ema_e, ema_r = w * ema_e + (1 - w) * e[i] ** 2, w * ema_r + (1 - w) * rec[i] ** 2
    num[i] = ema_e / np.maximum(ema_r, 1e-30)
  q = max(len(rows) // 4, 1)
  early, late = set(np.argsort(-num[:q].mean(0))[:top]), set(np.argsort(-num[-q:].mean(0))[:top])
  tops = [set(np.argsort(-p)[:top]) for p in num]
  steps_total = config.train.steps
  decay_from = steps_total - max(1, round(steps_total * config.optimizer.get("decay_fraction",
                                                                               0.2)))
  phases = {"warmup": steps <= config.optimizer.warmup_steps,
            "stable": (steps > config.optimizer.warmup_steps) & (steps <= decay_from),
            "decay": steps > decay_from}
  raw = e ** 2 / np.maximum(rec ** 2, 1e-30)
  ratio = sampling / np.maximum(signal, 1e-30)
  out = {"regime": regime, "seed": seed, "every": int(steps[1] - steps[0]) if len(steps) > 1
         else None, "measurements": len(rows), "upper": upper, "top": top,
         "steps": steps.tolist(),
         "pi_max": num.max(1).tolist(), "pi_median": np.median(num, 1).tolist(),
         "pi_min": num.min(1).tolist(),
         "units_above_upper": (num > upper).sum(1).tolist(),
         "first_step_above_upper": int(steps[np.argmax((num > upper).any(1))])
         if (num > upper).any() else None,
         "jaccard_early_late": len(early & late) / len(early | late),
         "jaccard_consecutive": float(np.mean([len(a & b) / len(a | b)
                                               for a, b in zip(tops, tops[1:])])),
         "top_early": [names[i] for i in sorted(early)], "top_late": [names[i] for i in sorted(late)],
         "spearman_pi_next_gap": float(np.nanmean([common.spearman(num[i], e[i + 1])
                                                   for i in range(len(rows) - 1)])),
         "spearman_pi_next_relgap": float(np.nanmean([common.spearman(num[i], rel[i + 1])
                                                      for i in range(len(rows) - 1)])),
         "phases": {k: {"measurements": int(m.sum()),
                        "median_raw_fraction": float(np.median(raw[m])) if m.any() else None,
                        "median_sampling_over_signal": float(np.median(ratio[m])) if m.any()
                        else None,
                        "mean_gap_sq_sum": float(np.mean((e[m] ** 2).sum(1))) if m.any()
                        else None}
                    for k, m in phases.items()},
         "unit_names": names, "date": time.strftime("%Y-%m-%d"),
         "device": common.device_description(), "versions": versions_lib.versions()}
  path = os.path.join(RESULTS, "preflight", regime, f"seed{seed}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  print(f"[preflight] {regime} seed{seed}: pi max {max(out['pi_max']):.3g}, units above "
        f"{upper:.3g} at the end {out['units_above_upper'][-1]}, Jaccard early/late "
        f"{out['jaccard_early_late']:.2f}, Spearman pi -> next gap "
        f"{out['spearman_pi_next_gap']:.2f}", flush=True)
  return out


def main(argv=None):
  global RESULTS  # pylint: disable=global-statement  (--results moves every reader)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("run", "report", "preflight", "prepare"),
                      default="run", help="prepare: only the token caches of --regimes (under "
                      "$GNMR_JAX_DATA_DIR; a device without TFDS reads them, carried)")
  parser.add_argument("--regimes", default="default")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--seeds", type=int, default=3)
  common.add_dry_run_options(parser, COMMITTED_RESULTS)
  args = parser.parse_args(argv)
  common.check_dry_run(args, COMMITTED_RESULTS)
  RESULTS, common.RUNS_DIR, SMOKE["on"] = args.results, args.runs, args.smoke
  if args.part == "prepare":
    from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
    for regime in args.regimes.split(","):
      data = make_data(arm_config(regime, "static_low", 0).data)
      print(f"[prepare] {regime}: {data.vocab_size} tokens in the vocabulary, token cache under "
            f"{os.path.expanduser(data.config.data_dir)}", flush=True)
    return
  if args.part == "report":
    print(section())
    return
  if args.part == "preflight":
    for regime in args.regimes.split(","):
      for seed in range(args.seeds):
        preflight(regime, seed)
    return
  common.enable_compilation_cache()
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  for regime in args.regimes.split(","):
    data = make_data(arm_config(regime, "static_low", 0).data)  # re-seeded per run (for_config)
    for seed in range(args.seeds):
      for arm in args.arms.split(","):
        run_one(regime, arm, seed, data)


if __name__ == "__main__":
  main()
