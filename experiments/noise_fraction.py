"""Issue 23: does the noise-fraction controller spend precision only where it buys loss?

One JSON per (regime, arm, seed) under experiments/results/noise_fraction/<regime>/<arm>/
seed<k>.json: a run whose JSON exists is skipped, so an interrupted sweep resumes where it
stopped (sessions are 180 minutes; a sweep may take several). Each seed has its own data order
and init (config.train.seed = config.data.seed = seed); '<arm>_perturb' reruns a seed with the
initial params multiplied by (1 + 1e-7 z), the noise floor.

Regimes:
  default   configs/tiny.py as `make train` runs it (int8 low-cost, bf16 recovery, 300 steps).
            The goal: <= 1% of unit-steps recovered and the loss within the seed noise of
            static int8, where today's default 'norm' recovers ~13% for no measured gain.
  nvfp4, mxfp8  the scenario CPU model (experiments/scenario1_saved_activation.py base('cpu'):
            d 128, 4 layers, 200 steps) with the emulated NVFP4 / MXFP8 low-cost path and a
            bf16 recovery path: first the static gaps (is there anything to recover?).

Arms: static_low (every unit int8, no recovery), static_rec (every unit bf16), norm (today's
default priority), noise ('noise' priority: pi_u against 1/3 and 1/6, the paper's alarm at
alpha 4 / beta 3, the 'uniform' pass every 50 steps from warmup + 1, split halves).

  python experiments/noise_fraction.py --regimes default --seeds 3
  python experiments/noise_fraction.py --part report     # prints the RESULTS.md section
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

from experiments import common  # noqa: E402  pylint: disable=g-import-not-at-top

RESULTS = os.path.join(common.RESULTS_DIR, "noise_fraction")
ARMS = ("static_low", "static_rec", "norm", "noise")
PERTURBATION = 1e-7
NOISE = {"priority": "noise", "alpha": 4.0, "beta": 3.0, "gap_decay": 0.5}
GAP = {"recovery_gap_every": 50, "recovery_gap_start": 0, "recovery_gap_pass": "uniform",
       "recovery_gap_split": True}


REGIMES = ("default", "nvfp4", "mxfp8")


def base_config(regime: str):
  if regime not in REGIMES:
    raise SystemExit(f"unknown regime {regime!r}; valid: {list(REGIMES)}")
  if regime == "default":
    import tiny  # pylint: disable=g-import-not-at-top
    config = tiny.get_config()
  else:
    from experiments import scenario1_saved_activation as scenario1  # pylint: disable=g-import-not-at-top
    config = scenario1.base("cpu")
    config.precision.update(mode="gnmr", low_cost_path=regime, recovery_path="bf16")
    config.gnmr.priority = "norm"
    config.logging.unit_log_every = 0
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
  elif arm == "static_rec":
    config.precision.mode = "static"
    config.precision.low_cost_path = config.precision.recovery_path
  elif arm == "noise":
    config.gnmr.update(NOISE)
    config.diagnostics.update(GAP)
  elif arm != "norm":
    raise SystemExit(f"unknown arm {arm!r}; valid: {list(ARMS)} (+ '_perturb')")
  config.train.seed = config.data.seed = seed
  return config


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
  routed = config.precision.mode == "gnmr"
  out = {"regime": regime, "arm": arm, "seed": seed, "eval_loss": summary["eval_loss"],
         "recovered_unit_steps_pct": summary.get("recovered_unit_steps_pct", 0.0) if routed
         else 0.0, "tokens_per_s": summary["tokens_per_s"], "wall_seconds": time.time() - t0,
         "steps": summary["step"], "date": time.strftime("%Y-%m-%d"),
         "device": common.device_description(), "versions": common.versions()}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  os.replace(path + ".tmp", path)
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
        out.setdefault(arm, {})[row["seed"]] = row
  return out


def _paired(results, a, b):
  """Mean and SE of the per-seed differences loss(a) - loss(b) over their common seeds."""
  seeds = sorted(set(results.get(a, {})) & set(results.get(b, {})))
  diffs = [results[a][s]["eval_loss"] - results[b][s]["eval_loss"] for s in seeds]
  if len(diffs) < 2:
    return None
  return statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5, len(diffs)


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
    seeds = sorted(set(results.get("static_low", {})) & set(results.get("static_rec", {})))
    if len(seeds) > 1:
      gaps = [results["static_low"][k]["eval_loss"] - results["static_rec"][k]["eval_loss"]
              for k in seeds]
      rec_sd = statistics.stdev(results["static_rec"][k]["eval_loss"] for k in seeds)
      mean = statistics.mean(gaps)
      lines.append(f"- static gap (static_low - static_rec, per seed): {mean:+.4f} nats, per-seed "
                   f"{', '.join(f'{g:+.4f}' for g in gaps)}; seed SD of static_rec {rec_sd:.4f}: "
                   f"the gap is {'more' if mean > 3 * rec_sd else 'not more'} than 3 seed SDs")
    for a, b in (("noise", "static_low"), ("noise", "norm"), ("norm", "static_low"),
                 ("static_rec", "static_low")):
      paired = _paired(results, a, b)
      if paired:
        lines.append(f"- paired {a} - {b}: {paired[0]:+.4f} +- {paired[1]:.4f} nats (SE, "
                     f"{paired[2]} seeds)")
    for arm in ARMS:
      floor = _paired(results, f"{arm}_perturb", arm)
      if floor:
        lines.append(f"- noise floor {arm}: perturbed - unperturbed {floor[0]:+.4f} "
                     f"({floor[2]} seeds)")
    dates = sorted({r["date"] for rows in results.values() for r in rows.values()})
    devices = sorted({r["device"] for rows in results.values() for r in rows.values()})
    lines += ["", f"Measured {', '.join(dates)} on {', '.join(devices)}.", ""]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("run", "report"), default="run")
  parser.add_argument("--regimes", default="default")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args(argv)
  if args.part == "report":
    print(section())
    return
  common.enable_compilation_cache()
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  for regime in args.regimes.split(","):
    data = make_data(base_config(regime).data)  # re-seeded per run (Data.for_config)
    for seed in range(args.seeds):
      for arm in args.arms.split(","):
        run_one(regime, arm, seed, data)


if __name__ == "__main__":
  main()
