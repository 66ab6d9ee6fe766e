"""Regenerates RESULTS.md and experiments/figures/*.png from experiments/results/*.json.

    python experiments/report.py

Every number in RESULTS.md comes from the results JSON the scenario scripts write;
nothing is typed in by hand. A scenario or scale with no results is listed as
"not run yet" with the command that produces it.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
FIGURES_DIR = os.path.join(ROOT, "experiments", "figures")
REPORT = os.path.join(ROOT, "RESULTS.md")

SCENARIOS = {
    "scenario1": ("Scenario 1: saved-activation stress test",
                  "experiments/scenario1_saved_activation.py"),
    "scenario2": ("Scenario 2: DeepSeek-V3-style fine-grained 6/8-bit",
                  "experiments/scenario2_blockwise.py"),
    "scenario3": ("Scenario 3: LoRA fine-tuning with INT8 frozen base weights",
                  "experiments/scenario3_lora.py"),
}


def mean_std(values):
  values = [v for v in values if v is not None and np.isfinite(v)]
  if not values:
    return float("nan"), float("nan"), 0
  std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  return float(np.mean(values)), std, len(values)


def stat(arm: dict, key: str):
  return mean_std([r.get(key) for r in arm["runs"]])


def fmt(mean, std=None, digits=2):
  if mean is None or not np.isfinite(mean):
    return "n/a"
  if std is None:
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


# Results of the runs before issue 18, when every seed trained on data seed 0 (kept to show how
# each figure moved once the seeds got their own data orders).
SHARED_DATA_SUFFIX = "_shared_data.json"


def load_results(previous: bool = False):
  """{(scenario, scale): results} of the current runs, or with `previous` of the runs that
  shared one data order (the *_shared_data.json files)."""
  out = {}
  if not os.path.isdir(RESULTS_DIR):
    return out
  for name in sorted(os.listdir(RESULTS_DIR)):
    if not name.endswith(".json") or name.startswith("selection_cpu"):  # selection_report.py
      continue
    if name.endswith(SHARED_DATA_SUFFIX) != previous:
      continue
    with open(os.path.join(RESULTS_DIR, name), encoding="utf-8") as f:
      data = json.load(f)
    out[(data["scenario"], data["scale"])] = data
  return out


# --- figures ------------------------------------------------------------------------------


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _mean_curve(runs, key):
  curves = [np.asarray(r[key], np.float64) for r in runs if r.get(key)]
  if not curves:
    return None, None
  length = min(len(c) for c in curves)
  stacked = np.stack([c[:length] for c in curves])
  return stacked[0, :, 0], stacked[:, :, 1].mean(axis=0)


def _smooth(y, window=3):
  if len(y) < window:
    return y
  kernel = np.ones(window) / window
  padded = np.concatenate([np.full(window - 1, y[0]), y])
  return np.convolve(padded, kernel, mode="valid")


def plot_losses(data, path, groups):
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 6.0), squeeze=False)
  for ax, (title, names) in zip(axes[0], groups):
    for i, name in enumerate(names):
      arm = data["arms"].get(name)
      if arm is None:
        continue
      color = plt.cm.tab20(i % 20) if len(names) > 10 else f"C{i}"
      steps, loss = _mean_curve(arm["runs"], "train_curve")
      if steps is not None:
        ax.plot(steps, _smooth(loss), color=color, lw=1.2, alpha=0.8, label=arm["label"])
      steps, loss = _mean_curve(arm["runs"], "eval_curve")
      if steps is not None:
        ax.plot(steps, loss, "o", color=color, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)\nlines: train (smoothed), dots: validation")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
  fig.suptitle(f"{data['scenario']} ({data['scale']} scale), mean over seeds", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot_heatmap(data, arm_name, path):
  arm = data["arms"].get(arm_name)
  runs = [r for r in (arm or {}).get("runs", []) if r.get("heatmap")]
  if not runs:
    return None
  heat = runs[0]["heatmap"]
  matrix = np.asarray(heat["mask"], np.float64).T  # units x logged steps
  plt = _pyplot()
  names = [n.replace("layers/", "").replace("/kernel", "") for n in heat["units"]]
  fig, ax = plt.subplots(figsize=(9, max(3, 0.14 * len(names) + 1.2)))
  steps = heat["steps"]
  ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1,
            extent=(steps[0], steps[-1], len(names) - 0.5, -0.5))
  ax.set_yticks(range(len(names)))
  ax.set_yticklabels(names, fontsize=6)
  ax.set_xlabel("step (mask logged every few steps)")
  ax.set_title(f"recovery mask, {arm['label']}, seed {runs[0]['seed']} "
               f"(dark = recovery path)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


# --- tables and claims --------------------------------------------------------------------


def _before(previous, name, ppl):
  """The shared-data-order figure of arm `name` and how far the new mean moved from it."""
  arm = (previous or {}).get("arms", {}).get(name)
  if arm is None:
    return "not run"
  old, old_std, _ = stat(arm, "eval_perplexity")
  return f"{fmt(old, old_std)} ({ppl - old:+.2f})"


def table(data, low_cost_arm, previous=None):
  ref_time = stat(data["arms"][low_cost_arm], "step_seconds")[0] if low_cost_arm in data[
      "arms"] else float("nan")
  lines = ["| arm | what | final val. perplexity (mean ± std) | before: one data order for every "
           "seed (new - old) | seeds | recovered unit-steps % "
           "| threshold exceedance % | step time / static low-cost | non-finite steps |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, arm in data["arms"].items():
    ppl, ppl_std, n = stat(arm, "eval_perplexity")
    rec = stat(arm, "recovered_unit_steps_pct")[0]
    exc = stat(arm, "threshold_exceedance_pct")[0]
    step = stat(arm, "step_seconds")[0]
    ratio = step / ref_time if ref_time and np.isfinite(ref_time) else float("nan")
    same_run = any(low_cost_arm in i.get("arms", []) and name in i.get("arms", [])
                   for i in data.get("invocations") or [{"arms": list(data["arms"])}])
    nonfinite = sum(r.get("num_nonfinite_steps", 0) for r in arm["runs"])
    extra = "" if arm["role"] in ("gnmr", "ablation") or arm["overrides"].get(
        "controller") == "random" else " (measured, not used)"
    rec_s = fmt(rec, digits=2) if arm["role"] in ("gnmr", "ablation") or arm["overrides"].get(
        "controller") == "random" else "0 (static)"
    lines.append(f"| `{name}` | {arm['label']} | {fmt(ppl, ppl_std)} | "
                 f"{_before(previous, name, ppl)} | {n} | {rec_s} | "
                 f"{fmt(exc, digits=2)}{extra} | "
                 f"{fmt(ratio) if same_run else 'n/a (timed in another invocation)'} | "
                 f"{nonfinite} |")
  return "\n".join(lines)


def _cmp(data, name):
  arm = data["arms"].get(name)
  if arm is None:
    return None
  return stat(arm, "eval_perplexity")


def _matches(a, b):
  """a matches b: means within 1%, or within 2 standard errors of their difference."""
  (ma, sa, na), (mb, sb, nb) = a, b
  stderr = math.sqrt(sa ** 2 / max(na, 1) + sb ** 2 / max(nb, 1))
  return abs(ma - mb) <= max(0.01 * mb, 2 * stderr)


def _paired(data, a, b):
  """Mean ± std over seeds of perplexity(a) - perplexity(b), same seed (init and data order)."""
  ra = {r["seed"]: r["eval_perplexity"] for r in data["arms"][a]["runs"]}
  rb = {r["seed"]: r["eval_perplexity"] for r in data["arms"][b]["runs"]}
  diffs = [ra[k] - rb[k] for k in sorted(set(ra) & set(rb))]
  return mean_std(diffs)


def _gap_closed(gnmr, static, ref):
  gap = static[0] - ref[0]
  if gap <= 0:
    return float("nan")
  return 100.0 * (static[0] - gnmr[0]) / gap


def _severity(static, ref):
  ratio = static[0] / ref[0]
  if ratio > 1.5:
    return "it fails: more than 1.5x the bf16 perplexity"
  if ratio > 1.05:
    return "it ends clearly higher, though it trains"
  return "it does not break: within 5% of bf16"


def claim_saved_activation(data):
  ref, s8 = _cmp(data, "bf16"), _cmp(data, "static8")
  paras = []
  for bits, static_name, gnmr_name in ((4, "static4", "gnmr4_8"), (2, "static2", "gnmr2_8")):
    st, gn = _cmp(data, static_name), _cmp(data, gnmr_name)
    if None in (ref, s8, st, gn):
      continue
    exc = stat(data["arms"][gnmr_name], "threshold_exceedance_pct")[0]
    rec = stat(data["arms"][gnmr_name], "recovered_unit_steps_pct")[0]
    breaks = st[0] > 1.05 * ref[0]
    gn_ok = _matches(gn, ref) and _matches(gn, s8)
    closed = _gap_closed(gn, st, ref)
    if breaks and gn_ok and exc < 0.2:
      verdict = "**reproduced**"
    elif breaks and (closed >= 50 or gn_ok):
      verdict = "**partly reproduced**"
    else:
      verdict = "**not reproduced**"
    paras.append(
        f"- {bits}-bit: {verdict}. Static {bits}-bit ends at perplexity {fmt(*st[:2])} vs "
        f"bf16 {fmt(*ref[:2])} and static 8-bit {fmt(*s8[:2])} "
        f"({100 * (st[0] / ref[0] - 1):+.1f}% vs bf16: "
        f"{_severity(st, ref)}). "
        f"GNMR {bits}/8 ends at {fmt(*gn[:2])} "
        f"({100 * (gn[0] / ref[0] - 1):+.1f}% vs bf16; "
        f"{'matches' if gn_ok else 'does not match'} bf16 and static 8-bit within 1% or 2 "
        f"standard errors; paired per-seed difference GNMR - static "
        f"{fmt(*_paired(data, gnmr_name, static_name)[:2])}), "
        + (f"closing {round(closed):+d}% of the static-to-bf16 gap, " if np.isfinite(closed) else "")
        + f"with {fmt(rec)}% of unit-steps recovered and threshold exceedances on "
        f"{fmt(exc)}% of eligible unit-steps (paper: < 0.2%; the bf16 run, which has nothing "
        f"to recover, exceeds them on {fmt(stat(data['arms']['bf16'], 'threshold_exceedance_pct')[0])}%"
        f", so at this scale the thresholds are not specific to the stress).")
  paper = _cmp(data, "static4_paper")
  if paper is not None and ref is not None:
    paras.insert(0, f"- The paper's literal stress (4-bit, per-token scale, weight gradient only) "
                 f"ends at {fmt(*paper[:2])} ({100 * (paper[0] / ref[0] - 1):+.1f}% vs bf16): "
                 + ("it does not break at this scale, so the arms below use the harsher "
                    "per-tensor, forward-quantized regime." if paper[0] <= 1.05 * ref[0] else
                    "it breaks at this scale."))
  paper2 = _cmp(data, "static2_paper")
  if paper2 is not None and ref is not None:
    paras.insert(1, f"- The same stress at 2 bits ends at {fmt(*paper2[:2])} "
                 f"({100 * (paper2[0] / ref[0] - 1):+.1f}% vs bf16): "
                 + ("it does not break either." if paper2[0] <= 1.05 * ref[0] else
                    "it breaks."))
  extra = []
  for name in ("random2_8", "gnmr2_8_score_only", "gnmr2_8_delta_only", "gnmr2_8_no_lock",
               "gnmr2_8_max_o2", "gnmr2_8_max_o8", "gnmr2_8_max_o28", "static2_global_clip",
               "gnmr2_8_global_clip", "static2_zclip", "static2_adagc"):
    c = _cmp(data, name)
    if c is not None:
      extra.append(f"`{name}` {fmt(*c[:2])}")
  if extra:
    gn = _cmp(data, "gnmr2_8")
    paras.append("- Baselines and ablations on the 2-bit path (GNMR 2/8: "
                 f"{fmt(*gn[:2]) if gn else 'n/a'}): " + "; ".join(extra) + ".")
    group = {n: _cmp(data, n) for n in data["arms"]
             if (n.startswith("static2") or n.startswith("gnmr2_8") or n == "random2_8")
             and not n.endswith("_paper")}
    best = min(group, key=lambda n: group[n][0])
    rnd, st2 = _cmp(data, "random2_8"), _cmp(data, "static2")
    line = (f"- Best arm on the 2-bit path: `{best}` ({fmt(*group[best][:2])}). ")
    if gn is not None and rnd is not None:
      line += ("GNMR 2/8 is " + ("not distinguishable from" if _matches(gn, rnd) else
                                 ("better than" if gn[0] < rnd[0] else "worse than"))
               + " same-budget random recovery")
    if gn is not None and st2 is not None:
      line += (" and " + ("not distinguishable from" if _matches(gn, st2) else
                          ("better than" if gn[0] < st2[0] else "worse than"))
               + " the static 2-bit path (means within 1% or 2 standard errors count as not "
               "distinguishable).")
    paras.append(line)
  return "\n".join(paras) if paras else "- Not enough arms were run to judge the claim."


def claim_blockwise(data):
  ref, b8, b6, gn = (_cmp(data, n) for n in ("bf16", "block8", "block6", "gnmr6_8"))
  if None in (ref, b8, b6, gn):
    return "- Not enough arms were run to judge the claim."
  # Tracking throughout training: the largest relative gap of the mean validation loss.
  curves = {n: _mean_curve(data["arms"][n]["runs"], "eval_curve")[1]
            for n in ("bf16", "block8", "gnmr6_8", "block6")}
  length = min(len(c) for c in curves.values())
  gap8 = float(np.max(np.abs(curves["gnmr6_8"][:length] / curves["block8"][:length] - 1)))
  gapbf = float(np.max(np.abs(curves["gnmr6_8"][:length] / curves["bf16"][:length] - 1)))
  t6 = stat(data["arms"]["block6"], "step_seconds")[0]
  tg = stat(data["arms"]["gnmr6_8"], "step_seconds")[0]
  t8 = stat(data["arms"]["block8"], "step_seconds")[0]
  exc = stat(data["arms"]["gnmr6_8"], "threshold_exceedance_pct")[0]
  rec = stat(data["arms"]["gnmr6_8"], "recovered_unit_steps_pct")[0]
  tracks = gap8 < 0.01 and gapbf < 0.02
  six_breaks = b6[0] > 1.02 * b8[0]
  if tracks and six_breaks:
    verdict = "**reproduced (numerics only)**"
  elif tracks:
    verdict = ("**holds but is not tested**: GNMR 6/8 tracks the references, and so does fixed "
               "6-bit without any recovery")
  else:
    verdict = "**not reproduced**"
  return (
      f"- Tracking: {verdict}. Final perplexity: bf16 {fmt(*ref[:2])}, fixed 8-bit "
      f"{fmt(*b8[:2])}, fixed 6-bit {fmt(*b6[:2])}, GNMR 6/8 {fmt(*gn[:2])}. Over the "
      f"validation points the mean GNMR 6/8 loss stays within {100 * gap8:.2f}% of fixed 8-bit "
      f"and {100 * gapbf:.2f}% of bf16. Fixed 6-bit "
      f"{'is' if six_breaks else 'is not'} more than 2% worse than fixed 8-bit, so "
      + ("there was something to recover" if six_breaks else
         "at this scale 6-bit tiles are already good enough and the comparison cannot show "
         "that recovery matters")
      + f"; GNMR recovered {fmt(rec)}% of unit-steps (exceedance {fmt(exc)}%).\n"
      f"- Step time: GNMR 6/8 {fmt(tg, digits=3)} s vs fixed 6-bit {fmt(t6, digits=3)} s and fixed "
      f"8-bit {fmt(t8, digits=3)} s per step (ratio to 6-bit {fmt(tg / t6)}). **Not a test of the "
      f"claim**: the blockwise path simulates 6/8-bit tiles by quantize-dequantize in float32, "
      f"so 6-bit is not cheaper than 8-bit here on any device; the ratio shows the routing "
      f"overhead plus load noise"
      + (" (the routed arm measured faster than the static arm whose path it runs, which only "
         "load noise can explain)." if tg < t6 else "."))


def claim_lora(data):
  ref, st, gn = (_cmp(data, n) for n in ("lora_bf16", "lora_int8", "lora_gnmr"))
  if None in (ref, st, gn):
    return "- Not enough arms were run to judge the claim."
  cloze = {n: stat(data["arms"][n], "cloze_accuracy") for n in ("lora_bf16", "lora_int8",
                                                                 "lora_gnmr")}
  ok = _matches(gn, ref)
  if ok and _matches(st, ref):
    verdict = ("**holds but is not tested**: GNMR INT8/BF16 matches bf16, and so does static "
               "INT8 without any recovery")
  else:
    verdict = "**reproduced**" if ok else "**not reproduced**"
  return (f"- {verdict} at this scale: held-out Milton perplexity bf16 LoRA {fmt(*ref[:2])}, "
          f"static INT8 base {fmt(*st[:2])}, GNMR INT8/BF16 {fmt(*gn[:2])}; cloze accuracy "
          f"(held-out lines) bf16 {fmt(*cloze['lora_bf16'][:2], digits=3)}, INT8 "
          f"{fmt(*cloze['lora_int8'][:2], digits=3)}, GNMR "
          f"{fmt(*cloze['lora_gnmr'][:2], digits=3)} (chance 0.25)."
          + (f" Before fine-tuning (adapters at zero, bf16 base) the model scores perplexity "
             f"{fmt(*stat(data['arms']['lora_bf16'], 'base_perplexity')[:2])} and cloze "
             f"{fmt(*stat(data['arms']['lora_bf16'], 'base_cloze_accuracy')[:2], digits=3)}; "
             f"with the INT8 base {fmt(*stat(data['arms']['lora_int8'], 'base_perplexity')[:2])}"
             f" and {fmt(*stat(data['arms']['lora_int8'], 'base_cloze_accuracy')[:2], digits=3)}."
             if data["arms"]["lora_bf16"]["runs"][0].get("base_perplexity") else ""))


CLAIMS = {"scenario1": claim_saved_activation, "scenario2": claim_blockwise,
          "scenario3": claim_lora}
LOW_COST = {"scenario1": "static4", "scenario2": "block6", "scenario3": "lora_int8"}
HEATMAP = {"scenario1": "gnmr2_8", "scenario2": "gnmr6_8", "scenario3": "lora_gnmr"}


def loss_groups(data):
  names = list(data["arms"])
  main = [n for n in names if data["arms"][n]["role"] in ("reference", "static", "gnmr")]
  rest = [n for n in names if n not in main]
  groups = [("main arms", main)]
  if rest:
    context = [n for n in ("bf16", "static2", "gnmr2_8") if n in names]
    groups.append(("baselines and ablations", context + rest))
  return groups


def section(key, scale, data, previous=None):
  title, script = SCENARIOS[key]
  out = [f"### {scale} scale"]
  if data is None and previous is not None:  # not re-run since issue 18: show what there is
    out.append(f"**Not re-run since issue 18: every seed below trained on the batches of data "
               f"seed 0** (`experiments/results/{key}_{scale}{SHARED_DATA_SUFFIX}`), so the "
               "seeds vary the initial params only. Re-run: `python "
               f"{script} --scale {scale}`.")
    data, previous = previous, None
  if data is None:
    out.append(f"Not run yet. Run: `python {script} --scale {scale}`"
               + (" on one H200 (then commit experiments/results and experiments/figures)"
                  if scale == "gpu" else "") + ", then `python experiments/report.py`.")
    return "\n\n".join(out)
  base = data["base_config"]
  m = base["model"]
  seeds = sorted({r["seed"] for a in data["arms"].values() for r in a["runs"]})
  out.append(
      f"Measured {data['date']} on {data['device']}, "
      f"jax {data['versions']['jax']}, flax {data['versions']['flax']}, "
      f"optax {data['versions']['optax']}; wall time {data['wall_seconds'] / 60:.0f} min "
      f"(runs reused from earlier invocations excluded). Model d={m['d_model']}, {m['num_layers']} layers, "
      f"{m['num_heads']} heads, ffn {m['ffn_dim']}; sequence {base['data']['seq_len']}, batch "
      f"{base['data']['batch_size']}, {base['train']['steps']} steps, peak lr "
      f"{base['optimizer']['learning_rate']}, data `{base['data']['dataset']}` "
      f"({base['data']['tokenizer']}); GNMR alpha {base['gnmr']['alpha']}, beta "
      f"{base['gnmr']['beta']}, delta {base['gnmr']['delta']}, max_o {base['gnmr']['max_o']}, "
      f"t_lock {base['gnmr']['t_lock']}, warmup {base['gnmr']['warmup']}; seeds {seeds}. "
      "Commands: " + "; ".join(f"`{i['command']}` ({i['wall_seconds'] / 60:.0f} min)"
                               for i in data.get("invocations") or [data]) + ".")
  for k, v in (data.get("notes") or {}).items():
    out.append(f"*{k}*: {v}")
  low = (data.get("notes") or {}).get("low_cost_arm", LOW_COST[key])
  out.append(table(data, low, previous))
  if previous is not None:
    out.append("Before issue 18 every seed of these arms trained on the batches of data seed 0 "
               "(the prebuilt data ignored `config.data.seed`), so seeds varied the initial "
               "params only; the 'before' column is that run "
               f"(`experiments/results/{key}_{scale}{SHARED_DATA_SUFFIX}`, measured "
               f"{previous['date']}), the first column the re-run with one data order per seed.")
  out.append("Step time is the median over logged intervals of each run (compilation "
             "excluded), averaged over seeds, divided by that of "
             f"`{low}` timed in the same invocation (load differs between invocations); on a shared 2-core CPU it carries load noise of roughly ±10%, and CPU "
             "step times say nothing about GPU speed (the low-bit paths are simulated or "
             "upcast on CPU). Threshold exceedance is the share of (unit, step) pairs over "
             "alpha or beta; static arms still run the controller for this telemetry.")
  fig = os.path.join(FIGURES_DIR, f"{key}_{scale}_loss.png")
  plot_losses(data, fig, loss_groups(data))
  out.append(f"![loss curves](experiments/figures/{os.path.basename(fig)})")
  with_heat = [n for n, a in data["arms"].items() if any(r.get("heatmap") for r in a["runs"])]
  heat_arm = HEATMAP[key] if HEATMAP[key] in with_heat else (with_heat or [None])[0]
  heat = heat_arm and plot_heatmap(data, heat_arm,
                                   os.path.join(FIGURES_DIR, f"{key}_{scale}_heatmap.png"))
  if heat:
    out.append(f"![recovery heatmap](experiments/figures/{os.path.basename(heat)})")
  out.append("**Claim, as measured here:**\n\n" + CLAIMS[key](data))
  return "\n\n".join(out)


HEADER = """# Results: the paper's three experiments at the scale these machines allow

