"""Issue 47: delayed-scaling fp8's saturation aftermath (regime R1): does a runtime controller
beat static where the low-cost path's risk is transient and local?

  python experiments/delayed_regime.py --part measure              # saturation rates, 1 seed
  python experiments/delayed_regime.py --part rows                 # which tensor saturates
  python experiments/delayed_regime.py --seeds 5                   # the arms; resumes
  python experiments/delayed_regime.py --report                    # only writes REPORT.md

One JSON per (regime, arm, seed) under experiments/results/delayed_regime/<regime>/<arm>/
seed<k>.json, skipped when it exists (a sweep longer than a session resumes). The model is the
NVFP4 regime's shape (experiments/noise_fraction.py 'wsd8': the scenario CPU model at 8 layers,
d 128, 56 projection units, 400 steps, warmup-stable-decay, lr 3e-3), fp8 everywhere (x, W:
e4m3; output gradients: e5m2) with delayed per-tensor scaling (precision.scaling='delayed':
power-of-two scales from each unit's amax history, as Transformer Engine) as the low-cost path and
bf16 as the recovery path. A unit saturates when a tensor's amax outgrows its scale's range (its
power-of-two headroom past the history's amax): its codes clip at the format's largest value for the
steps until the history catches up (the observed amax doubles a step), at that unit only
(model.amax_saturation_units; logged per unit and step as ``saturation``). Saturated means the codes
reached the format's top (delayed_scaling.saturation: for x and g the codes tell no more, so values
that merely rounded to the top count too, an upper bound on clipping); a unit the mask recovers
still has its codes made and measured, so its saturation counts though its bf16 GEMM did not use
them.

Whether the gradient norms see the events (the paper's premise) is read from the 'delayed' arm's
log, where the paper's controller measures without acting: at each event's first step, whether
the unit's GNMR or delta-GNMR passed the paper's thresholds (alpha 2 / beta 1.5) or the alarm's
(4 / 3).

Regimes (``--part measure`` reports each one's saturation rate first):
  'h16'     history 16 steps (the recipe's default)
  'h1'      history 1 step ('most_recent'): the scale follows the last step, so every step
            whose amax outgrows the last one's power-of-two range saturates
  'h16gpu'  h16 at the 60m size (d 512, 8 layers; seq 256, batch 64, 1000 steps) for a lent GPU:
            scripts/gpu_delayed_regime.sh (a dry run on CPU: --smoke)
Arms: 'bf16' (static bf16), 'row' (static fp8 with per-row current scales: the precise recipe; its
log measures what the default alarm would recover where nothing saturates), 'tensor' (static fp8
with one current scale per tensor: delayed's granularity without its stale scales, so what delayed
costs beyond it is the saturation's), 'delayed' (static fp8 delayed: no recovery), 'alarm' (routed,
the library's default transient alarm: the paper's rule at alpha 4 / beta 3 / t_lock 2, plus its
edge rule that a saturated unit is risky), 'paper' (routed, the paper's thresholds alpha 2 / beta
1.5 / delta 8 / t_lock 5, the same edge rule), 'saturation' (routed, priority 'saturation': the
saturated units alone, t_lock 1), 'saturation_w0' (the same from step 1: it reads no norm history,
so it needs no warmup), 'saturation_all' (every unit that saturated, for the one step after (t_lock
0, no per-step cap, warmup 0): the mask reaches every event of >= 2 steps at its second step, and
its mean recovered share, not a per-step cap, is what it spends; its price is the max_o 4 routed
program's, a lower bound: its own program keeps the recovered units' saved activations in a side
buffer sized for every unit (56 / 4 = 14x the max_o 4 program's)), 'hindsight' (a static set at the
same budget chosen in hindsight: the max_o units that saturated most often in 'delayed' seed 0 of
the regime, on bf16 for the whole run), 'last_blocks' (NVIDIA's static recipe: the last layer's 7
units on bf16 for the whole run, 12.5% of unit-steps), 'delayed_perturb' (delayed with the initial
params times (1 + 1e-7 z): the noise floor of a seed). Every routed arm but 'saturation_all': max_o
4 of 56 units (7%), warmup 20.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

from experiments import common  # noqa: E402  pylint: disable=g-import-not-at-top
from gnmr_jax import versions as versions_lib  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import noise_fraction  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import scenario1_saved_activation as scenario1  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import selection_report  # noqa: E402  pylint: disable=g-import-not-at-top

SCENARIO = "delayed_regime"
RESULTS = os.path.join(common.RESULTS_DIR, SCENARIO)
REPORT = os.path.join(RESULTS, "REPORT.md")
REGIMES = {"h16": 16, "h1": 1, "h16gpu": 16}
GPU_REGIMES = ("h16gpu",)  # scenario1's 'gpu' scale: the 60m model (d 512), seq 256, batch 64
COMMITTED_RESULTS = RESULTS
SMOKE = {"on": False}  # --smoke: every config shrunk to seconds (a dry run of the device script)
ARMS = ("bf16", "row", "tensor", "delayed", "delayed_perturb", "alarm", "paper", "saturation",
        "saturation_w0", "saturation_all", "hindsight", "last_blocks")
ROUTED = ("alarm", "paper", "saturation", "saturation_w0", "saturation_all")
STATIC = ("bf16", "row", "tensor", "delayed", "delayed_perturb")  # no recovery path runs
MAX_O = 4
SATURATION_T_LOCK = 1


def base_config(regime: str):
  if regime not in REGIMES:
    raise SystemExit(f"unknown regime {regime!r}; valid: {list(REGIMES)}")
  config = scenario1.base("gpu" if regime in GPU_REGIMES else "cpu")
  config.model.num_layers = noise_fraction.WSD8["layers"]
  config.train.steps, config.train.eval_every = noise_fraction.WSD8["steps"], 100
  if regime in GPU_REGIMES:
    config.train.steps, config.train.eval_every = 1000, 250
  config.optimizer.update(schedule="wsd", decay_fraction=noise_fraction.WSD8["decay_fraction"])
  config.precision.update(mode="static", low_cost_path="fp8", recovery_path="bf16",
                          scaling="delayed", amax_history_length=REGIMES[regime])
  config.gnmr.max_o = MAX_O
  config.logging.unit_log_every = 1  # every step's mask and saturation: the event analysis
  config.logging.log_every = 10
  return config


def arm_config(regime: str, arm: str, seed: int):
  if arm not in ARMS:
    raise SystemExit(f"unknown arm {arm!r}; valid: {list(ARMS)}")
  config = base_config(regime)
  if arm.endswith("_perturb"):
    config.train.init_perturbation = noise_fraction.PERTURBATION
  name = arm.removesuffix("_perturb")
  if name == "bf16":
    config.precision.update(low_cost_path="bf16", scaling="row")
    config.logging.unit_log_every = 0
  elif name == "tensor":  # per-tensor like delayed, current: no stale scale, no saturation
    config.precision.scaling = "tensor"
  elif name == "row":
    # Nothing saturates with current scales: the default alarm measures (static: telemetry
    # only) what it would recover where there is nothing to catch.
    config.precision.scaling = "row"
    config.gnmr.update(common.ALARM_PRIORITY)
  elif name in ROUTED:
    config.precision.mode = "gnmr"
    if name == "alarm":
      config.gnmr.update(common.ALARM_PRIORITY)
    elif name.startswith("saturation"):
      config.gnmr.update(priority="saturation", t_lock=SATURATION_T_LOCK)
      if name != "saturation":  # it reads no norm history: no warmup
        config.gnmr.warmup = 0
      if name == "saturation_all":  # every saturated unit, for the one step after
        from gnmr_jax.model import UNITS_PER_LAYER  # pylint: disable=g-import-not-at-top
        config.gnmr.update(t_lock=0, max_o=UNITS_PER_LAYER * config.model.num_layers)
    # 'paper' and 'norms': scenario1's pinned paper controller (common.EXPERIMENT_CONTROLLER)
  elif name == "hindsight":
    config.precision.mode = "gnmr"
    config.gnmr.update(priority="fixed", fixed_units=hindsight_units(regime))
  elif name == "last_blocks":
    config.precision.mode = "gnmr"
    config.gnmr.update(priority="last_blocks", last_blocks=1, max_o=7)
  config.train.seed = config.data.seed = seed
  if SMOKE["on"]:
    noise_fraction.shrink(config)
  return config


def hindsight_units(regime: str) -> str:
  """A regex of the MAX_O units with the most saturated steps in 'delayed' seed 0 (run first),
  kept in RESULTS/<regime>/hindsight_units.json (committed: the runs' logs are not)."""
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  kept = os.path.join(RESULTS, regime, "hindsight_units.json")
  if os.path.exists(kept):
    with open(kept, encoding="utf-8") as f:
      return json.load(f)["pattern"]
  workdir = common.run_dir(SCENARIO, regime, "delayed", 0)
  path = os.path.join(workdir, metrics_log.UNIT_NAMES_FILE)
  if not os.path.exists(path):
    run_one(regime, "delayed", 0)
  with open(path, encoding="utf-8") as f:
    names = json.load(f)
  counts = (np.array([r["saturation"] for r in metrics_rows(workdir)]) > 1).sum(axis=0)
  top = [names[i] for i in np.argsort(-counts, kind="stable")[:MAX_O]]
  pattern = "^(" + "|".join(re.escape(n) for n in top) + ")$"
  common.write_json(kept, {"pattern": pattern, "units": top,
                           "saturated_steps": [int(counts[names.index(n)]) for n in top]})
  return pattern


def result_path(regime, arm, seed):
  return os.path.join(RESULTS, regime, arm, f"seed{seed}.json")


def event_runs(saturated: np.ndarray) -> list:
  """[(unit, first step index, length)] of the maximal runs of True down each column of a
  bool [steps, units] array: the saturation events."""
  out = []
  for u in range(saturated.shape[1]):
    column = np.concatenate([[0], saturated[:, u].astype(int), [0]])
    starts, ends = np.flatnonzero(np.diff(column) == 1), np.flatnonzero(np.diff(column) == -1)
    out.extend((u, int(a), int(b - a)) for a, b in zip(starts, ends))
  return out


def event_stats(workdir: str, warmup: int = 0) -> dict:
  """Saturation events of a run's units log (one row a step): per unit, maximal runs of
  consecutive saturated steps; how many the mask used covered at the next step (within 1) or
  at one of the next two (within 2), of them and of those starting after the controller's
  ``warmup`` (its mask is empty before); recovered unit-steps."""
  rows = metrics_rows(workdir)
  if not rows:
    return {}
  if [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
    raise ValueError(f"{workdir}: the units log must hold every step (logging.unit_log_every=1)")
  mask = np.array([r["mask"] for r in rows], bool)  # the mask each step ran (static: would)
  if "saturation" not in rows[0]:
    return {"unit_steps": int(mask.size), "recovered_unit_steps": int(mask.sum()),
            "most_units_recovered_in_a_step": int(mask.sum(axis=1).max())}
  sat = np.array([r["saturation"] for r in rows]) > 1          # [steps, units]
  steps, units = sat.shape
  events = event_runs(sat)
  within = lambda e, k: bool(np.any(mask[e[1] + 1:e[1] + 1 + k, e[0]]))
  gnmr, delta = (np.array([r[k] for r in rows]) for k in ("gnmr", "delta_gnmr"))
  norm_alarm = lambda e, alpha, beta: bool(gnmr[e[1], e[0]] > alpha or delta[e[1], e[0]] > beta)
  long_events = [e for e in events if e[2] >= 2]
  return {"unit_steps": int(steps * units), "saturated_unit_steps": int(sat.sum()),
          "events": len(events), "events_2plus": len(long_events),
          "units_with_events": int(len({e[0] for e in events})),
          "events_after_step_50": sum(1 for e in events if rows[e[1]]["step"] > 50),
          "covered_1": sum(within(e, 1) for e in events),
          "covered_2": sum(within(e, 2) for e in events),
          "covered_2plus_at_next": sum(within(e, 1) for e in long_events),
          "events_2plus_after_warmup": sum(rows[e[1]]["step"] > warmup for e in long_events),
          "covered_2plus_after_warmup": sum(within(e, 1) for e in long_events
                                            if rows[e[1]]["step"] > warmup),
          "norm_alarm_paper": sum(norm_alarm(e, 2.0, 1.5) for e in events),
          "norm_alarm_default": sum(norm_alarm(e, 4.0, 3.0) for e in events),
          "recovered_unit_steps": int(mask.sum()),
          "most_units_recovered_in_a_step": int(mask.sum(axis=1).max())}


def metrics_rows(workdir):
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  return metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))


