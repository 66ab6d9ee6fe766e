"""The RESULTS.md section of experiments/selection.py, from experiments/results/selection_cpu.json.

Every number comes from that JSON. Statistics: mean ± sample sd over seeds; a paired
difference between two arms is taken per seed (same init and data order) and reported as
mean ± standard error (sd / sqrt(n)); "closed" is the per-seed share of the
static-low-cost-to-static-recovery loss gap that an arm closes,
(L_low - L_arm) / (L_low - L_rec).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results", "selection_cpu.json")
# The runs before issue 18, when every seed trained on the batches of data seed 0.
PREVIOUS = os.path.join(ROOT, "experiments", "results", "selection_cpu_shared_data.json")
PERTURB = "_perturb"
# Controllers a user can run (no hindsight, no oracle).
DEPLOYABLE = ("norm", "norm_tlock20", "norm_tlock200", "gap", "gap_every50", "gaprec",
              "gaprec_every50", "gaprec_every50_from0", "gapuni_every50_from0",
              "gap_every50_from0", "relgap", "relgap_every50", "relgap_every50_from0", "hybrid",
              "noise_every50_from0", "noisenorm_every50_from0", "noisegate_every50_from0",
              "alarm", "lastblocks", "lateswitch")
REFERENCES = ("oracle", "hindsight")
ORDER = ("static_low", "static_rec", "gnmr", "random", "norm", "norm_tlock20", "norm_tlock200",
         "gap", "gap_every50", "gaprec", "gaprec_every50", "gaprec_every50_from0",
         "gapuni_every50_from0", "gap_every50_from0", "relgap", "relgap_every50",
         "relgap_every50_from0", "hybrid", "noise_every50_from0", "noisenorm_every50_from0",
         "noisegate_every50_from0", "alarm",
         "lastblocks", "lateswitch",
         "oracle", "hindsight", "norm_max_o2", "norm_max_o8", "norm_max_o2_tlock200",
         "norm_max_o8_tlock200", "gaprec_max_o2", "gaprec_max_o8", "relgap_max_o2_every50",
         "relgap_max_o8_every50")
LABELS = {
    "static_low": "static low-cost", "static_rec": "static recovery (every unit)",
    "gnmr": "paper GNMR (`gnmr_jax.gnmr`)", "random": "random, same budget and lock",
    "norm": "norm level (priority 'norm')",
    "norm_tlock20": "norm level, t_lock 20",
    "norm_tlock200": "norm level, t_lock 200 (the set picked at the end of warmup is kept)",
    "norm_max_o2_tlock200": "norm level, t_lock 200, max_o 2",
    "norm_max_o8_tlock200": "norm level, t_lock 200, max_o 8",
    "gap": "measured gap, K=10, 'swapped' pass (priority 'gap')",
    "hybrid": "hybrid: GNMR alarm (alpha 4, beta 3) + norm fill",
    "alarm": "paper GNMR as a transient alarm (alpha 4, beta 3, t_lock 2: the config default "
             "since 2026-12-02)",
    "hybrid_default_thresholds": "hybrid at the default thresholds (alpha 2, beta 1.5)",
    "oracle": "lagged oracle: gap measured every step (priority 'oracle', K=1)",
    "hindsight": "hindsight static set: mlp/down of every layer",
    "gap_every50": "measured gap, K=50, 'swapped' pass",
    "gaprec": "measured gap, K=10, 'recovery' pass (priority 'gap'; recovered units keep their estimate)",
    "gaprec_every50": "measured gap, K=50, 'recovery' pass",
    "relgap": "norm level x measured relative gap, K=10, 'recovery' pass (priority 'relgap')",
    "relgap_every50": "norm level x measured relative gap, K=50, 'recovery' pass",
    "gaprec_every50_from0": "measured gap, K=50, 'recovery' pass, from step warmup + 1 "
                            "(`recovery_gap_start` 0, the default)",
    "gapuni_every50_from0": "measured gap, K=50, 'uniform' pass (every unit re-measured: all "
                            "low-cost against all recovered), from step warmup + 1",
    "gap_every50_from0": "measured gap, K=50, 'swapped' pass (every unit re-measured), from "
                         "step warmup + 1",
    "relgap_every50_from0": "norm level x measured relative gap, K=50, 'recovery' pass, from "
                            "step warmup + 1",
    "gaprec_max_o2": "measured gap (K=10, 'recovery' pass), max_o 2",
    "gaprec_max_o8": "measured gap (K=10, 'recovery' pass), max_o 8",
    "relgap_max_o2_every50": "norm x relative gap (K=50), max_o 2",
    "relgap_max_o8_every50": "norm x relative gap (K=50), max_o 8",
    "noise_every50_from0": "noise fraction (priority 'noise', issue 23): pi_u > 1/3 (hysteresis "
                           "1/6) or the paper's alarm (alpha 4, beta 3); max_o a cap; K=50 "
                           "'uniform' pass with split halves, from step warmup + 1",
    "noisenorm_every50_from0": "noise fraction gate, candidates ranked by the norm level "
                               "(`noise_rank='norm'`), otherwise as the 'noise' arm",
    "noisegate_every50_from0": "noise-fraction gate on the whole model (`noise_gate='any'`: "
                               "while any unit's pi > 1/3 every unit is a candidate), ranked by "
                               "the norm level; otherwise as the 'noise' arm",
    "lastblocks": "NVIDIA's static recipe: the last block's 7 units for the whole run "
                  "(priority 'last_blocks', max_o 7)",
    "lateswitch": "late global switch: every unit from step 175 (priority 'late_switch')",
    "norm_max_o2": "norm level, max_o 2", "norm_max_o8": "norm level, max_o 8",
    "gap_max_o2": "measured gap (K=10), max_o 2", "gap_max_o8": "measured gap (K=10), max_o 8",
}
REGIME_TEXT = {
    "tensor4": "4-bit saved activations, one scale per tensor, forward too / 8-bit",
    "tensor2": "2-bit saved activations, one scale per tensor, forward too / 8-bit",
    "block4": "blockwise 4-bit (1x32 tiles, 32x32 blocks) / bf16",
    "paper4": "the paper's stress: 4-bit per-token, weight gradient only / 8-bit (no-gap control)",
}


def _ms(values, digits=3):
  values = [v for v in values if v is not None and np.isfinite(v)]
  if not values:
    return "n/a"
  if len(values) == 1:
    return f"{values[0]:.{digits}f}"
  return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def paired(runs_a, runs_b, key="eval_loss"):
  """(mean, standard error, n) of a - b over the seeds both have."""
  a = {r["seed"]: r[key] for r in runs_a}
  b = {r["seed"]: r[key] for r in runs_b}
  diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
  if not diffs:
    return float("nan"), float("nan"), 0
  se = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else float("nan")
  return float(np.mean(diffs)), se, len(diffs)


def closed_shares(arms, name):
  """Per-seed share of the static-low-to-static-recovery gap closed by arm `name`."""
  low = {r["seed"]: r["eval_loss"] for r in arms.get("static_low", [])}
  rec = {r["seed"]: r["eval_loss"] for r in arms.get("static_rec", [])}
  out = {}
  for r in arms.get(name, []):
    s = r["seed"]
    if s in low and s in rec and low[s] - rec[s] > 0:
      out[s] = (low[s] - r["eval_loss"]) / (low[s] - rec[s])
  return out


def _t_p_value(mean, se, n):
  """Two-sided p of a paired t-test (n - 1 degrees of freedom)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  if n < 2 or not se > 0:
    return float("nan")
  return float(2 * stats.t.sf(abs(mean) / se, n - 1))


