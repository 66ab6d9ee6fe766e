"""Compile time and program size of the routed (unrolled) train step at each model config.

Routed policies unroll the layer scan (conditionals inside a rolled loop cost GPU step
time; ../shared/reference/gpu-anchors.md), which makes the program grow with the number
of layers. For each model config this compiles, without running, the fwd+bwd step of:
the static low-cost step in a rolled scan (the default static program), the same step
unrolled, and the GNMR-routed step (unrolled, per-unit conds). Columns: compile seconds
optimized HLO text size and XLA's temp memory; the ratios are routed over static rolled.
The configs from 1b up use model.remat='full': on XLA:CPU the unrolled programs keep what
remat should have recomputed (temp grows with the unrolled layers). Parameters are
shapes only, so large configs compile on a CPU (XLA:CPU's compile times, not a GPU's).

  python benchmarks/compile_cost.py                           # tiny,60m,1b
  python benchmarks/compile_cost.py --models 7b,13b --path fp8
"""
import argparse
import datetime
import os
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compile_stats, temp_mib  # noqa: E402
from benchmarks.model_step import init_params, make_step, mask_tree, policy_for  # noqa: E402
from gnmr_jax.model import UNITS_PER_LAYER  # noqa: E402
from gnmr_jax.model_configs import model_config  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="tiny,60m,1b")
  parser.add_argument("--path", default="int8", help="low-cost path")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=256)
  args = parser.parse_args()
  print(f"# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend "
        f"{jax.default_backend()}; path {args.path}; tokens/step {args.batch}x{args.seq}; "
        "compile only")
  print("model | layers | units | remat | static rolled s / kB / temp MiB | static unrolled "
        "s / kB / temp MiB | routed s / kB / temp MiB | routed/static_rolled compile | size | temp")
  for name in args.models.split(","):
    cfg = model_config(name)
    cfg.vocab_size = max(cfg.vocab_size, 256)
    layers = cfg.num_layers
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
    static = policy_for("static", args.path)
    model, _ = make_step(cfg, static)
    params = init_params(model, args.seq, abstract=True)
    mask = jax.eval_shape(lambda n=layers: mask_tree(n, 0))
    rows = {
        "static rolled": compile_stats(make_step(cfg, static, unroll=1)[1], params, tokens, None),
        "static unrolled": compile_stats(make_step(cfg, static, unroll=layers)[1], params,
                                         tokens, None),
        "routed": compile_stats(make_step(cfg, policy_for("gnmr", args.path))[1], params,
                                tokens, mask),
    }
    cells = " | ".join(f"{s:.1f} / {h / 1e3:.0f} / {temp_mib(c):.0f}" for c, s, h in rows.values())
    base, routed = rows["static rolled"], rows["routed"]
    print(f"{name} | {layers} | {UNITS_PER_LAYER * layers} | {cfg.remat} | {cells} | "
          f"{routed[1] / base[1]:.1f} | {routed[2] / base[2]:.1f} | "
          f"{temp_mib(routed[0]) / temp_mib(base[0]):.1f}")


if __name__ == "__main__":
  main()
