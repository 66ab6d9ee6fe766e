"""Plots of a run directory: loss curves and the recovery heatmap (units x steps), as PNG;
with delayed scaling, each unit's saturation beside the recovery mask.

A run directory holds metrics.jsonl, eval.jsonl, units.jsonl, unit_names.json and, when the
recovery gap is measured, recovery_gap.jsonl as
written by ``gnmr_jax.metrics_log.MetricsLogger`` (train_and_evaluate writes them).

Example:
  >>> import os, tempfile
  >>> from gnmr_jax import metrics_log
  >>> workdir = tempfile.mkdtemp()
  >>> log = metrics_log.MetricsLogger(workdir, 2, tensorboard=False, progress_bar=False,
  ...                                 unit_names=['attn/q[0]', 'attn/q[1]'])
  >>> for step, loss in ((1, 3.0), (2, 2.5)):
  ...   log.train(step, {'loss': loss})
  ...   log.units(step, mask=[step == 2, False], score=[1.5 * step, 0.4],
  ...             gnmr=[2.0, 0.5], delta_gnmr=[1.0, 1.0], noise_fraction=[0.5, 0.01],
  ...             saturation=[0.5, 2.0 if step == 1 else 0.25])
  >>> log.recovery_gap(2, gap=[0.3, 0.1], rec_norm=[1.0, 2.0], mask_used=[True, False], max_o=1)
  >>> log.close()
  >>> names, steps, mask = recovery_matrix(workdir, 'mask')
  >>> names, steps, mask.tolist()
  (['attn/q[0]', 'attn/q[1]'], [1, 2], [[0.0, 1.0], [0.0, 0.0]])
  >>> recovery_matrix(workdir, 'gap_rel', metrics_log.GAP_FILE)[2].tolist()
  [[0.3], [0.05]]
  >>> recovery_matrix(workdir, 'saturation')[2].tolist()  # delayed scaling: > 1 saturated
  [[0.5, 0.5], [2.0, 0.25]]
  >>> sorted(plot_run(workdir))  # doctest: +NORMALIZE_WHITESPACE
  ['gap_heatmap', 'gap_summary', 'loss', 'noise_heatmap', 'recovery_heatmap',
   'saturation_heatmap', 'score_heatmap']
  >>> os.path.getsize(os.path.join(workdir, 'plots', 'recovery_heatmap.png')) > 1000
  True
"""

from __future__ import annotations

import json
import os

import numpy as np

from gnmr_jax import metrics_log


