"""Shared machinery of the scenario scripts: arms, runs (arms x seeds), summaries.

An arm is a set of config overrides plus the optimizer chain it trains with.
Every run trains through `gnmr_jax.train_loop.train_and_evaluate` in its own
workdir, experiments/runs/<scenario>/<scale>/<arm>/seed<k> (not committed; a run
whose summary.json is complete is reused, so an interrupted scenario resumes),
and the scenario's summary goes to experiments/results/<scenario>_<scale>.json
(committed), from which experiments/report.py regenerates RESULTS.md and the
figures.

Runs go seed-major (every arm of seed 0, then of seed 1, ...) so that load from
other processes on a shared machine spreads over the arms instead of landing on
one of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import jax
import ml_collections

from gnmr_jax import clipping, metrics_log
from gnmr_jax.optim import make_optimizer
from gnmr_jax.precision import blockwise, registry
from gnmr_jax import versions as versions_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_DIR = RUNS_DIR_DEFAULT = os.path.join(ROOT, "experiments", "runs")  # --runs may move it
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
SCALES = ("cpu", "gpu")
CONTROLLERS = ("gnmr", "random")
CLIPS = ("none", "global", "zclip", "adagc")


def _blockwise_at(bits):
  def build(config, role):
    del role
    return blockwise.blockwise_path(bits, config.block_size)
  return build


# Fixed-width blockwise paths, so one routed policy can pair 6-bit and 8-bit tiles
# (the library's 'blockwise' path reads one `block_bits` for both roles).
for _bits in (6, 8):
  registry.register_path(f"blockwise{_bits}", _blockwise_at(_bits))


# The 'noise' priority as issue 23's experiments run it (selection.py, noise_fraction.py): the
# paper's transient alarm at alpha 4 / beta 3 and pi's EMA decay 0.5 per measurement.
NOISE_PRIORITY = {"priority": "noise", "alpha": 4.0, "beta": 3.0, "gap_decay": 0.5}
# The paper's rule as a transient alarm (the library's config default from 2026-12-02 on): alpha 4
# / beta 3 with a 2-step lock, the cheapest setting of THRESHOLDS.md's replay that detects every
# x5 / x10 / x100 spike at <= 1% of clean unit-steps; max_o is a cap, the mask is mostly empty.
ALARM_PRIORITY = {"priority": "gnmr", "alpha": 4.0, "beta": 3.0, "t_lock": 2}
# The controller settings every experiment before 2026-12-02 ran with (the library's config
# defaults then): the experiments pin them, so a resumed sweep keeps its arms' settings whatever
# the library's defaults become. Arms override them.
EXPERIMENT_CONTROLLER = {"alpha": 2.0, "beta": 1.5, "t_lock": 5, "max_o": 4, "delta": 8}


def spearman(a, b) -> float:
  """Spearman's rank correlation of a and b (average ranks for ties); NaN when a has a
  non-finite entry or either is constant."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from scipy import stats  # pylint: disable=g-import-not-at-top
  if not np.all(np.isfinite(a)) or np.std(a) == 0 or np.std(b) == 0:
    return float("nan")
  return float(stats.spearmanr(a, b).statistic)


@dataclasses.dataclass(frozen=True)
class Arm:
  """One experimental arm.

  Attributes:
    name: short id (directory and table key).
    label: what it is, for the report.
    role: 'reference', 'static', 'gnmr', 'baseline' or 'ablation' (report grouping).
    precision: overrides of config.precision.
    gnmr: overrides of config.gnmr.
    optimizer: overrides of config.optimizer.
    controller: 'gnmr' (the controller from config.gnmr) or 'random' (same-budget
      random recovery, gnmr_jax.control.research.random with t_lock=0).
    clip: 'none', 'global' (optax.clip_by_global_norm(clip_value)), 'zclip' or
      'adagc' (gnmr_jax.clipping), applied before AdamW.
    clip_value: threshold of 'global'.
  """

  name: str
  label: str
  role: str
  precision: dict = dataclasses.field(default_factory=dict)
  gnmr: dict = dataclasses.field(default_factory=dict)
  optimizer: dict = dataclasses.field(default_factory=dict)
  controller: str = "gnmr"
  clip: str = "none"
  clip_value: float = 1.0

  def __post_init__(self):
    if self.controller not in CONTROLLERS:
      raise ValueError(f"Arm {self.name}: controller must be one of {CONTROLLERS}.")
    if self.clip not in CLIPS:
      raise ValueError(f"Arm {self.name}: clip must be one of {CLIPS}.")


