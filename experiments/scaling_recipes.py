"""Issue 45: do the faster fp8 scaling recipes train like the precise one? (CPU evidence)

  python experiments/scaling_recipes.py --seeds 5                  # resumes what is missing
  python experiments/scaling_recipes.py --regimes tiny --seeds 5
  python experiments/scaling_recipes.py --report                   # writes the markdown report

One JSON per (regime, arm, seed) under experiments/results/scaling_recipes/<regime>/<arm>/
seed<k>.json, skipped when it exists (a sweep longer than a session resumes). Every arm trains
static fp8 (every projection on the low-cost path, so the recipe is all that differs). Regimes:
'tiny' (configs/tiny.py: 4 layers, d 256, 300 steps) and 'wsd8' (the NVFP4 regime's shape,
experiments/noise_fraction.py: the scenario CPU model at 8 layers, 400 steps, warmup-stable-decay).
Arms: 'row' (precision.scaling='row', the precise recipe and the default), 'row_perturb' (the
same with the initial params times (1 + 1e-7 z): the noise floor of a seed), 'tensor', 'delayed'
(amax history of 16 steps). The report gives each arm's loss minus row's, paired by seed, beside
the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

from experiments import common  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import noise_fraction  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import selection_report  # noqa: E402  pylint: disable=g-import-not-at-top

RESULTS = os.path.join(common.RESULTS_DIR, "scaling_recipes")
REPORT = os.path.join(RESULTS, "REPORT.md")
REGIMES = ("tiny", "wsd8")
ARMS = ("row", "row_perturb", "tensor", "delayed")


def arm_config(regime: str, arm: str, seed: int):
  if regime not in REGIMES:
    raise SystemExit(f"unknown regime {regime!r}; valid: {list(REGIMES)}")
  if arm not in ARMS:
    raise SystemExit(f"unknown arm {arm!r}; valid: {list(ARMS)}")
  config = noise_fraction.base_config("default" if regime == "tiny" else "wsd8")
  config.precision.update(mode="static", low_cost_path="fp8",
                          scaling=arm.removesuffix("_perturb"))
  if arm.endswith("_perturb"):
    config.train.init_perturbation = noise_fraction.PERTURBATION
  config.diagnostics.recovery_gap_every = 0
  config.logging.unit_log_every = 0
  config.train.seed = config.data.seed = seed
  return config


def result_path(regime, arm, seed):
  return os.path.join(RESULTS, regime, arm, f"seed{seed}.json")


def run_one(regime, arm, seed):
  path = result_path(regime, arm, seed)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  config = arm_config(regime, arm, seed)
  workdir = common.run_dir("scaling_recipes", regime, arm, seed)
  t0 = time.time()
  summary = train_loop.train_and_evaluate(config, workdir)
  if summary.get("preempted"):
    raise SystemExit(f"{regime} {arm} seed{seed} preempted at step {summary['step']}; rerun")
  out = {"regime": regime, "arm": arm, "seed": seed, "eval_loss": summary["eval_loss"],
         "steps": summary["step"], "tokens_per_s": summary["tokens_per_s"],
         "wall_seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d"),
         "device": common.device_description(), "versions": common.versions()}
  common.write_json(path, out)
  print(f"[scaling_recipes] {regime} {arm} seed{seed}: loss {out['eval_loss']:.4f} "
        f"({out['wall_seconds']:.0f} s)", flush=True)
  return out


def load(regime):
  out = {}
  for arm in ARMS:
    root = os.path.join(RESULTS, regime, arm)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
      with open(os.path.join(root, name), encoding="utf-8") as f:
        row = json.load(f)
      out.setdefault(arm, {})[row["seed"]] = row
  return out


def table() -> list:
  lines = ["| regime | arm | seeds | final eval loss (mean) | loss - row, paired (mean +- SE) "
           "| max abs(loss - row) | noise floor: max abs(row_perturb - row) |",
           "|---|---|---|---|---|---|---|"]
  for regime in REGIMES:
    results = load(regime)
    row = results.get("row", {})
    floor = [abs(results["row_perturb"][k]["eval_loss"] - row[k]["eval_loss"])
             for k in set(results.get("row_perturb", {})) & set(row)]
    for arm in ARMS:
      rows = results.get(arm, {})
      if not rows:
        lines.append(f"| {regime} | {arm} | 0 | not run | - | - | - |")
        continue
      mean = np.mean([r["eval_loss"] for r in rows.values()])
      paired, spread = "-", "-"
      if arm != "row" and row:
        d, se, n = selection_report.paired(rows.values(), row.values())
        paired = f"{d:+.4f} +- {se:.4f} (n={n})" if n >= 2 else "-"
        common_seeds = set(rows) & set(row)
        if common_seeds:
          spread = f"{max(abs(rows[k]['eval_loss'] - row[k]['eval_loss']) for k in common_seeds):.4f}"
      lines.append(f"| {regime} | {arm} | {len(rows)} | {mean:.4f} | {paired} | {spread} | "
                   f"{f'{max(floor):.4f}' if floor else '-'} |")
  return lines


def report() -> str:
  runs = [r for regime in REGIMES for arm in load(regime).values() for r in arm.values()]
  dated = sorted({(r["date"], r["device"]) for r in runs})
  versions = runs[0]["versions"] if runs else common.versions()
  return "\n".join([
      "# fp8 scaling recipes on the CPU: does the faster recipe train like the precise one?", "",
      "Generated by `python experiments/scaling_recipes.py --report` (never edited by hand). "
      "Static fp8 (every projection on the low-cost path), XLA:CPU (fp8 GEMMs run as float32 "
      "products of the fp8 codes: the numerics of the recipes, not their speed). 'row': per-row "
      "current scales (the default); 'tensor': one current scale per tensor; 'delayed': one "
      "per tensor from a 16-step amax history; 'row_perturb': row with the initial params "
      "times (1 + 1e-7 z), the noise floor of a seed.", "",
      f"Runs: {', '.join(f'{d} on {dev}' for d, dev in dated) or 'none yet'}; "
      f"versions {versions}.", ""] + table()) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--report", action="store_true", help="only (re)write the report")
  args = parser.parse_args(argv)
  if not args.report:
    common.enable_compilation_cache()
    for regime in args.regimes.split(","):
      for seed in range(args.seeds):
        for arm in args.arms.split(","):
          run_one(regime, arm, seed)
  os.makedirs(RESULTS, exist_ok=True)
  with open(REPORT, "w", encoding="utf-8") as f:
    f.write(report())
  print(report())


if __name__ == "__main__":
  main()
