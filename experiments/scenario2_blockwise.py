"""Scenario 2: DeepSeek-V3-style fine-grained 6/8-bit mixed precision (paper claim 2).

    python experiments/scenario2_blockwise.py --scale cpu            # ~12 min, 2 cores
    python experiments/scenario2_blockwise.py --scale gpu            # 60M config, one GPU
    python experiments/scenario2_blockwise.py --scale gpu --dry_run  # build + 1 step here

Arms: bf16; fixed 8-bit fine-grained; fixed 6-bit fine-grained; GNMR 6/8 (units on
6-bit tiles, recovered units on 8-bit tiles). Activations are quantized in 1 x B
tiles and weights in B x B blocks in all three matmuls (gnmr_jax.precision.blockwise;
B = 128 at GPU scale as in DeepSeek-V3, B = 32 at CPU scale so that the d=128 model
still has several blocks per matrix). Global-norm clipping 1.0 in every arm (a
normal recipe, no stress). The blockwise path simulates the numerics by
quantize-dequantize in float32, so its step times do not show a speed gain.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # pylint: disable=g-import-not-at-top
from experiments import scenario1_saved_activation as scenario1

SCENARIO = "scenario2"


def base(scale: str, steps: int = 0):
  config = scenario1.base(scale, steps)
  config.precision.saved_activation_scale = "token"
  config.precision.saved_activation_forward = False
  config.precision.block_size = 32 if scale == "cpu" else 128
  return config


A = common.Arm
ARMS = [
    A("bf16", "bf16 (reference)", "reference", {"mode": "static", "low_cost_path": "bf16"},
      clip="global"),
    A("block8", "fixed 8-bit fine-grained", "static",
      {"mode": "static", "low_cost_path": "blockwise8"}, clip="global"),
    A("block6", "fixed 6-bit fine-grained", "static",
      {"mode": "static", "low_cost_path": "blockwise6"}, clip="global"),
    A("gnmr6_8", "GNMR 6/8", "gnmr",
      {"mode": "gnmr", "low_cost_path": "blockwise6", "recovery_path": "blockwise8"},
      clip="global"),
]
HEATMAP_ARM = "gnmr6_8"
NOTES = {
    "regime": "1 x B activation tiles and B x B weight blocks at 6 or 8 bits in forward, dlhs "
              "and drhs (quantize-dequantize, float32 products); global clip 1.0",
    "low_cost_arm": "block6",
}


def main(argv=None):
  return common.standard_main(argv, __doc__, SCENARIO, ARMS, base, HEATMAP_ARM, NOTES)


if __name__ == "__main__":
  main()