def train_rows(workdir):
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  return metrics_log.read_jsonl(os.path.join(workdir, metrics_log.METRICS_FILE))


def run_one(regime, arm, seed):
  path = result_path(regime, arm, seed)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  out = common.trained_json(path + ".partial", SCENARIO, regime, arm, seed,
                            arm_config(regime, arm, seed))
  workdir = common.run_dir(SCENARIO, regime, arm, seed)
  out["smoke"] = SMOKE["on"]
  out["mean_train_loss"] = float(np.mean([r["loss"] for r in train_rows(workdir)]))
  out.update(event_stats(workdir, arm_config(regime, arm, seed).gnmr.warmup))
  common.write_json(path, out)
  os.remove(path + ".partial")
  return out


def load(regime):
  """{arm: {seed: result}} of the JSONs written for ``regime``; a --smoke dry run's is refused
  (a shrunk model, never a result) unless this is a dry run."""
  runs = common.load_runs(os.path.join(RESULTS, regime), ARMS)
  for arm, rows in runs.items():
    for seed, row in rows.items():
      if row.get("smoke") and not SMOKE["on"]:
        raise SystemExit(f"{result_path(regime, arm, seed)} is a --smoke dry run: remove it")
  return runs


ROWS = ("x", "W", "g")


def rows_path(regime: str, seed: int) -> str:
  return os.path.join(RESULTS, regime, f"rows_seed{seed}.json")