def arm_config(base: ml_collections.ConfigDict, arm: Arm, seed: int) -> ml_collections.ConfigDict:
  """The base config with the arm's overrides and the seed (params and data order).

  controller='random' selects config.gnmr.priority='random' with t_lock=0 (a fresh draw
  every step, gnmr_jax.control.research.random).
  """
  config = ml_collections.ConfigDict(base.to_dict())
  config.precision.update(arm.precision)
  if arm.controller == "random":
    config.gnmr.update(priority="random", t_lock=0)
  config.gnmr.update(arm.gnmr)
  config.optimizer.update(arm.optimizer)
  config.train.seed = seed
  config.data.seed = seed
  return config


def make_tx_for(arm: Arm, seed: int) -> Callable:
  """`config -> optax chain` for train_and_evaluate(make_tx=...).

  gnmr_jax.optim.make_optimizer with the arm's clipping: 'none' and 'global' set
  config.optimizer.grad_clip (0 or the arm's clip_value); 'zclip' and 'adagc' put
  the gnmr_jax.clipping clip in front of AdamW inside the same guard. The
  controller is the library's (config.gnmr.priority, seeded by the run's seed).
  """
  del seed  # the controller's seed is config.train.seed, which arm_config sets

  def make_tx(config):
    config = ml_collections.ConfigDict(config.to_dict())
    config.optimizer.grad_clip = arm.clip_value if arm.clip == "global" else 0.0
    if arm.clip in ("none", "global"):
      return make_optimizer(config)
    clip = clipping.zclip() if arm.clip == "zclip" else clipping.adagc()
    return make_optimizer(config, pre_update=[clip])

  return make_tx


def run_dir(scenario: str, scale: str, arm: str, seed: int) -> str:
  return os.path.join(RUNS_DIR, scenario, scale, arm, f"seed{seed}")


def _complete(workdir: str, steps: int, config=None) -> bool:
  """Whether `workdir` holds a finished run of `steps` (and, given `config`, of its seeds: a run
  left by an older version without them, or of other seeds, is not reused)."""
  path = os.path.join(workdir, metrics_log.SUMMARY_FILE)
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    summary = json.load(f)
  if config is not None and (summary.get("seeds") != {
      "train": int(config.train.seed), "data": int(config.data.seed),
      "init_perturbation": float(config.train.get("init_perturbation", 0.0))}):
    return False
  return summary.get("step") == steps and not summary.get("preempted")


def enable_compilation_cache():
  """Persistent XLA cache: the seeds of an arm compile the same program once."""
  path = os.path.join(RUNS_DIR, ".jax_cache")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def train_arm(scenario, scale, arm: Arm, seed: int, base, data=None,
              train_fn: Optional[Callable] = None) -> str:
  """Trains one (arm, seed) unless its workdir already holds a complete run."""
  workdir = run_dir(scenario, scale, arm.name, seed)
  config = arm_config(base, arm, seed)
  if _complete(workdir, config.train.steps, config):
    return workdir
  shutil.rmtree(workdir, ignore_errors=True)
  t0 = time.time()
  if train_fn is not None:
    summary = train_fn(config, workdir, arm, seed)
  else:
    from gnmr_jax.train_loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
    summary = train_and_evaluate(config, workdir, data=data, make_tx=make_tx_for(arm, seed))
  print(f"[{scenario}/{scale}] {arm.name} seed{seed}: ppl {summary.get('eval_perplexity', float('nan')):.3f} "
        f"recovered {summary.get('recovered_unit_steps_pct', 0):.2f}% "
        f"({time.time() - t0:.0f} s)", flush=True)
  return workdir


def _median_step_seconds(rows):
  # The first logged interval includes compilation; the median resists load spikes.
  rates = [r["steps_per_s"] for r in rows[1:] if r.get("steps_per_s")]
  return 1.0 / statistics.median(rates) if rates else float("nan")


def summarise_run(workdir: str, heatmap: bool = False) -> dict:
  """The numbers the report needs from one run directory."""
  with open(os.path.join(workdir, metrics_log.SUMMARY_FILE), encoding="utf-8") as f:
    summary = json.load(f)
  train = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.METRICS_FILE))
  evals = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.EVAL_FILE))
  out = {
      "eval_perplexity": summary.get("eval_perplexity"),
      "eval_loss": summary.get("eval_loss"),
      "recovered_unit_steps_pct": summary.get("recovered_unit_steps_pct"),
      "threshold_exceedance_pct": summary.get("threshold_exceedance_pct"),
      "num_units": summary.get("num_units"),
      "tokens_per_s": summary.get("tokens_per_s"),
      "step_seconds": _median_step_seconds(train),
      "num_nonfinite_steps": int(sum(bool(r.get("nonfinite")) for r in train)),
      "train_curve": [[r["step"], r["loss"]] for r in train],
      "eval_curve": [[r["step"], r["eval_loss"]] for r in evals],
      "max_grad_norm": max((r["grad_norm"] for r in train), default=None),
  }
  for key in ("cloze_accuracy", "pretrain_perplexity", "base_perplexity",
              "base_cloze_accuracy"):
    if key in summary:
      out[key] = summary[key]
  if heatmap:
    units = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))
    names_path = os.path.join(workdir, metrics_log.UNIT_NAMES_FILE)
    if units and os.path.exists(names_path):
      with open(names_path, encoding="utf-8") as f:
        names = json.load(f)
      out["heatmap"] = {"units": names, "steps": [r["step"] for r in units],
                        "mask": [[int(v) for v in r["mask"]] for r in units]}
  return out