def _fmt_pair(mean, se, n):
  if n == 0 or not np.isfinite(mean):
    return "n/a"
  if n == 1 or not (se and np.isfinite(se) and se > 0):
    return f"{mean:+.4f} (n={n})"
  return (f"{mean:+.4f} ± {se:.4f} (n={n}, {abs(mean) / se:.1f} SE, "
          f"t-test p={_t_p_value(mean, se, n):.3f})")


def quality_section(quality):
  out = []
  for regime, runs in quality.items():
    seeds = [r["seed"] for r in runs]
    out.append(f"**{regime}** ({REGIME_TEXT.get(regime, regime)}), seeds {seeds}: the top max_o "
               f"units hold {_ms([r['concentration'] for r in runs], 2)} of sum_u e_u "
               f"({_ms([r['concentration_sq'] for r in runs], 2)} of sum e_u^2); consecutive "
               f"top sets overlap (Jaccard) {_ms([r['top_jaccard'] for r in runs], 2)}; most "
               f"often in the top set (steps, seed {runs[0]['seed']}): " + ", ".join(
                   f"`{n}` {c}" for n, c in runs[0]["top_units"]) + ".")
    rows = ["| controller | coverage of the top-max_o gap | precision | Spearman(signal, e_u) "
            "| recovered share |", "|---|---|---|---|---|"]
    names = list(dict.fromkeys(n for r in runs for n in r["controllers"]))  # runs may differ
    for name in names:
      vals = [r["controllers"][name] for r in runs if name in r["controllers"]]
      rows.append(f"| {LABELS.get(name, name)} | {_ms([v['coverage'] for v in vals], 2)} | "
                  f"{_ms([v['precision'] for v in vals], 2)} | "
                  f"{_ms([v['spearman'] for v in vals], 2)} | "
                  f"{_ms([v['recovered_share'] for v in vals], 3)} |")
    out.append("\n".join(rows))
  return "\n\n".join(out)


