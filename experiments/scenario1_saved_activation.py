"""Scenario 1: the saved-activation stress test (paper claim 1), every arm x seeds.

    python experiments/scenario1_saved_activation.py --scale cpu            # ~30-40 min, 2 cores
    python experiments/scenario1_saved_activation.py --scale gpu            # 60M config, one GPU
    python experiments/scenario1_saved_activation.py --scale gpu --dry_run  # build + 1 step here

Stress regime (both scales): every projection stores its input activation at k bits
with ONE absmax scale per tensor, and the forward also uses that k-bit activation
(precision.saved_activation_scale='tensor', saved_activation_forward=True). The
paper's literal stress (per-token scale, weight gradient only) is nearly harmless
at CPU scale (/work/shared/reference/stress-calibration.md), so there would be
nothing to recover; this regime lets the error reach the loss and the input
gradient and compound across layers. Recovered units run the same regime at 8
bits. No gradient clipping in the base optimizer, so that the clipping
baselines are each measured against the same unclipped static path.

Arms: bf16 reference, static 8-bit, static 4-bit, GNMR 4/8, and the harsher
static 2-bit and GNMR 2/8, then on the 2-bit path: same-budget random recovery,
GNMR score only (beta huge), dGNMR only (alpha huge), no lock (t_lock=0), max_o 2,
8 and 28 (all units of the CPU model: no budget), and the static 2-bit path with global clipping, ZClip and AdaGC, and GNMR 2/8
with global clipping (does recovery add to clipping?); last, the
paper's literal stress (static 4-bit, per-token scale, weight gradient only) and
the same at 2 bits.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # pylint: disable=g-import-not-at-top
from gnmr_jax.config import base_config
from gnmr_jax.model_configs import model_config

SCENARIO = "scenario1"
HUGE = 1e9  # a threshold that is never exceeded: switches one GNMR signal off


def base(scale: str, steps: int = 0):
  """The base config of a scale (precision/optimizer fields common to every arm)."""
  if scale == "cpu":
    config = base_config("tiny")
    m = config.model
    m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_dim = 128, 4, 4, 4, 344
    config.data.seq_len, config.data.batch_size = 64, 16
    config.train.steps, config.train.eval_every = 200, 50
    config.optimizer.warmup_steps = 20
  else:
    config = base_config("60m")
    config.model = model_config("60m")
    config.data.seq_len, config.data.batch_size = 256, 64
    config.train.steps, config.train.eval_every = 400, 100
    config.optimizer.warmup_steps = 40
  config.data.tokenizer = "bytes"
  config.data.num_eval_batches = 8
  config.optimizer.learning_rate = 3e-3
  config.optimizer.grad_clip = 0.0  # arms add their own clipping (Arm.clip)
  config.gnmr.warmup = 20
  # The paper's controller (these scenarios reproduce the paper) at the paper's thresholds, pinned
  # (common.EXPERIMENT_CONTROLLER); static arms measure with it.
  config.gnmr.update(common.EXPERIMENT_CONTROLLER, priority="gnmr")
  config.diagnostics.recovery_gap_every = 0
  config.precision.mode = "static"
  config.precision.saved_activation_scale = "tensor"
  config.precision.saved_activation_forward = True
  config.checkpoint.every_steps = 0
  config.logging.log_every = 10
  config.logging.unit_log_every = 5
  config.logging.tensorboard = False
  config.logging.progress_bar = False
  config.logging.plots = False
  if steps:
    config.train.steps = steps
    config.train.eval_every = max(steps // 4, 1)
  return config


def _static(bits):
  return {"mode": "static", "low_cost_path": "saved_activation", "saved_activation_bits": bits}


def _gnmr(bits):
  return {"mode": "gnmr", "low_cost_path": "saved_activation",
          "recovery_path": "saved_activation", "saved_activation_bits": bits,
          "recovery_saved_activation_bits": 8}


HARSH = 2  # bits of the harsher stress the baselines and ablations run on
A = common.Arm
ARMS = [
    A("bf16", "bf16 (reference)", "reference", {"mode": "static", "low_cost_path": "bf16"}),
    A("static8", "static 8-bit", "static", _static(8)),
    A("static4", "static 4-bit", "static", _static(4)),
    A("gnmr4_8", "GNMR 4/8", "gnmr", _gnmr(4)),
    A("static2", f"static {HARSH}-bit (harsher)", "static", _static(HARSH)),
    A("gnmr2_8", f"GNMR {HARSH}/8 (harsher)", "gnmr", _gnmr(HARSH)),
    A("random2_8", f"random recovery {HARSH}/8, same budget (max_o 4)", "baseline",
      _gnmr(HARSH), controller="random"),
    A("gnmr2_8_score_only", f"GNMR {HARSH}/8, GNMR score only (beta=1e9)", "ablation",
      _gnmr(HARSH), gnmr={"beta": HUGE}),
    A("gnmr2_8_delta_only", f"GNMR {HARSH}/8, dGNMR only (alpha=1e9)", "ablation",
      _gnmr(HARSH), gnmr={"alpha": HUGE}),
    A("gnmr2_8_no_lock", f"GNMR {HARSH}/8, no lock (t_lock=0)", "ablation",
      _gnmr(HARSH), gnmr={"t_lock": 0}),
    A("gnmr2_8_max_o2", f"GNMR {HARSH}/8, max_o 2", "ablation", _gnmr(HARSH),
      gnmr={"max_o": 2}),
    A("gnmr2_8_max_o8", f"GNMR {HARSH}/8, max_o 8", "ablation", _gnmr(HARSH),
      gnmr={"max_o": 8}),
    A("gnmr2_8_max_o28", f"GNMR {HARSH}/8, max_o 28 (no budget: every flagged unit)",
      "ablation", _gnmr(HARSH), gnmr={"max_o": 28}),
    A("static2_global_clip", f"static {HARSH}-bit + global clip 1.0", "baseline",
      _static(HARSH), clip="global", clip_value=1.0),
    A("static2_zclip", f"static {HARSH}-bit + ZClip (z=2.5)", "baseline", _static(HARSH),
      clip="zclip"),
    A("static2_adagc", f"static {HARSH}-bit + AdaGC (ratio 1.05)", "baseline", _static(HARSH),
      clip="adagc"),
    A("gnmr2_8_global_clip", f"GNMR {HARSH}/8 + global clip 1.0", "ablation", _gnmr(HARSH),
      clip="global", clip_value=1.0),
    # The paper's literal stress: per-token scales, only the weight gradient sees the k bits.
    A("static4_paper", "static 4-bit, per-token scale, weight gradient only (paper's stress)",
      "static", dict(_static(4), saved_activation_scale="token", saved_activation_forward=False)),
    A("static2_paper", "static 2-bit, per-token scale, weight gradient only", "static",
      dict(_static(2), saved_activation_scale="token", saved_activation_forward=False)),
]
HEATMAP_ARM = "gnmr2_8"
NOTES = {
    "regime": "saved activations at k bits with one absmax scale per tensor, also used by the "
              "forward (precision.saved_activation_scale='tensor', saved_activation_forward=True); "
              "recovered units use 8 bits in the same regime; no clipping unless the arm adds it",
    "why": "the paper's literal stress (per-token scale, weight gradient only) is nearly harmless "
           "at this scale (arm static4_paper; /work/shared/reference/stress-calibration.md), so "
           "there is nothing to recover; one scale per tensor lets outlier tokens flatten the "
           "others, and quantizing the forward input too lets the error reach the loss and the "
           "input gradient. This stress degrades every unit at once; it does not produce the "
           "isolated gradient spikes in a few units that a top-max_o recovery is built for, so "
           "read the results with that in mind",
    "low_cost_arm": "static4",
    "harsh_low_cost_arm": "static2",
}


def main(argv=None):
  return common.standard_main(argv, __doc__, SCENARIO, ARMS, base, HEATMAP_ARM, NOTES)


if __name__ == "__main__":
  main()
