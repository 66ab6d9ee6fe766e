"""Plots of a run directory: loss curves and the recovery heatmap (units x steps), as PNG."""

from __future__ import annotations

import json
import os

import numpy as np

from gnmr_jax import metrics_log


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plot_losses(runs: dict, path: str, title: str = "loss") -> str:
  """Train (thin) and validation (markers) loss per run label -> PNG at `path`."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, (label, workdir) in enumerate(runs.items()):
    color = f"C{i}"
    train = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.METRICS_FILE))
    evals = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.EVAL_FILE))
    if train:
      ax.plot([r["step"] for r in train], [r["loss"] for r in train], color=color, alpha=0.5,
              lw=1, label=f"{label} train")
    if evals:
      ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", color=color,
              label=f"{label} validation")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title(title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def recovery_matrix(workdir: str, field: str = "mask"):
  """(unit names, steps, [units, steps] matrix) from <workdir>/units.jsonl."""
  rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))
  names_path = os.path.join(workdir, metrics_log.UNIT_NAMES_FILE)
  names = json.load(open(names_path, encoding="utf-8")) if os.path.exists(names_path) else []
  if not rows:
    return names, [], np.zeros((len(names), 0))
  steps = [r["step"] for r in rows]
  return names, steps, np.asarray([r[field] for r in rows], np.float64).T


def plot_recovery_heatmap(workdir: str, path: str, field: str = "mask") -> str:
  """Heatmap of the recovery mask (or a score field) over units x logged steps."""
  plt = _pyplot()
  names, steps, matrix = recovery_matrix(workdir, field)
  fig, ax = plt.subplots(figsize=(9, max(3, 0.12 * len(names) + 1)))
  if matrix.size:
    extent = (steps[0], steps[-1], len(names) - 0.5, -0.5)
    data = matrix if field == "mask" else np.log10(np.clip(matrix, 1e-3, 1e3))
    im = ax.imshow(data, aspect="auto", interpolation="nearest", extent=extent,
                   cmap="Greys" if field == "mask" else "viridis")
    fig.colorbar(im, ax=ax, label="recovered" if field == "mask" else f"log10 {field}")
  ax.set_yticks(range(len(names)))
  ax.set_yticklabels([n.replace("layers/", "").replace("/kernel", "") for n in names], fontsize=5)
  ax.set_xlabel("step")
  ax.set_title(f"GNMR {field} per unit ({os.path.basename(workdir.rstrip('/'))})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_run(workdir: str) -> dict:
  """Writes <workdir>/plots/{loss,recovery_heatmap,score_heatmap}.png; returns their paths."""
  out = os.path.join(workdir, "plots")
  os.makedirs(out, exist_ok=True)
  paths = {"loss": plot_losses({"run": workdir}, os.path.join(out, "loss.png"))}
  if os.path.exists(os.path.join(workdir, metrics_log.UNITS_FILE)):
    paths["recovery_heatmap"] = plot_recovery_heatmap(
        workdir, os.path.join(out, "recovery_heatmap.png"), "mask")
    paths["score_heatmap"] = plot_recovery_heatmap(
        workdir, os.path.join(out, "score_heatmap.png"), "score")
  return paths