def pooled_closed(arms, name):
  """The gap closed over all seeds together: mean_s (L_low - L_arm) / mean_s (L_low - L_rec),
  over the seeds that have all three. Unlike the mean of per-seed shares it is not dominated by
  a seed whose static gap is close to zero."""
  low = {r["seed"]: r["eval_loss"] for r in arms.get("static_low", [])}
  rec = {r["seed"]: r["eval_loss"] for r in arms.get("static_rec", [])}
  mine = {r["seed"]: r["eval_loss"] for r in arms.get(name, [])}
  seeds = sorted(set(low) & set(rec) & set(mine))
  gap = float(np.mean([low[s] - rec[s] for s in seeds])) if seeds else 0.0
  if gap <= 0:
    return float("nan")
  return float(np.mean([low[s] - mine[s] for s in seeds])) / gap


def _mean_closed(arms, name):
  closed = closed_shares(arms, name)
  return float(np.mean(list(closed.values()))) if closed else float("nan")


def _before(old_arms, name, arms):
  """The arm's figures when every seed shared data seed 0, and how far 'closed' moved."""
  if old_arms is None or name not in old_arms:
    return "not run"
  loss = _ms([r["eval_loss"] for r in old_arms[name]])
  if name in ("static_low", "static_rec"):
    return loss
  old, new = _mean_closed(old_arms, name), _mean_closed(arms, name)
  if not np.isfinite(old):
    return loss
  old_pooled, new_pooled = pooled_closed(old_arms, name), pooled_closed(arms, name)
  return (f"{loss}; closed {old:.2f} ({new - old:+.2f}), pooled {old_pooled:.2f} "
          f"({new_pooled - old_pooled:+.2f})")


def e2e_table(arms, old_arms=None):
  rows = ["| arm | validation loss (nats) | gap closed, pooled over seeds | share of the gap closed "
          "(per seed) | recovered unit-steps | vs random (paired loss diff) | vs paper GNMR (paired loss diff) | before: one data "
          "order for every seed (closed: new - old) |",
          "|---|---|---|---|---|---|---|---|"]
  names = [n for n in ORDER if n in arms] + sorted(n for n in arms if n not in ORDER
                                                   and not n.endswith(PERTURB))
  for name in names:
    runs = arms[name]
    closed = closed_shares(arms, name)
    closed_txt = ("n/a" if not closed else f"{_ms(list(closed.values()), 2)} (n={len(closed)}: "
                  + ", ".join(f"{closed[s]:.2f}" for s in sorted(closed)) + ")")
    vs = []
    for other in ("random", "gnmr"):
      vs.append("" if name in (other, "static_low", "static_rec") or other not in arms
                else _fmt_pair(*paired(runs, arms[other])))
    label = LABELS.get(name, name)
    recovered = ("0 (static)" if name in ("static_low", "static_rec") else
                 _ms([r.get("recovered_unit_steps_pct") or 0 for r in runs], 1) + "%")
    pooled = pooled_closed(arms, name)
    rows.append(f"| {label} | {_ms([r['eval_loss'] for r in runs])} (n={len(runs)}) | "
                f"{pooled:.2f} | {closed_txt} | {recovered} | {vs[0]} | {vs[1]} | "
                f"{_before(old_arms, name, arms)} |")
  return "\n".join(rows)