def write_json(path: str, obj) -> None:
  """Writes ``obj`` to ``path`` whole or not at all (a killed sweep leaves no half a result)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)
  os.replace(path + ".tmp", path)


def write_report(path: str, text: str) -> None:
  """Writes a generated report (a markdown file beside its results) and prints it."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)


def add_dry_run_options(parser: argparse.ArgumentParser, results: str) -> None:
  """--results, --runs and --smoke: where a sweep writes, and a dry run shrunk to seconds that
  must write elsewhere (check_dry_run)."""
  parser.add_argument("--results", default=results, help="where the JSONs go (default: the "
                      f"committed {os.path.relpath(results, ROOT)})")
  parser.add_argument("--runs", default=RUNS_DIR, help="where the run workdirs go")
  parser.add_argument("--smoke", action="store_true", help="shrink every config to seconds "
                      "(a dry run; needs --results and --runs outside the committed ones)")


def check_dry_run(args, committed_results: str) -> None:
  """Refuses a --smoke run that would write beside the committed results or runs."""
  inside = lambda path, root: os.path.commonpath([os.path.abspath(path),
                                                  os.path.abspath(root)]) == os.path.abspath(root)
  if args.smoke and (inside(args.results, committed_results) or
                     inside(args.runs, RUNS_DIR_DEFAULT)):
    raise SystemExit("--smoke writes no results beside the real ones: give --results and --runs "
                     "outside experiments/results and experiments/runs")


def device_description() -> str:
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"
  return f"{jax.device_count()} x {getattr(dev, 'device_kind', dev.platform)}"


def write_results(scenario: str, scale: str, arms, seeds, base, heatmap_arm: str,
                  notes: dict, wall_seconds: float, extra_fn=None) -> str:
  """Collects every (arm, seed) run into experiments/results/<scenario>_<scale>.json."""
  os.makedirs(RESULTS_DIR, exist_ok=True)
  path = os.path.join(RESULTS_DIR, f"{scenario}_{scale}.json")
  previous, invocations = {}, []
  if os.path.exists(path):  # keep arms run earlier with --arms subsets
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    previous = old.get("arms", {})
    invocations = old.get("invocations") or [{
        "command": old.get("command", ""), "date": old.get("date", ""),
        "wall_seconds": old.get("wall_seconds", 0.0), "arms": list(previous)}]
  invocations = invocations + [{
      "command": " ".join(["python"] + sys.argv), "date": datetime.date.today().isoformat(),
      "wall_seconds": wall_seconds, "arms": [a.name for a in arms]}]
  results = dict(previous)
  for arm in arms:
    runs = []
    for seed in seeds:
      workdir = run_dir(scenario, scale, arm.name, seed)
      if not _complete(workdir, base.train.steps):
        continue
      run = summarise_run(workdir, heatmap=(arm.name == heatmap_arm and seed == seeds[0]))
      if extra_fn is not None:
        run.update(extra_fn(arm, seed, workdir))
      run["seed"] = seed
      runs.append(run)
    if runs:
      results[arm.name] = {"label": arm.label, "role": arm.role, "runs": runs,
                           "overrides": {"precision": arm.precision, "gnmr": arm.gnmr,
                                         "optimizer": arm.optimizer,
                                         "controller": arm.controller, "clip": arm.clip}}
  order = list(previous) + [a.name for a in arms if a.name not in previous]
  payload = {
      "scenario": scenario, "scale": scale,
      "date": datetime.date.today().isoformat(),
      "device": device_description(), "versions": versions_lib.versions(),
      "wall_seconds": sum(i["wall_seconds"] for i in invocations),
      "command": " ".join(["python"] + sys.argv), "invocations": invocations,
      "base_config": base.to_dict(), "notes": notes,
      "arms": {k: results[k] for k in order if k in results},
  }
  with open(path, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=1, default=float)
  return path


