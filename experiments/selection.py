"""Selection quality and the end-to-end recovery gap of every controller at equal budget.

    python experiments/selection.py --part quality --seeds 3       # the gap and who covers it
    python experiments/selection.py --part e2e --seeds 5           # losses, all regimes
    python experiments/selection.py --part e2e --regimes tensor4 --arms norm_max_o2,norm_max_o8

Model and data: the CPU model of scenario 1 (d=128, 4 layers, 28 projection units,
seq 64, batch 16, lr 3e-3, 200 steps, bytes). Regimes (the low-cost path / the
recovery path):
  tensor4  saved activations 4-bit, one scale per tensor, forward too / the same at 8 bits
  tensor2  the same at 2 bits / 8 bits
  block4   DeepSeek-V3-style blockwise 4-bit (1x32 tiles, 32x32 blocks) / bf16
  paper4   the paper's literal stress: 4-bit per-token, weight gradient only / 8 bits
           (the no-gap control)

Part 'quality': per regime and seed, one static low-cost run measures the recovery
gap e_u(t) at every step (config.diagnostics.recovery_gap_every=1) and logs every
unit's gradient norm. Since nothing is recovered in a static run, the trajectory is
the same whatever the controller chooses, so every controller is replayed on those
logs (the library's transforms, jitted) and scored at every step t > warmup against
the oracle top-max_o set by e_u(t): coverage (the share of the top set's gap in the
mask used at t), precision (|mask and top| / max_o), Spearman between the signal the
controller ranked by (at t - 1) and e_u(t), and the recovered share; plus the gap's
concentration (top-max_o share of sum e_u) and stability (Jaccard of consecutive top sets).

Part 'e2e': every controller trains in its own routing (precision.mode='gnmr') at the
same budget (max_o 4, t_lock 5, warmup 20), plus static low-cost and static recovery;
validation loss per seed, the paired per-seed share of the static-to-recovery gap
closed, and the recovered share. Results: experiments/results/selection_cpu.json;
experiments/report.py writes the RESULTS.md section.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import time

import ml_collections
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # pylint: disable=g-import-not-at-top
from experiments import scenario1_saved_activation as scenario1
from gnmr_jax import metrics_log
from gnmr_jax.precision import blockwise, registry
from gnmr_jax import versions as versions_lib

SCENARIO = "selection"
RESULTS = os.path.join(common.RESULTS_DIR, "selection_cpu.json")
GAP_EVERY = 10      # measurement period of the 'gap' controller (K)
HINDSIGHT = r"mlp/down"  # the hindsight static set: mlp/down of every layer
LATE_SWITCH_STEP = 175  # 'lateswitch': every unit recovered from this step on
# The 'noise' arms' settings (as experiments/noise_fraction.py's): the paper's alarm at alpha 4 /
# beta 3, measurements blended with weight 0.5.
NOISE = common.NOISE_PRIORITY

if "blockwise4" not in registry.available_paths():
  registry.register_path("blockwise4", lambda config, role: blockwise.blockwise_path(
      4, config.block_size))


def _sa(bits, scale, forward, mode="static"):
  return {"mode": mode, "low_cost_path": "saved_activation", "recovery_path": "saved_activation",
          "saved_activation_bits": bits, "recovery_saved_activation_bits": 8,
          "saved_activation_scale": scale, "saved_activation_forward": forward}


# regime -> (static low-cost, static recovery, routed) precision overrides
REGIMES = {
    "tensor4": (_sa(4, "tensor", True), _sa(8, "tensor", True), _sa(4, "tensor", True, "gnmr")),
    "tensor2": (_sa(2, "tensor", True), _sa(8, "tensor", True), _sa(2, "tensor", True, "gnmr")),
    "block4": ({"mode": "static", "low_cost_path": "blockwise4", "block_size": 32},
               {"mode": "static", "low_cost_path": "bf16"},
               {"mode": "gnmr", "low_cost_path": "blockwise4", "recovery_path": "bf16",
                "block_size": 32}),
    "paper4": (_sa(4, "token", False), _sa(8, "token", False), _sa(4, "token", False, "gnmr")),
}
# controller -> (config.gnmr overrides, config.diagnostics.recovery_gap_every)
CONTROLLERS = {
    "gnmr": ({"priority": "gnmr"}, 0),
    "random": ({"priority": "random"}, 0),
    "norm": ({"priority": "norm"}, 0),
    "gap": ({"priority": "gap"}, GAP_EVERY),
    # The same with the 'recovery' measuring pass: recovered units keep their estimate.
    "gaprec": ({"priority": "gap"}, GAP_EVERY),
    # The same with the 'uniform' pass: every unit measured, all low-cost against all recovered.
    "gapuni": ({"priority": "gap"}, GAP_EVERY),
    # The norm level scaled by the measured relative gap e_u / ||g_rec,u|| ('recovery' pass).
    "relgap": ({"priority": "relgap"}, GAP_EVERY),
    # The paper's transient alarm at the thresholds that catch x5 spikes at 0.26% of unit-steps
    # (THRESHOLDS.md); at the defaults (2, 1.5) it flags 8% of unit-steps and crowds out the fill.
    "hybrid": ({"priority": "hybrid", "alpha": 4.0, "beta": 3.0}, 0),
    # The paper's rule as a transient alarm at alpha 4 / beta 3, t_lock 2 (the config default
    # from 2026-12-02): max_o is a cap, the mask mostly empty.
    "alarm": (common.ALARM_PRIORITY, 0),
    # Lagged oracle: the top max_o by e_u(t), used at t + 1, no lock holding it back.
    "oracle": ({"priority": "oracle", "t_lock": 0}, 1),
    # The hindsight static set (every layer's mlp/down: as many units as layers, max_o = 4 for
    # the 4-layer CPU model), the library's 'fixed' priority.
    "hindsight": ({"priority": "fixed", "fixed_units": HINDSIGHT}, 0),
    # Issue 23's adaptive priority: pi_u = EMA(e_u^2) / EMA(||g_rec,u||^2) from the 'uniform'
    # pass (split halves), candidates above 1/3 down to 1/6, the paper's alarm at alpha 4 /
    # beta 3; max_o is a cap, the mask may be empty.
    "noise": (NOISE, GAP_EVERY),
    # The same gate, candidates ranked by the norm level (added after 'noise' K=50 closed less
    # than 'norm' on seed 0 at the same spend: pi decides whether, the norm level which).
    "noisenorm": ({**NOISE, "noise_rank": "norm"}, GAP_EVERY),
    # Any unit's pi over 1/3 makes every unit a candidate, ranked by the norm level (added after
    # 'noise' and 'noisenorm' closed none of the gap in tensor4: the units pi flags are not the
    # ones whose recovery buys loss; pi decides whether to spend, the norm level where).
    "noisegate": ({**NOISE, "noise_rank": "norm", "noise_gate": "any"}, GAP_EVERY),
    # NVIDIA's static recipes: the last block (7 units of the 4-layer model) for the whole run,
    # and every unit from step 175 (a late global switch: 26 of 200 steps, ~13% of unit-steps,
    # the spend of 'norm' at max_o 4).
    "lastblocks": ({"priority": "last_blocks", "last_blocks": 1, "max_o": 7}, 0),
    "lateswitch": ({"priority": "late_switch", "switch_step": LATE_SWITCH_STEP, "max_o": 28}, 0),
}
STATIC_ARMS = ("static_low", "static_rec")
MAX_O_SWEEP = (2, 8)


def base_config(steps=0):
  config = scenario1.base("cpu", steps)
  config.logging.unit_log_every = 0
  return config


PERTURBATION = 1e-7  # relative init perturbation of the '_perturb' arms (the noise floor)
GAP_PASS = {"gaprec": "recovery", "relgap": "recovery", "gapuni": "uniform",
            "noise": "uniform", "noisenorm": "uniform", "noisegate": "uniform"}  # else 'swapped'


def arm_config(regime, arm, seed, steps=0):
  """The config of one e2e arm: a static arm or
  '<controller>[_max_o<k>][_tlock<k>][_every<K>][_from<s>]' (max_o, t_lock, the gap
  measurement period K and its first step s overridden; s = 1 unless given), either with
  '_perturb' appended: the same run with the initial params perturbed by PERTURBATION
  (relative), whose distance to the unperturbed run is the noise floor."""
  low, rec, routed = REGIMES[regime]
  config = base_config(steps)
  if arm.endswith("_perturb"):
    arm = arm[:-len("_perturb")]
    config.train.init_perturbation = PERTURBATION
  if arm in STATIC_ARMS:
    config.precision.update(low if arm == "static_low" else rec)
  else:
    match = re.fullmatch(r"(?P<name>[a-z]+)(_max_o(?P<max_o>\d+))?(_tlock(?P<t_lock>\d+))?"
                         r"(_every(?P<every>\d+))?(_from(?P<start>\d+))?", arm)
    if not match or match["name"] not in CONTROLLERS:
      raise ValueError(f"unknown arm {arm!r}: a static arm {STATIC_ARMS} or "
                       f"'<controller>[_max_o<k>][_tlock<k>][_every<K>][_from<s>]' of "
                       f"{list(CONTROLLERS)}")
    name, max_o, t_lock, every = match["name"], match["max_o"], match["t_lock"], match["every"]
    # Measured from step 1 (the runs before recovery_gap_start existed) unless '_from<s>'.
    config.diagnostics.recovery_gap_start = int(match["start"] or 1)
    overrides, gap_every = CONTROLLERS[name]
    config.precision.update(routed)
    config.gnmr.update(overrides)
    config.diagnostics.recovery_gap_every = int(every) if every else gap_every
    config.diagnostics.recovery_gap_pass = GAP_PASS.get(name, "swapped")
    config.diagnostics.recovery_gap_split = overrides.get("priority") == "noise"
    if max_o:
      config.gnmr.max_o = int(max_o)
    if t_lock:
      config.gnmr.t_lock = int(t_lock)
  config.train.seed = config.data.seed = seed
  return config


def run_dir(part, regime, arm, seed):
  return common.run_dir(SCENARIO, part, f"{regime}/{arm}", seed)


def train(config, workdir, data=None):
  from gnmr_jax.train_loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
  if common._complete(workdir, config.train.steps, config):  # pylint: disable=protected-access
    with open(os.path.join(workdir, metrics_log.SUMMARY_FILE), encoding="utf-8") as f:
      return json.load(f)
  shutil.rmtree(workdir, ignore_errors=True)
  return train_and_evaluate(config, workdir, data=data)


# --- part 'quality' --------------------------------------------------------------------------


def replay(priority, norms, gaps, measured, g, gap_every, rec_norms=None):
  """Masks used at each step 1..T and the ranking signal after each step, for one controller
  replayed (gnmr_jax.replay) on logged per-unit norms [T, N], gaps [T, N] and
  recovery-gradient norms [T, N] (default: the gaps; only 'relgap' reads them), measured every
  `gap_every` steps where `measured` ([T] or [T, N]) holds (0: never)."""
  from gnmr_jax import replay as replay_lib  # pylint: disable=g-import-not-at-top
  num_steps, n = norms.shape
  g = ml_collections.ConfigDict(g.to_dict())
  g.priority = priority
  measured = np.asarray(measured, bool)
  measured = measured[:, None] if measured.ndim == 1 else measured
  on_step = ((np.arange(1, num_steps + 1) - 1) % gap_every == 0 if gap_every
             else np.zeros(num_steps, bool))
  # The signal each priority ranks by: the paper's score, the gap estimate, the relative gap
  # times the norm (its ranking's value), or the norm itself ('norm', 'hybrid').
  signal = {"gnmr": "score", "gap": "gap", "oracle": "gap", "relgap": "value"}.get(priority)
  fields = ("mask",) + ((signal,) if signal else ())
  out = replay_lib.replay(g, norms, gaps=gaps, rec_norms=rec_norms,
                          measured=np.broadcast_to(measured, (num_steps, n)) & on_step[:, None],
                          fields=fields)
  # The mask used at step t is the one chosen after step t - 1 (none at step 1).
  masks = np.concatenate([np.zeros((1, n), bool), out["mask"][:-1]])
  if signal:
    signals = out[signal].astype(np.float64)
  elif priority in ("norm", "hybrid"):
    signals = np.asarray(norms, np.float64)
  else:
    signals = np.full((num_steps, n), np.nan)
  return masks, signals


def score_masks(masks, signals, gaps, warmup, max_o):
  """Per-step coverage, precision and Spearman against the oracle top-max_o set, averaged."""
  cov, prec, rho, share = [], [], [], []
  for t in range(warmup + 1, len(gaps)):  # t is 0-based: step t + 1 > warmup + 1
    e = gaps[t]
    top = np.argsort(-e, kind="stable")[:max_o]
    in_top = np.zeros(len(e), bool)
    in_top[top] = True
    mask = masks[t]
    cov.append(e[mask & in_top].sum() / max(e[in_top].sum(), 1e-30))
    prec.append((mask & in_top).sum() / max_o)
    share.append(mask.mean())
    if signals is not None:
      rho.append(common.spearman(signals[t - 1], e))
  return {"coverage": float(np.mean(cov)), "precision": float(np.mean(prec)),
          "spearman": float(np.nanmean(rho)) if rho and np.any(np.isfinite(rho)) else None,
          "recovered_share": float(np.mean(share))}


def quality_run(regime, seed, steps, data):
  config = base_config(steps)
  config.precision.update(REGIMES[regime][0])
  config.diagnostics.recovery_gap_every = 1
  config.diagnostics.recovery_gap_start = 1
  config.logging.unit_log_every = 1
  config.train.seed = config.data.seed = seed
  workdir = run_dir("quality", regime, "static_low", seed)
  t0 = time.time()
  summary = train(config, workdir, data=data)
  print(f"[quality] {regime} seed{seed}: loss {summary.get('eval_loss', float('nan')):.3f} "
        f"({time.time() - t0:.0f} s)", flush=True)
  units = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))
  gap_rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.GAP_FILE))
  with open(os.path.join(workdir, metrics_log.UNIT_NAMES_FILE), encoding="utf-8") as f:
    names = json.load(f)
  norms = np.array([r["norm"] for r in units], np.float32)
  gaps = np.array([r["gap"] for r in gap_rows], np.float64)
  rel = np.array([r["gap_rel"] for r in gap_rows], np.float64)
  rec_norms = np.where(rel > 0, gaps / np.where(rel > 0, rel, 1.0), 0.0)  # gap_rel = e / ||g_rec||
  assert len(norms) == len(gaps) == config.train.steps, (len(norms), len(gaps))
  g, n = config.gnmr, len(names)
  max_o, warmup = g.max_o, g.warmup
  tops = [set(np.argsort(-e, kind="stable")[:max_o]) for e in gaps]
  jaccard = [len(a & b) / len(a | b) for a, b in zip(tops, tops[1:])]
  concentration = [np.sort(e)[::-1][:max_o].sum() / max(e.sum(), 1e-30) for e in gaps]
  sq = [np.sort(e ** 2)[::-1][:max_o].sum() / max((e ** 2).sum(), 1e-30) for e in gaps]
  counts = np.zeros(n)
  for top in tops[warmup:]:
    counts[list(top)] += 1
  out = {"seed": seed, "eval_loss": summary.get("eval_loss"),
         "concentration": float(np.mean(concentration)), "concentration_sq": float(np.mean(sq)),
         "top_jaccard": float(np.mean(jaccard)),
         "top_units": [[names[i], int(counts[i])] for i in np.argsort(-counts)[:max_o + 2]],
         "controllers": {}}
  measured = np.ones(len(gaps), bool)
  replays = dict(CONTROLLERS)
  replays["hybrid_default_thresholds"] = ({"priority": "hybrid"}, 0)
  del replays["hindsight"], replays["gaprec"]  # static run: both measuring passes are the same
  for name in ("noise", "noisenorm", "noisegate", "lastblocks", "lateswitch"):  # e2e only (static sets; split halves)
    del replays[name]
  replays["gap_every50"] = (CONTROLLERS["gap"][0], 50)
  replays["relgap_every50"] = (CONTROLLERS["relgap"][0], 50)
  for name, (overrides, gap_every) in replays.items():
    rg = ml_collections.ConfigDict(g.to_dict())
    rg.update(overrides)
    masks, signals = replay(rg.priority, norms, gaps.astype(np.float32), measured, rg, gap_every,
                            rec_norms.astype(np.float32))
    out["controllers"][name] = score_masks(masks, None if name == "random" else signals, gaps,
                                           warmup, max_o)
  fixed = np.array([HINDSIGHT in nm for nm in names])
  masks = np.tile(fixed, (len(gaps), 1))
  out["controllers"]["hindsight"] = score_masks(masks, None, gaps, warmup, max_o)
  return out


# --- part 'e2e' ----------------------------------------------------------------------------


def e2e_run(regime, arm, seed, steps, data):
  config = arm_config(regime, arm, seed, steps)
  t0 = time.time()
  summary = train(config, run_dir("e2e", regime, arm, seed), data=data)
  routed = config.precision.mode == "gnmr"  # a static arm recovers nothing
  recovered = (f"recovered {summary.get('recovered_unit_steps_pct', 0):.2f}% " if routed else "")
  print(f"[e2e] {regime} {arm} seed{seed}: loss {summary.get('eval_loss', float('nan')):.4f} "
        f"{recovered}({time.time() - t0:.0f} s)", flush=True)
  changes = mask_changes(run_dir("e2e", regime, arm, seed))
  return {"seed": seed, "eval_loss": summary.get("eval_loss"),
          **({"mask_changes": changes} if changes is not None else {}),
          "recovered_unit_steps_pct": summary.get("recovered_unit_steps_pct") if routed else 0.0,
          "tokens_per_s": summary.get("tokens_per_s"), "data_seed": config.data.seed,
          "init_perturbation": config.train.init_perturbation}


def mask_changes(workdir):
  """How often the mask used at the measured steps (recovery_gap.jsonl) changed between one
  measurement and the next, counted from the first measurement with a non-empty mask; None
  when the arm measured nothing. A 'gap' controller whose mask never changes kept the set of its
  first measurement."""
  path = os.path.join(workdir, metrics_log.GAP_FILE)
  if not os.path.exists(path):
    return None
  masks = [tuple(r["mask"]) for r in metrics_log.read_jsonl(path) if any(r["mask"])]
  if not masks:
    return None
  return {"measurements": len(masks),
          "changes": sum(a != b for a, b in zip(masks, masks[1:]))}


def annotate(results):
  """Adds `mask_changes` to every e2e row whose run directory is still on this machine."""
  for regime, by_arm in results["e2e"].items():
    for arm, runs in by_arm.items():
      for row in runs:
        changes = mask_changes(run_dir("e2e", regime, arm, row["seed"]))
        row.pop("mask_changes", None)
        if changes is not None:
          row["mask_changes"] = changes


def _load():
  if os.path.exists(RESULTS):
    with open(RESULTS, encoding="utf-8") as f:
      return json.load(f)
  return {"quality": {}, "e2e": {}, "invocations": []}


def _save(results):
  os.makedirs(common.RESULTS_DIR, exist_ok=True)
  with open(RESULTS + ".tmp", "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, default=float)
  os.replace(RESULTS + ".tmp", RESULTS)


def _update(change):
  """Re-reads the results under a file lock, applies `change(results)` and writes them back, so
  sweeps of other regimes or arms running at the same time (one per core) lose nothing."""
  import fcntl  # pylint: disable=g-import-not-at-top
  os.makedirs(common.RESULTS_DIR, exist_ok=True)
  with open(RESULTS + ".lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    results = _load()
    change(results)
    _save(results)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=("quality", "e2e", "annotate"), required=True,
                      help="'annotate': add mask_changes to the e2e rows from their run dirs")
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument("--arms", default="",
                      help="e2e arms (default: static_low, static_rec and every controller)")
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--first_seed", type=int, default=0)
  parser.add_argument("--steps", type=int, default=0)
  args = parser.parse_args(argv)
  if args.part == "annotate":
    _update(annotate)
    print(f"wrote {RESULTS}")
    return
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  common.enable_compilation_cache()
  regimes = [r for r in args.regimes.split(",") if r]
  unknown = [r for r in regimes if r not in REGIMES]
  if unknown:
    raise SystemExit(f"unknown regimes {unknown}; valid: {list(REGIMES)}")
  arms = [a for a in args.arms.split(",") if a] or list(STATIC_ARMS) + list(CONTROLLERS)
  for arm in arms:
    try:
      arm_config(regimes[0] if regimes else "tensor4", arm, 0)
    except ValueError as e:
      raise SystemExit(str(e)) from e
  # One prepared corpus; every run's batches follow its own config.data.seed (Data.for_config).
  data = make_data(base_config(args.steps).data)
  seeds = range(args.first_seed, args.first_seed + args.seeds)
  t0 = time.time()

  def record(part, regime, arm, row):
    def change(results):
      if part == "quality":
        runs = [r for r in results["quality"].get(regime, []) if r["seed"] != row["seed"]]
        results["quality"][regime] = sorted(runs + [row], key=lambda r: r["seed"])
      else:
        by_arm = results["e2e"].setdefault(regime, {})
        runs = [r for r in by_arm.get(arm, []) if r["seed"] != row["seed"]]
        by_arm[arm] = sorted(runs + [row], key=lambda r: r["seed"])
      results.update(date=datetime.date.today().isoformat(),
                     device=common.device_description(), versions=versions_lib.versions(),
                     base_config=base_config(args.steps).to_dict(), gap_every=GAP_EVERY,
                     hindsight=HINDSIGHT, perturbation=PERTURBATION)
    _update(change)

  for seed in seeds:  # seed-major, so an interrupted run has every arm of the first seeds
    for regime in regimes:
      if args.part == "quality":
        record("quality", regime, None, quality_run(regime, seed, args.steps, data))
      else:
        for arm in arms:
          record("e2e", regime, arm, e2e_run(regime, arm, seed, args.steps, data))
  _update(lambda results: results["invocations"].append(
      {"command": " ".join(["python"] + sys.argv), "date": datetime.date.today().isoformat(),
       "wall_seconds": time.time() - t0}))
  print(f"wrote {RESULTS}")


if __name__ == "__main__":
  main()