# Paired comparisons that decide the refresh question of issue 18 and the tables of
# docs/guides/experiments.md.
PAIRS = (("gapuni_every50_from0", "gaprec_every50_from0"), ("gap_every50_from0",
         "gaprec_every50_from0"), ("gaprec_every50_from0", "norm"), ("gapuni_every50_from0",
         "norm"), ("hindsight", "norm"), ("norm", "random"), ("noise_every50_from0", "norm"),
         ("noise_every50_from0", "static_low"), ("noise_every50_from0", "lastblocks"),
         ("noise_every50_from0", "lateswitch"), ("lastblocks", "norm"), ("lateswitch", "norm"),
         ("hindsight", "noise_every50_from0"), ("noisenorm_every50_from0", "norm"),
         ("noisenorm_every50_from0", "lastblocks"), ("noisenorm_every50_from0", "lateswitch"),
         ("noisegate_every50_from0", "norm"), ("noisegate_every50_from0", "lastblocks"),
         ("noisegate_every50_from0", "lateswitch"), ("alarm", "norm"), ("alarm", "static_low"))


def comparisons(arms):
  """Paired per-seed loss differences of PAIRS, and how often each gap arm's mask changed."""
  lines = []
  for a, b in PAIRS:
    if a in arms and b in arms:
      lines.append(f"- {LABELS.get(a, a)} minus {LABELS.get(b, b)}: "
                   f"{_fmt_pair(*paired(arms[a], arms[b]))} nats")
  for name in ORDER:
    rows = [r for r in arms.get(name, []) if r.get("mask_changes")]
    if rows:
      lines.append(f"- {LABELS.get(name, name)}: the mask used at the measured steps changed "
                   + ", ".join(f"{r['mask_changes']['changes']}/"
                               f"{max(r['mask_changes']['measurements'] - 1, 0)}" for r in rows)
                   + " times between consecutive measurements (per seed)")
  return "\n".join(lines)


def noise_floor(arms):
  """Per '<arm>_perturb' arm: |L(perturbed init) - L(arm)| per seed, in nats and as a share of
  that seed's static gap (None when no perturbed arm ran)."""
  low = {r["seed"]: r["eval_loss"] for r in arms.get("static_low", [])}
  rec = {r["seed"]: r["eval_loss"] for r in arms.get("static_rec", [])}
  out = {}
  for name in arms:
    base = name[:-len(PERTURB)] if name.endswith(PERTURB) else None
    if base is None or base not in arms:
      continue
    plain = {r["seed"]: r["eval_loss"] for r in arms[base]}
    rows = [(r["seed"], abs(r["eval_loss"] - plain[r["seed"]]),
             abs(r["eval_loss"] - plain[r["seed"]]) / (low[r["seed"]] - rec[r["seed"]])
             if r["seed"] in low and r["seed"] in rec and low[r["seed"]] > rec[r["seed"]]
             else float("nan"))
            for r in arms[name] if r["seed"] in plain]
    if rows:
      out[base] = rows
  return out or None


def noise_floor_table(floor, perturbation):
  rows = [f"| arm | \\|L(init x (1 + {perturbation:g} z)) - L(init)\\| per seed (nats) | as a "
          "share of that seed's static gap | largest share |", "|---|---|---|---|"]
  worst = 0.0
  for name, runs in floor.items():
    shares = [sh for _, _, sh in runs]
    worst = max([worst] + [sh for sh in shares if np.isfinite(sh)])
    rows.append(f"| {LABELS.get(name, name)} | " + ", ".join(
        f"seed {sd}: {d:.4f}" for sd, d, _ in runs) + " | " + ", ".join(
            f"{sh:.2f}" for sh in shares) + f" | {np.nanmax(shares):.2f} |")
  return "\n".join(rows), worst