def row_census(regime: str, seed: int = 0) -> dict:
  """Which tensor saturates: the 'delayed' arm's steps run again (train_loop.build, the same
  config, init and data order as the arm's run), each unit's x / W / g saturation recomputed
  from the amax histories before and after each step (delayed_scaling.saturation), counted per
  row: saturated unit-steps, events (maximal runs of saturated steps at a unit) and events of
  >= 2 steps. One JSON per (regime, seed), skipped when it exists."""
  path = rows_path(regime, seed)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  import jax  # pylint: disable=g-import-not-at-top
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  from gnmr_jax.precision import delayed_scaling  # pylint: disable=g-import-not-at-top
  config = arm_config(regime, "delayed", seed)
  data = make_data(config.data)
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])  # as the arm's run
  saturation = jax.jit(jax.vmap(delayed_scaling.saturation))  # [L, 3, H] x 2 -> [L, 3]
  it = data.train_iterator()
  flags = []  # per step: bool [units * L, 3]
  with train_loop.sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(config.train.seed))
    for _ in range(config.train.steps):
      previous = jax.tree.map(np.asarray, state.amax_history)  # the step donates the state
      state, _ = run.train_step(state, train_loop.device_batch(run, next(it)))
      leaves = zip(jax.tree.leaves(previous), jax.tree.leaves(state.amax_history))
      flags.append(np.concatenate([np.asarray(saturation(p, c)) > 1 for p, c in leaves]))
  sat = np.stack(flags)  # [steps, units, 3]
  out = {"regime": regime, "seed": seed, "steps": int(sat.shape[0]),
         "unit_steps": int(sat.shape[0] * sat.shape[1]), "rows": {}}
  for r, row in enumerate(ROWS):
    runs = [length for _, _, length in event_runs(sat[:, :, r])]
    out["rows"][row] = {"saturated_unit_steps": int(sat[:, :, r].sum()), "events": len(runs),
                        "events_2plus": int(sum(n >= 2 for n in runs)),
                        "longest": int(max(runs, default=0))}
  out["any_row_saturated_unit_steps"] = int(sat.any(axis=2).sum())
  common.write_json(path, out)
  return out


