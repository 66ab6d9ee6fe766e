"""Run logs a person can read: a progress bar, JSONL metrics, TensorBoard events, and per-unit
GNMR scores / recovery masks for the heatmap."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
UNITS_FILE = "units.jsonl"
GAP_FILE = "recovery_gap.jsonl"
UNIT_NAMES_FILE = "unit_names.json"
SUMMARY_FILE = "summary.json"


def _jsonable(value):
  if isinstance(value, (np.floating, float)):
    return float(value)
  if isinstance(value, (np.integer, int)):
    return int(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  return value


class MetricsLogger:
  """Writes metrics of the process with index 0; a no-op elsewhere."""

  def __init__(self, workdir: str, total_steps: int, *, tensorboard: bool, progress_bar: bool,
               unit_names: Sequence[str], start_step: int = 0, enabled: bool = True):
    self.enabled = enabled
    self.workdir = workdir
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._metrics = open(os.path.join(workdir, METRICS_FILE), "a", encoding="utf-8")
    self._eval = open(os.path.join(workdir, EVAL_FILE), "a", encoding="utf-8")
    self._units = open(os.path.join(workdir, UNITS_FILE), "a", encoding="utf-8")
    self._gap = open(os.path.join(workdir, GAP_FILE), "a", encoding="utf-8")
    with open(os.path.join(workdir, UNIT_NAMES_FILE), "w", encoding="utf-8") as f:
      json.dump(list(unit_names), f)
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        print("tensorboardX is not installed: no TensorBoard events.", file=sys.stderr)
    self._bar = None
    if progress_bar:
      try:
        from tqdm import tqdm  # pylint: disable=g-import-not-at-top
        self._bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, file=sys.stderr)
      except ImportError:
        pass

  def train(self, step: int, metrics: dict):
    if not self.enabled:
      return
    row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
    self._metrics.write(json.dumps(row) + "\n")
    self._metrics.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(f"train/{k}", v, step)
    if self._bar is not None:
      self._bar.set_postfix(loss=f"{row.get('loss', float('nan')):.3f}",
                            rec=row.get("num_active", 0),
                            tok_s=f"{row.get('tokens_per_s', 0):.0f}",
                            step_s=f"{row.get('steps_per_s', 0):.2f}")

  def advance(self, step: int):
    if self.enabled and self._bar is not None:
      self._bar.n = step
      self._bar.refresh()

  def eval(self, step: int, metrics: dict):
    if not self.enabled:
      return
    row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
    self._eval.write(json.dumps(row) + "\n")
    self._eval.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step":
          self._tb.add_scalar(f"eval/{k}", v, step)
    msg = f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "step")
    if self._bar is not None:
      self._bar.write(msg)
    else:
      print(msg, file=sys.stderr)

  def units(self, step: int, mask: np.ndarray, score: np.ndarray, gnmr: np.ndarray,
            delta_gnmr: np.ndarray, norm: Optional[np.ndarray] = None,
            noise_fraction: Optional[np.ndarray] = None,
            saturation: Optional[np.ndarray] = None):
    if not self.enabled:
      return
    row = {"step": step, "mask": np.asarray(mask, bool).astype(int).tolist(),
           "score": np.round(np.nan_to_num(score, posinf=1e30), 5).tolist(),
           "gnmr": np.round(np.nan_to_num(gnmr, posinf=1e30), 5).tolist(),
           "delta_gnmr": np.round(np.nan_to_num(delta_gnmr, posinf=1e30), 5).tolist()}
    if norm is not None:  # per-unit gradient norms (float32 values, 7 significant digits)
      row["norm"] = [float(f"{v:.7g}") for v in np.nan_to_num(norm, posinf=1e30, neginf=-1e30)]
    if noise_fraction is not None:  # pi_u of the budgeted priorities (0 before a measurement)
      row["noise_fraction"] = [float(f"{v:.5g}") for v in np.nan_to_num(
          noise_fraction, nan=0.0, posinf=1e30)]
    if saturation is not None:  # delayed scaling: amax over the scale's range (> 1: saturated;
      # 9 significant digits round-trip float32, so a ratio a hair over 1 stays over 1)
      row["saturation"] = [float(f"{v:.9g}") for v in np.nan_to_num(saturation, posinf=1e30)]
    self._units.write(json.dumps(row) + "\n")
    self._units.flush()

  def recovery_gap(self, step: int, gap: np.ndarray, rec_norm: np.ndarray, mask_used: np.ndarray,
                   max_o: int, signal_sq: Optional[np.ndarray] = None,
                   sampling_sq: Optional[np.ndarray] = None):
    """One measured step of the recovery-gap instrument (gnmr_jax/recovery_gap.py)."""
    if not self.enabled:
      return
    from gnmr_jax.control.recovery_gap import summarize  # pylint: disable=g-import-not-at-top
    gap = np.nan_to_num(np.asarray(gap, np.float64), nan=0.0, posinf=1e30)
    rec_norm = np.asarray(rec_norm, np.float64)
    rel = np.where(rec_norm > 0, gap / np.where(rec_norm > 0, rec_norm, 1.0),
                   np.where(gap > 0, 1e30, 0.0))
    row = {"step": step, "gap": [float(f"{v:.7g}") for v in gap],
           "gap_rel": [float(f"{v:.7g}") for v in rel],
           "mask": np.asarray(mask_used, bool).astype(int).tolist(),
           **summarize(gap, mask_used, max_o)}
    if signal_sq is not None:  # split halves: <g_a, g_b> and ||g_a - g_b||^2 / 4 per unit
      row["signal_sq"] = [float(f"{v:.7g}") for v in np.nan_to_num(signal_sq, posinf=1e30)]
      row["sampling_sq"] = [float(f"{v:.7g}") for v in np.nan_to_num(sampling_sq, posinf=1e30)]
    self._gap.write(json.dumps(row) + "\n")
    self._gap.flush()

  def summary(self, summary: dict):
    if not self.enabled:
      return
    with open(os.path.join(self.workdir, SUMMARY_FILE), "w", encoding="utf-8") as f:
      json.dump({k: _jsonable(v) for k, v in summary.items()}, f, indent=2)

  def close(self):
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    for f in (self._metrics, self._eval, self._units, self._gap):
      f.close()


class StepStats:
  """The loop's host-side bookkeeping of each step's metrics (fetched one step late).

  Counts consecutive non-finite steps and side-buffer overflows, times the steps between log
  lines (the first interval, which includes compilation, is not timed), and writes the train,
  per-unit and recovery-gap rows of a :class:`MetricsLogger`.
  """

  def __init__(self, log: MetricsLogger, *, start: int, total: int, tokens_per_step: int,
               log_every: int, unit_log_every: int, max_o: int):
    self.log, self.start, self.total = log, start, total
    self.tokens_per_step = tokens_per_step
    self.log_every, self.unit_log_every, self.max_o = log_every, unit_log_every, max_o
    self.bad_streak = 0         # consecutive steps with a non-finite loss or gradient
    self.dropped_total = 0      # recoveries the side buffer had no room for
    self.timed_steps, self.timed_seconds = 0, 0.0
    # delayed scaling: unit-steps this process observed, and how many of them saturated
    self.saturation_unit_steps, self.saturated_unit_steps = 0, 0
    self.last = None            # host metrics of the last observed step
    self.restart_timer()

  def restart_timer(self) -> None:
    """Starts a new timed interval (after an evaluation, which is not a step's time)."""
    self._t_last, self._steps_since_log = time.perf_counter(), 0

  @property
  def tokens_per_s(self) -> float:
    if not self.timed_seconds:
      return float("nan")
    return self.timed_steps * self.tokens_per_step / self.timed_seconds

  def observe(self, step: int, metrics: dict) -> dict:
    """Fetches one step's device metrics, updates the counts and writes its log rows."""
    import jax  # pylint: disable=g-import-not-at-top
    host = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
    self.bad_streak = self.bad_streak + 1 if bool(host["nonfinite"]) else 0
    self.dropped_total += int(host["side_buffer_dropped"])
    self._steps_since_log += 1
    if "unit_saturation" in host:
      self.saturation_unit_steps += host["unit_saturation"].size
      self.saturated_unit_steps += int(np.sum(host["unit_saturation"] > 1))
    if step % self.log_every == 0 or step == self.total:
      now = time.perf_counter()
      dt = (now - self._t_last) / self._steps_since_log
      if step > self.start + 1:  # the first interval includes compilation
        self.timed_steps += self._steps_since_log
        self.timed_seconds += now - self._t_last
      self._t_last, self._steps_since_log = now, 0
      scalars = {k: float(v) if v.dtype.kind == "f" else int(v) for k, v in host.items()
                 if v.ndim == 0}
      scalars.update(steps_per_s=1.0 / max(dt, 1e-9),
                     tokens_per_s=self.tokens_per_step / max(dt, 1e-9))
      self.log.train(step, scalars)
    every = self.unit_log_every
    if every and "unit_mask_used" in host and (step % every == 0 or step == self.total):
      self.log.units(step, host["unit_mask_used"], host["unit_score"], host["unit_gnmr"],
                     host["unit_delta_gnmr"], host["unit_norm"],
                     host.get("unit_noise_fraction"), host.get("unit_saturation"))
    if "gap_measured" in host and bool(host["gap_measured"]):
      self.log.recovery_gap(step, host["unit_gap"], host["unit_gap_rec_norm"],
                            host["unit_mask_used"], self.max_o, host.get("unit_gap_signal_sq"),
                            host.get("unit_gap_sampling_sq"))
    self.log.advance(step)
    self.last = host
    return host


def truncate_logs(workdir: str, start: int) -> None:
  """Drops JSONL rows after the step a run resumes from (a killed run logged steps past its last
  checkpoint, possibly a half-written line), so the logs read as one uninterrupted run."""
  for name in (METRICS_FILE, EVAL_FILE, UNITS_FILE, GAP_FILE):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      continue
    kept = []
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:  # a line cut short by SIGKILL
          continue
        if isinstance(row, dict) and row.get("step", start + 1) <= start:
          kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(path + ".tmp", path)


def read_jsonl(path: str) -> list[dict]:
  """Rows of a JSONL file; the latest row wins per step (resumed runs append)."""
  if not os.path.exists(path):
    return []
  by_step = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line:
        row = json.loads(line)
        by_step[row["step"]] = row
  return [by_step[s] for s in sorted(by_step)]


def flat_unit_names(mask_tree) -> list[str]:
  """Names of the units in controller flattening order ('path[l]' for layer-stacked leaves)."""
  import jax  # pylint: disable=g-import-not-at-top
  from gnmr_jax.control.units import path_to_str  # pylint: disable=g-import-not-at-top
  names = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(mask_tree)[0]:
    name = path_to_str(path)
    shape = np.shape(leaf)
    names.extend([f"{name}[{i}]" for i in range(shape[0])] if shape else [name])
  return names


def flat_units(tree, unit_leaf_flags: Optional[Sequence[bool]] = None) -> np.ndarray:
  """Concatenates the leaves of a per-unit tree (host numpy)."""
  import jax  # pylint: disable=g-import-not-at-top
  leaves = jax.tree_util.tree_leaves(tree)
  if unit_leaf_flags is not None:
    leaves = [l for l, keep in zip(leaves, unit_leaf_flags) if keep]
  return np.concatenate([np.ravel(np.asarray(l)) for l in leaves]) if leaves else np.zeros(0)


def format_summary(summary: dict) -> str:
  """The human summary printed at the end of train.py."""
  lines = [f"run summary ({summary['workdir']})",
           f"  steps                     {summary['step']}" +
           ("  (preempted: checkpoint saved)" if summary.get("preempted") else ""),
           f"  precision                 {summary['precision_mode']} / {summary['low_cost_path']}",
           *([f"  resumed from step         {summary['resumed_from_step']}"]
             if summary.get("resumed_from_step") else []),
           *[f"  corrupted checkpoint      step {s} skipped ({r[:120]})"
             for s, r in summary.get("corrupted_checkpoints", [])],
           f"  parameters                {summary['num_params']:,}"]
  if "eval_perplexity" in summary:
    lines.append(f"  validation perplexity     {summary['eval_perplexity']:.3f} "
                 f"(loss {summary['eval_loss']:.4f} nats/token; unigram baseline "
                 f"{summary['unigram_perplexity']:.2f})")
  if "recovered_unit_steps_pct" in summary:
    # In a static mode the controller only measures: nothing ran on the recovery path.
    label = ("recovered unit-steps     " if summary["precision_mode"] == "gnmr"
             else "would-recover unit-steps ")
    lines.append(f"  {label} {summary['recovered_unit_steps_pct']:.3f}% of "
                 f"{summary['num_units']} units x {summary['step']} steps "
                 f"(threshold exceedance {summary['threshold_exceedance_pct']:.3f}%)")
  if "saturated_per_1000_unit_steps" in summary:
    lines.append(f"  saturated unit-steps      {summary['saturated_per_1000_unit_steps']:.2f} per "
                 f"1000 (delayed scaling: codes clipped at the scale's range)")
  lines.append(f"  tokens/s                  {summary['tokens_per_s']:.0f}")
  if summary.get("side_buffer_dropped"):
    lines.append(f"  WARNING: {summary['side_buffer_dropped']} recoveries found the side buffer full "
                 "and ran the low-cost path (precision.side_buffer_units < recovered units)")
  for name, path in (summary.get("plots") or {}).items():
    lines.append(f"  plot {name:20s} {path}")
  return "\n".join(lines)