def parse_args(argv, description: str, default_seeds: int = 3):
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--scale", choices=SCALES, default="cpu")
  parser.add_argument("--seeds", type=int, default=default_seeds,
                      help="number of seeds (0..n-1) per arm")
  parser.add_argument("--arms", default="", help="comma-separated subset of arm names")
  parser.add_argument("--steps", type=int, default=0, help="override train.steps")
  parser.add_argument("--dry_run", action="store_true",
                      help="build and compile one step of every arm on this machine at a "
                           "reduced batch, train nothing")
  parser.add_argument("--no_report", action="store_true", help="do not regenerate RESULTS.md")
  return parser.parse_args(argv)


def select_arms(arms, names: str):
  if not names:
    return list(arms)
  wanted = [n.strip() for n in names.split(",") if n.strip()]
  known = {a.name: a for a in arms}
  unknown = [n for n in wanted if n not in known]
  if unknown:
    raise SystemExit(f"unknown arms {unknown}; valid: {list(known)}")
  return [known[n] for n in wanted]


def dry_run(arms, base, batch_size: int = 2):
  """Builds every arm and compiles + runs one train step at a reduced batch."""
  from gnmr_jax import sharding, train_loop  # pylint: disable=g-import-not-at-top
  for arm in arms:
    config = arm_config(base, arm, 0)
    config.data.batch_size = batch_size
    config.data.num_eval_batches = 1
    t0 = time.time()
    run = train_loop.build(config, data=None, make_tx=make_tx_for(arm, 0))
    with sharding.activation_sharding(run.mesh):
      state = run.init_state(jax.random.key(0))
      batch = train_loop.device_batch(run, next(run.data.train_iterator()))
      state, metrics = run.train_step(state, batch)
      loss = float(metrics["loss"])
    n = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print(f"dry run {arm.name}: {n:,} params, one step loss {loss:.3f} "
          f"({time.time() - t0:.0f} s)", flush=True)


def run_scenario(scenario: str, args, arms, config, heatmap_arm: str, notes: dict, *,
                 data=None, train_fn=None) -> str:
  """Trains every (seed, arm) seed-major, writes the results JSON, regenerates the report."""
  seeds = list(range(args.seeds))
  t0 = time.time()
  for seed in seeds:
    for arm in arms:
      train_arm(scenario, args.scale, arm, seed, config, data=data, train_fn=train_fn)
  path = write_results(scenario, args.scale, arms, seeds, config, heatmap_arm, notes,
                       time.time() - t0)
  print(f"wrote {path}")
  if not args.no_report:
    regenerate_report()
  return path


def regenerate_report() -> None:
  """Runs experiments/report.py (RESULTS.md and the figures) as its own program: the report
  reads every driver's results, so the drivers' shared code does not import it."""
  subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "report.py")], check=True)


def standard_main(argv, doc: str, scenario: str, all_arms, base_fn, heatmap_arm: str,
                  notes: dict):
  """The command line of a scenario trained by train_and_evaluate (scenarios 1 and 2)."""
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  args = parse_args(argv, doc)
  arms = select_arms(all_arms, args.arms)
  config = base_fn(args.scale, args.steps)
  enable_compilation_cache()
  if args.dry_run:
    dry_run(arms, config)
    return None
  return run_scenario(scenario, args, arms, config, heatmap_arm, notes,
                      data=make_data(config.data))


def trained_json(path: str, scenario: str, regime: str, arm: str, seed: int, config,
                 data=None) -> dict:
  """The JSON of one (regime, arm, seed) run at ``path``: read when it exists (a sweep resumes),
  else trained into ``run_dir(scenario, regime, arm, seed)`` and written (final eval loss,
  steps, tokens/s, wall seconds, date, device, versions). A preempted run exits (rerun to
  resume it from its checkpoint)."""
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  workdir = run_dir(scenario, regime, arm, seed)
  t0 = time.time()
  summary = train_loop.train_and_evaluate(config, workdir, data=data)
  if summary.get("preempted"):
    raise SystemExit(f"{regime} {arm} seed{seed} preempted at step {summary['step']}; rerun")
  out = {"regime": regime, "arm": arm, "seed": seed, "eval_loss": summary["eval_loss"],
         "steps": summary["step"], "tokens_per_s": summary["tokens_per_s"],
         "wall_seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d"),
         "device": device_description(), "versions": versions_lib.versions()}
  write_json(path, out)
  print(f"[{scenario}] {regime} {arm} seed{seed}: loss {out['eval_loss']:.4f} "
        f"({out['wall_seconds']:.0f} s)", flush=True)
  return out


def load_runs(root: str, arms) -> dict:
  """{arm: {seed: row}} of the JSONs under ``root``/<arm>/ for each of ``arms``."""
  out = {}
  for arm in arms:
    folder = os.path.join(root, arm)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
      with open(os.path.join(folder, name), encoding="utf-8") as f:
        row = json.load(f)
      out.setdefault(arm, {})[row["seed"]] = row
  return out