def rows_table() -> list:
  lines = ["| regime | seed | tensor | saturated unit-steps per 1000 | events | events >= 2 steps "
           "| longest event (steps) |", "|---|---|---|---|---|---|---|"]
  for regime in REGIMES:
    path = rows_path(regime, 0)
    if not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      census = json.load(f)
    for row in ROWS:
      c = census["rows"][row]
      lines.append(f"| {regime} | 0 | {row} | "
                   f"{1000 * c['saturated_unit_steps'] / census['unit_steps']:.2f} | "
                   f"{c['events']} | {c['events_2plus']} | {c['longest']} |")
  return lines


def measure_table(seed: int = 0) -> list:
  lines = ["| regime | amax history | saturated unit-steps per 1000 | events | events >= 2 steps "
           "| units with events (of 56) | events after step 50 |", "|---|---|---|---|---|---|---|"]
  for regime, length in REGIMES.items():
    row = load(regime).get("delayed", {}).get(seed)
    if row is None or "events" not in row:
      lines.append(f"| {regime} | {length} | not run | - | - | - | - |")
      continue
    rate = 1000 * row["saturated_unit_steps"] / row["unit_steps"]
    lines.append(f"| {regime} | {length} | {rate:.2f} "
                 f"| {row['events']} | {row['events_2plus']} | {row['units_with_events']} "
                 f"| {row['events_after_step_50']} |")
  return lines


