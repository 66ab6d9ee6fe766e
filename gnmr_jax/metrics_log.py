"""Run logs a person can read: a progress bar, JSONL metrics, TensorBoard events, and per-unit
GNMR scores / recovery masks for the heatmap."""

from __future__ import annotations

import json
import os
import sys
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
            delta_gnmr: np.ndarray, norm: Optional[np.ndarray] = None):
    if not self.enabled:
      return
    row = {"step": step, "mask": np.asarray(mask, bool).astype(int).tolist(),
           "score": np.round(np.nan_to_num(score, posinf=1e30), 5).tolist(),
           "gnmr": np.round(np.nan_to_num(gnmr, posinf=1e30), 5).tolist(),
           "delta_gnmr": np.round(np.nan_to_num(delta_gnmr, posinf=1e30), 5).tolist()}
    if norm is not None:  # per-unit gradient norms (float32 values, 7 significant digits)
      row["norm"] = [float(f"{v:.7g}") for v in np.nan_to_num(norm, posinf=1e30, neginf=-1e30)]
    self._units.write(json.dumps(row) + "\n")
    self._units.flush()

  def recovery_gap(self, step: int, gap: np.ndarray, rec_norm: np.ndarray, mask_used: np.ndarray,
                   max_o: int):
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