def goals(arms):
  """The selection issue's goal in tensor4, checked on the deployable controllers."""
  lines = []
  best, best_closed = None, -float("inf")
  for name in DEPLOYABLE:
    pooled = pooled_closed(arms, name) if name in arms else float("nan")
    if np.isfinite(pooled) and pooled > best_closed:
      best, best_closed = name, pooled
  if best is None:
    return "No deployable controller has finished runs yet."
  rec = float(np.mean([r["recovered_unit_steps_pct"] for r in arms[best]]))
  lines.append(f"Best deployable controller by the gap closed (pooled over seeds): **{best}** "
               f"({best_closed:.2f} of the gap closed, {rec:.1f}% of unit-steps recovered). "
               "It is picked on the same seeds it is then tested on (a winner's bias), and "
               "2 SE with n = 5 is a two-sided p of about 0.12 under a t-test, so the p values "
               "are given too.")
  checks = [("closes >= 50% of the gap", best_closed >= 0.5),
            ("recovers <= 15% of unit-steps", rec <= 15.0)]
  for other in ("random", "gnmr"):
    if other in arms:
      mean, se, n = paired(arms[best], arms[other])
      ok = n > 1 and np.isfinite(se) and mean < 0 and -mean >= 2 * se
      checks.append((f"beats {other} by >= 2 SE of the paired per-seed loss difference "
                     f"({_fmt_pair(mean, se, n)})", ok))
  lines.extend(f"- {'met' if ok else 'NOT met'}: {what}" for what, ok in checks)
  return "\n".join(lines)


def goals_noise(arms, name="noise_every50_from0"):
  """Issue 23's goal where the gap is persistent: at no more recovered unit-steps than 'norm',
  close at least as much of the gap as 'norm' (paired, within the noise floor or better)."""
  if name not in arms or "norm" not in arms:
    return f"`{name}` has not run in this regime yet."
  rec = {n: float(np.mean([r.get("recovered_unit_steps_pct") or 0 for r in arms[n]]))
         for n in (name, "norm")}
  mean, se, n = paired(arms[name], arms["norm"])
  # The floor of the two arms compared (the largest over every arm, which a gap controller's
  # chaos sets, let a controller closing 0.13 against 'norm''s 0.61 pass before 2026-12-02).
  # Within that floor is not enough when the paired seeds agree: a deficit of >= 2 SE over the
  # seeds is a result, not chaos (the floor is one perturbed run per seed; before 2026-12-03 an
  # arm 5.0 SE worse than 'norm' passed because its own floor was 0.0401 > 0.0397).
  floor = noise_floor(arms) or {}
  worst = max([d for arm in (name, "norm") for _, d, _ in floor.get(arm, [])],
              default=float("nan"))
  checks = [(f"recovers no more unit-steps than 'norm' ({rec[name]:.1f}% vs {rec['norm']:.1f}%)",
             rec[name] <= rec["norm"]),
            (f"closes at least as much of the gap as 'norm' (pooled {pooled_closed(arms, name):.2f}"
             f" vs {pooled_closed(arms, 'norm'):.2f}); paired loss difference {name} - norm "
             f"{_fmt_pair(mean, se, n)}, largest noise-floor difference of the two {worst:.4f} nats",
             n > 0 and (mean <= 0 or (np.isfinite(worst) and mean <= worst
                                      and not (np.isfinite(se) and mean >= 2 * se))))]
  return "\n".join(f"- {'met' if ok else 'NOT met'} ({name}): {what}" for what, ok in checks)