def _paired(rows, ref, key="eval_loss") -> str:
  if not ref or rows is ref:
    return "-"
  d, se, n = selection_report.paired(rows.values(), ref.values(), key)
  return f"{d:+.4f} +- {se:.4f} (n={n})" if n >= 2 else (f"{d:+.4f} (n=1)" if n else "-")


def _floor(results, key) -> str:
  base, perturbed = results.get("delayed", {}), results.get("delayed_perturb", {})
  gaps = [abs(perturbed[k][key] - base[k][key]) for k in set(base) & set(perturbed)]
  return f"{max(gaps):.4f}" if gaps else "-"


def arms_table() -> list:
  lines = []
  header = ["| regime | arm | seeds | final eval loss (mean) "
           "| final - delayed, paired (mean +- SE) | final - bf16, paired "
           "| mean train loss - bf16, paired | recovered unit-steps % "
           "| saturated per 1000 unit-steps | events the mask reached at t+1 / by t+2 "
           "| events of >= 2 steps recovered at their 2nd step (after the warmup) "
           "| H100 1b step / bf16 (model) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for regime in REGIMES:
    lines += header
    results = load(regime)
    base, bf16 = results.get("delayed", {}), results.get("bf16", {})
    for arm in ARMS:
      rows = results.get(arm, {})
      if not rows:
        lines.append(f"| {regime} | {arm} | 0 | not run |" + " - |" * 8)
        continue

      def total(key):
        return sum(r.get(key, 0) for r in rows.values())

      unit_steps, events = total("unit_steps"), total("events")
      share = total("recovered_unit_steps") / unit_steps if unit_steps else 0.0
      static = arm in STATIC
      lines.append(
          f"| {regime} | {arm} | {len(rows)} | "
          f"{np.mean([r['eval_loss'] for r in rows.values()]):.4f} | {_paired(rows, base)} | "
          f"{_paired(rows, bf16)} | {_paired(rows, bf16, 'mean_train_loss')} | "
          + (f"{100 * share:.2f}{' (would, telemetry)' if static else ''} | " if unit_steps
             else "- | ")
          + (f"{1000 * total('saturated_unit_steps') / unit_steps:.2f} | "
             f"{total('covered_1')} / {total('covered_2')} of {events} | "
             f"{total('covered_2plus_at_next')} of {total('events_2plus')} "
          f"({total('covered_2plus_after_warmup')} of {total('events_2plus_after_warmup')}) | "
          if events or (
                 unit_steps and "events" in next(iter(rows.values()))) else "- | - | - | ")
          + f"{arm_price(arm, 0.0 if static else share):.3f} |")
    lines.append("")
    lines.append(f"Noise floor of a seed ({regime}): max abs(delayed_perturb - delayed) "
                 f"{_floor(results, 'eval_loss')} (final eval loss), "
                 f"{_floor(results, 'mean_train_loss')} (mean train loss).")
    lines.append("")
  return lines


# The arms' programs at scale: benchmarks/results/step_time cells compiled deviceless for an
# H100 (llama:1b, 256 x 256 tokens, attention 'auto'; BENCHMARKS.md "Scaling recipes"), priced
# by the step-time model (gnmr_jax.aot.step_time.price, the pure roofline as that table's) with
# each routed arm's measured share of recovered unit-steps taking the recovery branch.
PRICE_TARGET, PRICE_CONFIG = "h100", "llama-1b"
PRICE_CELLS = {"bf16": "bf16__static__attentionauto", "row": "fp8__static__attentionauto",
               "tensor": "fp8__static__attentionauto__scalingtensor",
               "delayed": "fp8__static__attentionauto__scalingdelayed",
               "routed": "fp8__gnmr__attentionauto__scalingdelayed"}


def _cell_kernels(kind: str):
  path = os.path.join(ROOT, "benchmarks", "results", "step_time",
                      f"projection__{PRICE_TARGET}__{PRICE_CONFIG}__{PRICE_CELLS[kind]}.json")
  with open(path, encoding="utf-8") as f:
    return json.load(f)["kernels"]


def arm_price(arm: str, recovered_share: float) -> float:
  """The step-time model's H100 llama:1b step of the arm's program, over bf16's."""
  from gnmr_jax.aot import device_specs, step_time  # pylint: disable=g-import-not-at-top
  spec = device_specs.get_spec(PRICE_TARGET)
  name = arm.removesuffix("_perturb")
  kind = name if name in ("bf16", "row", "tensor", "delayed") else "routed"
  share = recovered_share if kind == "routed" else 0.0
  seconds = step_time.price(_cell_kernels(kind), spec, share).total_s
  return seconds / step_time.price(_cell_kernels("bf16"), spec).total_s


RUNTIME = ROUTED
STATIC_AT_BUDGET = ("hindsight", "delayed")  # the budget's static choices (delayed: none)


def _spend(rows: dict) -> str:
  """What an arm's mask recovered over its seeds: the share of unit-steps, and the most units
  in one step where the runs logged it; '' where they logged no unit-steps."""
  unit_steps = sum(r.get("unit_steps", 0) for r in rows.values())
  if not unit_steps:
    return ""
  share = sum(r["recovered_unit_steps"] for r in rows.values()) / unit_steps
  out = f"recovers {100 * share:.2f}% of unit-steps"
  peaks = [r["most_units_recovered_in_a_step"] for r in rows.values()
           if "most_units_recovered_in_a_step" in r]
  return out + (f", at most {max(peaks)} units in a step" if peaks else "")


def answer(regime: str) -> list:
  """The generated answer for a regime: each runtime arm against the best static arm at the
  same budget (lowest mean final loss of STATIC_AT_BUDGET), paired by seed; and why, from the
  events ('delayed' arm)."""
  results = load(regime)
  statics = {a: results[a] for a in STATIC_AT_BUDGET if results.get(a)}
  if not statics or not any(results.get(a) for a in RUNTIME):
    return [f"{regime}: not enough runs for an answer yet."]
  # the best on the seeds every static arm has (their means over different seeds would mislead)
  shared = set.intersection(*(set(rows) for rows in statics.values()))
  best = min(statics, key=lambda a: np.mean([r["eval_loss"] for s, r in statics[a].items()
                                             if s in shared or not shared]))
  lines = [f"{regime}: best static arm at the budget: '{best}' (lowest mean final loss over "
           f"the {len(shared)} seeds {sorted(shared)} of {list(statics)})."]
  for arm in RUNTIME:
    if not results.get(arm):
      continue
    d, se, n = selection_report.paired(results[arm].values(), statics[best].values())
    # an SE of fewer than 3 paired seeds judges nothing (2 seeds: one degree of freedom)
    verdict = ("beats it by more than 2 SE" if n >= 3 and d < -2 * se else
               "is worse by more than 2 SE" if n >= 3 and d > 2 * se else
               "does not differ by more than 2 SE" if n >= 3 else
               f"{n} seed(s): too few to judge yet")
    spent = [_spend(results[arm]), _spend(statics[best])]
    spent = f"; {spent[0]} ('{best}': {spent[1]})" if all(spent) else ""
    rows = results[arm].values()
    if all("events_2plus" in r for r in rows):
      spent += (f"; its mask reached {sum(r['covered_2plus_at_next'] for r in rows)} of the "
                f"{sum(r['events_2plus'] for r in rows)} events of >= 2 steps at their 2nd step")
    lines.append(f"- '{arm}' minus '{best}': {d:+.4f} +- {se:.4f} nats (n={n}): {verdict}"
                 f"{spent}.")
  bf16 = results.get("bf16", {})
  for arm in ("delayed", "tensor", "row"):  # what there is to recover, and where it comes from
    if results.get(arm) and bf16:
      parts = [f"{key.replace('_', ' ')} {_paired(results[arm], bf16, key)}"
               for key in ("eval_loss", "mean_train_loss")]
      lines.append(f"- '{arm}' minus 'bf16': " + "; ".join(parts) + ".")
  delayed = list(results.get("delayed", {}).values())
  if delayed and "events" in delayed[0] and sum(r["events"] for r in delayed):
    events = sum(r["events"] for r in delayed)
    long = sum(r["events_2plus"] for r in delayed)
    steps = sum(r["unit_steps"] for r in delayed)
    lines.append(
        f"- Why (arm 'delayed', {len(delayed)} seed(s)): {events} saturation events, "
        f"{1000 * events / steps:.1f} per 1000 unit-steps; {100 * (1 - long / events):.1f}% of "
        f"them last one step (the observed amax doubles and the next scale holds it), so a mask "
        f"acting at t + 1 reaches only the {long} events of >= 2 steps; the gradient norms "
        f"alarm at an event's own step for "
        f"{100 * sum(r['norm_alarm_paper'] for r in delayed) / events:.1f}% of them at the "
        f"paper's thresholds and {100 * sum(r['norm_alarm_default'] for r in delayed) / events:.1f}"
        f"% at the default alarm's.")
  return lines


def section() -> str:
  """The RESULTS.md section (experiments/report.py), from the JSONs."""
  lines = ["## Delayed-scaling regime (issue 47)", "",
           "Generated by `experiments/delayed_regime.py` from experiments/results/delayed_regime/ "
           "(setting: the script's docstring; every table: "
           "experiments/results/delayed_regime/REPORT.md).", ""]
  for regime in REGIMES:
    lines += answer(regime) + [""]
  lines += ["### Saturation rates (arm 'delayed', seed 0)", ""] + measure_table() + [""]
  lines += ["### Arms", ""] + arms_table()
  return "\n".join(lines).rstrip() + "\n"


def report() -> str:
  runs = [r for regime in REGIMES for arm in load(regime).values() for r in arm.values()]
  dated = sorted({(r["date"], r["device"]) for r in runs})
  versions = runs[0]["versions"] if runs else versions_lib.versions()
  return "\n".join([
      "# Delayed-scaling fp8 on the CPU: the saturation aftermath (issue 47, regime R1)", "",
      "Generated by `python experiments/delayed_regime.py --report` (never edited by hand); the "
      "setting is in the script's docstring. XLA:CPU runs the fp8 GEMMs as float32 products of "
      "the fp8 codes: the numerics of the recipes, not their speed.", "",
      f"Runs: {', '.join(f'{d} on {dev}' for d, dev in dated) or 'none yet'}; "
      f"versions {versions}.", "", "## Saturation rates (arm 'delayed', seed 0)", ""]
      + measure_table() + ["", "Which tensor saturates (`--part rows`: the 'delayed' arm's "
                           "seed 0 run again, each row's saturation recomputed from the "
                           "histories):", ""] + rows_table() + ["", "## Answer", ""]
      + [line for regime in REGIMES for line in answer(regime) + [""]]
      + ["## Arms", ""] + arms_table()) + "\n"


def main(argv=None):
  global RESULTS, REPORT  # pylint: disable=global-statement  (--results moves every reader)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("measure", "rows", "restat", "arms", "prepare"),
                      default="arms",
                      help="prepare: only the token caches of --regimes (under "
                      "$GNMR_JAX_DATA_DIR; a device without TFDS reads them, carried)")
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--regimes", default="h16,h1")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--report", action="store_true", help="only (re)write the report")
  common.add_dry_run_options(parser, COMMITTED_RESULTS)
  args = parser.parse_args(argv)
  common.check_dry_run(args, COMMITTED_RESULTS)
  RESULTS, common.RUNS_DIR, SMOKE["on"] = args.results, args.runs, args.smoke
  REPORT = os.path.join(RESULTS, "REPORT.md")
  if args.part == "prepare":
    from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
    for regime in args.regimes.split(","):
      data = make_data(arm_config(regime, "delayed", 0).data)
      print(f"[prepare] {regime}: {data.vocab_size} tokens in the vocabulary, token cache under "
            f"{os.path.expanduser(data.config.data_dir)}", flush=True)
    return
  if not args.report:
    common.enable_compilation_cache()
    regimes = args.regimes.split(",")
    if args.part == "measure":
      for regime in regimes:
        run_one(regime, "delayed", 0)
    elif args.part == "restat":  # the event statistics again, from the runs' logs here
      for regime in regimes:
        for arm, rows in load(regime).items():
          for seed, row in rows.items():
            workdir = common.run_dir(SCENARIO, regime, arm, seed)
            if os.path.exists(os.path.join(workdir, "units.jsonl")):
              row.update(event_stats(workdir, arm_config(regime, arm, seed).gnmr.warmup))
              common.write_json(result_path(regime, arm, seed), row)
    elif args.part == "rows":
      for regime in regimes:
        row_census(regime, 0)
    else:
      for seed in range(args.seeds):
        for regime in regimes:
          for arm in args.arms.split(","):
            run_one(regime, arm, seed)
  common.write_report(REPORT, report())


if __name__ == "__main__":
  main()