Generated by `python experiments/report.py` from `experiments/results/*.json` (written by the
scenario scripts); do not edit by hand. Regenerate a scenario with
`python experiments/<script> --scale cpu|gpu` (runs every arm x 3 seeds; finished runs in
`experiments/runs/` are reused), then `python experiments/report.py`.

Perplexities are per token of the byte-level tokenizer (bytes), so they are not comparable
with the paper's (sentencepiece/LLaMA) perplexities; compare the arms with each other.
"""


def main(argv=None):
  del argv
  results, previous = load_results(), load_results(previous=True)
  parts = [HEADER]
  for key, (title, _) in SCENARIOS.items():
    parts.append(f"## {title}")
    for scale in ("cpu", "gpu"):
      parts.append(section(key, scale, results.get((key, scale)), previous.get((key, scale))))
  from experiments import selection_report  # pylint: disable=g-import-not-at-top
  parts.append(selection_report.section())
  from experiments import noise_fraction  # pylint: disable=g-import-not-at-top
  parts.append(noise_fraction.section())
  from experiments import delayed_regime  # pylint: disable=g-import-not-at-top
  parts.append(delayed_regime.section())
  text = "\n\n".join(parts).rstrip() + "\n"
  with open(REPORT, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {REPORT}")


if __name__ == "__main__":
  main()