def _read(path):
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def section():
  """The markdown section (a 'not run yet' line when there are no results)."""
  data, previous = _read(RESULTS), _read(PREVIOUS)
  if data is None:
    return ("## Selection: which units to recover\n\nNot run yet. Run: "
            "`python experiments/selection.py --part quality --seeds 3` and "
            "`python experiments/selection.py --part e2e --seeds 5`, then "
            "`python experiments/report.py`.")
  base = data["base_config"]
  m, g = base["model"], base["gnmr"]
  out = ["## Selection: which units to recover",
         f"Generated from `experiments/results/selection_cpu.json` (`experiments/selection.py`; "
         f"method in its docstring). Measured {data['date']} on {data['device']}, jax "
         f"{data['versions']['jax']}, flax {data['versions']['flax']}, optax "
         f"{data['versions']['optax']}. Model d={m['d_model']}, {m['num_layers']} layers "
         f"(28 projection units), seq {base['data']['seq_len']}, batch "
         f"{base['data']['batch_size']}, {base['train']['steps']} steps, lr "
         f"{base['optimizer']['learning_rate']}; budget max_o {g['max_o']}, t_lock {g['t_lock']}, "
         f"warmup {g['warmup']} for every controller; paper thresholds alpha {g['alpha']}, beta "
         f"{g['beta']}, delta {g['delta']}. Commands: " + "; ".join(
             f"`{i['command']}` ({i['wall_seconds'] / 60:.0f} min)"
             for i in data.get("invocations", [])) + "."]
  out.append("Since issue 18 every seed trains on its own data order (`config.data.seed`; "
             "before, the prebuilt data of the experiments ignored it and every seed saw the "
             "batches of data seed 0, so seeds varied the initial params only). The column "
             "'before' gives each arm's figures from those runs "
             "(`experiments/results/selection_cpu_shared_data.json`"
             + (f", measured {previous['date']}" if previous else "") + ").")
  quality, quality_note = data.get("quality"), ""
  if not quality and previous and previous.get("quality"):
    quality = previous["quality"]
    quality_note = (" **Not re-run since issue 18: these replays come from static runs whose "
                    "seeds all trained on data seed 0** (`selection_cpu_shared_data.json`).")
  if quality:
    out.append("### Selection quality (static low-cost trajectory, every controller replayed)")
    out.append("Coverage: share of the oracle top-max_o units' gap e_u(t) that the mask used at "
               "step t holds; precision: |mask and top set| / max_o; Spearman between the signal "
               "the controller ranked by at t - 1 and e_u(t); all averaged over steps after "
               "warmup, then mean ± sd over seeds." + quality_note)
    out.append(quality_section(quality))
  if data.get("e2e"):
    out.append("### End to end at equal budget (each arm trained and evaluated in its own routing)")
    out.append("Arms with a measured gap (K = its period) measure on steps 1, 1 + K, ... unless "
               "labelled 'from step warmup + 1' (the library's default since "
               "`diagnostics.recovery_gap_start` exists). Share closed: per seed, "
               "(L_low - L_arm) / (L_low - L_rec), over the seeds where static recovery beats "
               "static low-cost.")
    old_e2e = (previous or {}).get("e2e", {})
    for regime, arms in data["e2e"].items():
      out.append(f"**{regime}**: {REGIME_TEXT.get(regime, regime)}.")
      out.append(e2e_table(arms, old_e2e.get(regime)))
      paired_lines = comparisons(arms)
      if paired_lines:
        out.append("Paired differences (negative: the first arm ends lower) and refreshes:\n\n"
                   + paired_lines)
      floor = noise_floor(arms)
      if floor:
        text, worst = noise_floor_table(floor, data.get("perturbation", 1e-7))
        out.append(f"Noise floor ({regime}): the same seed and data order with every initial "
                   f"param multiplied by 1 + {data.get('perturbation', 1e-7):g} z (z ~ N(0, 1), "
                   "about one float32 rounding), which changes nothing a user could choose. A "
                   f"difference between arms smaller than the largest share here "
                   f"({worst:.2f} of the static gap) can be chaos rather than a result.")
        out.append(text)
      if regime == "tensor4":
        out.append("Goals of the selection issue (tensor4):\n\n" + goals(arms))
        out.append("Goal of issue 23 where the gap is persistent (tensor4):\n\n"
                   + "\n".join(goals_noise(arms, n) for n in (
                       "noise_every50_from0", "noisenorm_every50_from0",
                       "noisegate_every50_from0", "alarm")))
    for regime, arms in old_e2e.items():
      if regime not in data["e2e"]:
        out.append(f"**{regime}** (not re-run since issue 18: every seed on data seed 0): "
                   f"{REGIME_TEXT.get(regime, regime)}.")
        out.append(e2e_table(arms))
  return "\n\n".join(out)