def _figure(figsize):
  """A matplotlib Figure drawn off-screen, without touching pyplot's backend (notebooks)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  return Figure(figsize=figsize)


def plot_losses(runs: dict, path: str, title: str = "loss") -> str:
  """Train (thin) and validation (markers) loss per run label -> PNG at `path`.

  Args:
    runs: ``{label: workdir}``; one colour per run (e.g. GNMR and the static run).
    path: where the PNG goes.
    title: the axes title.

  Returns:
    ``path``.

  Example:
    >>> import json, os, tempfile
    >>> workdir = tempfile.mkdtemp()
    >>> with open(os.path.join(workdir, metrics_log.METRICS_FILE), 'w') as f:
    ...   _ = f.write('\\n'.join(json.dumps({'step': s, 'loss': 3.0 / s}) for s in (1, 2, 3)))
    >>> out = plot_losses({'gnmr': workdir}, os.path.join(workdir, 'loss.png'))
    >>> os.path.getsize(out) > 1000
    True
  """
  fig = _figure((7, 4))
  ax = fig.subplots()
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
  return path


def recovery_matrix(workdir: str, field: str = "mask", source: str = metrics_log.UNITS_FILE):
  """(unit names, steps, [units, steps] matrix) from <workdir>/units.jsonl.

  Args:
    workdir: a run directory.
    field: 'mask' (1.0 = on the recovery path that step), 'score' (risk score r),
      'gnmr', 'delta_gnmr', 'norm' or 'noise_fraction' (pi_u); with
      ``source=metrics_log.GAP_FILE``: 'gap' (recovery gap e_u), 'gap_rel' (e_u / ||g_rec,u||),
      'signal_sq' or 'sampling_sq' (split halves).
    source: the JSONL file of the run directory to read.

  Returns:
    (list of unit names, list of logged steps, float64 [units, steps] array).

  Example:
    >>> import tempfile
    >>> names, steps, matrix = recovery_matrix(tempfile.mkdtemp(), 'score')
    >>> names, steps, matrix.shape
    ([], [], (0, 0))
  """
  rows = metrics_log.read_jsonl(os.path.join(workdir, source))
  names_path = os.path.join(workdir, metrics_log.UNIT_NAMES_FILE)
  names = json.load(open(names_path, encoding="utf-8")) if os.path.exists(names_path) else []
  if not rows:
    return names, [], np.zeros((len(names), 0))
  steps = [r["step"] for r in rows]
  return names, steps, np.asarray([r[field] for r in rows], np.float64).T


def plot_recovery_heatmap(workdir: str, path: str, field: str = "mask",
                          source: str = metrics_log.UNITS_FILE) -> str:
  """Heatmap of the recovery mask (or a score or gap field) over units x logged steps.

  ``field='mask'``: dark = on the recovery path; other fields are drawn as
  log10 (clipped to [1e-3, 1e3]), so for 'score' log10 r > 0 means risky.
  Returns ``path`` (see the module docstring for an example).
  """
  names, steps, matrix = recovery_matrix(workdir, field, source)
  fig = _figure((9, max(3, 0.12 * len(names) + 1)))
  ax = fig.subplots()
  if matrix.size:
    extent = (steps[0], steps[-1], len(names) - 0.5, -0.5)
    data = matrix if field == "mask" else np.log10(np.clip(matrix, 1e-3, 1e3))
    im = ax.imshow(data, aspect="auto", interpolation="nearest", extent=extent,
                   cmap="Greys" if field == "mask" else "viridis")
    fig.colorbar(im, ax=ax, label="recovered" if field == "mask" else f"log10 {field}")
  ax.set_yticks(range(len(names)))
  ax.set_yticklabels([n.replace("layers/", "").replace("/kernel", "") for n in names], fontsize=5)
  ax.set_xlabel("step")
  what = "recovery" if source == metrics_log.GAP_FILE else "GNMR"
  ax.set_title(f"{what} {field} per unit ({os.path.basename(workdir.rstrip('/'))})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_saturation_beside_recovery(workdir: str, path: str) -> str:
  """Delayed scaling: each unit's saturation (amax over its scale's range, above 1 its codes
  clipped; units.jsonl 'saturation') over the logged steps, beside the recovery mask of the same
  steps, so a reader sees which saturations the mask covered. Returns ``path``."""
  names, steps, mask = recovery_matrix(workdir, "mask")
  _, _, saturation = recovery_matrix(workdir, "saturation")
  fig = _figure((13, max(3, 0.12 * len(names) + 1)))
  axes = fig.subplots(1, 2, sharey=True)
  if mask.size:
    extent = (steps[0], steps[-1], len(names) - 0.5, -0.5)
    im = axes[0].imshow(mask, aspect="auto", interpolation="nearest", extent=extent, cmap="Greys")
    fig.colorbar(im, ax=axes[0], label="recovered")
    im = axes[1].imshow(np.clip(saturation, 0.0, 2.0), aspect="auto", interpolation="nearest",
                        extent=extent, cmap="magma", vmin=0.0, vmax=2.0)
    fig.colorbar(im, ax=axes[1], label="amax / range (> 1: saturated)")
  axes[0].set_yticks(range(len(names)))
  axes[0].set_yticklabels([n.replace("layers/", "").replace("/kernel", "") for n in names],
                          fontsize=5)
  for ax, title in zip(axes, ("recovery mask", "saturation")):
    ax.set_xlabel("step")
    ax.set_title(f"{title} per unit ({os.path.basename(workdir.rstrip('/'))})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_gap_summary(workdir: str, path: str) -> str:
  """Per measured step: the top-max_o share of the recovery gap (concentration) and the share
  of the top-max_o gap that the mask used at that step covers (coverage). Returns ``path``."""
  rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.GAP_FILE))
  fig = _figure((7, 3.2))
  ax = fig.subplots()
  steps = [r["step"] for r in rows]
  for key, label in (("concentration", "top-max_o share of sum e_u"),
                     ("coverage", "share of the top-max_o gap in the mask used")):
    ax.plot(steps, [r.get(key, np.nan) for r in rows], marker=".", lw=1, label=label)
  ax.set_ylim(0, 1.02)
  ax.set_xlabel("step")
  ax.legend(fontsize=7)
  ax.set_title(f"recovery gap ({os.path.basename(workdir.rstrip('/'))})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_run(workdir: str) -> dict:
  """Writes <workdir>/plots/{loss,recovery_heatmap,score_heatmap}.png; returns their paths.

  The heatmaps are drawn only when units.jsonl exists (the controller is enabled
  and ``logging.unit_log_every > 0``); gap_heatmap.png and gap_summary.png only when
  the recovery gap was measured (``diagnostics.recovery_gap_every > 0``), and then
  noise_heatmap.png, the noise fraction pi_u over training, when units.jsonl logs it (a
  budgeted priority); saturation_heatmap.png (delayed scaling's saturation beside the recovery
  mask) when units.jsonl logs saturation. See the module docstring for an example.
  """
  out = os.path.join(workdir, "plots")
  os.makedirs(out, exist_ok=True)
  paths = {"loss": plot_losses({"run": workdir}, os.path.join(out, "loss.png"))}
  if os.path.exists(os.path.join(workdir, metrics_log.UNITS_FILE)):
    paths["recovery_heatmap"] = plot_recovery_heatmap(
        workdir, os.path.join(out, "recovery_heatmap.png"), "mask")
    paths["score_heatmap"] = plot_recovery_heatmap(
        workdir, os.path.join(out, "score_heatmap.png"), "score")
    last = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))[-1:]
    if last and "saturation" in last[0]:  # delayed scaling
      paths["saturation_heatmap"] = plot_saturation_beside_recovery(
          workdir, os.path.join(out, "saturation_heatmap.png"))
  gap_file = os.path.join(workdir, metrics_log.GAP_FILE)
  if os.path.exists(gap_file) and os.path.getsize(gap_file):
    paths["gap_heatmap"] = plot_recovery_heatmap(
        workdir, os.path.join(out, "gap_heatmap.png"), "gap", metrics_log.GAP_FILE)
    paths["gap_summary"] = plot_gap_summary(workdir, os.path.join(out, "gap_summary.png"))
    units = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))
    if units and "noise_fraction" in units[-1]:  # pi_u of a budgeted priority's measurements
      paths["noise_heatmap"] = plot_recovery_heatmap(
          workdir, os.path.join(out, "noise_heatmap.png"), "noise_fraction")
  return paths
