"""Compile time of the routed Transformer's init: the layer scan unrolled vs rolled.

A routed policy unrolls the layer scan (`scan_unroll = num_layers`), and Flax's `init` runs the
forward pass, so `model.init` of the routed model compiles every layer's forward and param
initializers. `sharding.init_unboxed` (what `train_loop.build` and `sharding.init_params` use)
initialises through `model.for_init`, the same model with its scan rolled: the same params bit
for bit (tests/test_model.py) from a program of one layer. Columns per model config: compile
seconds and optimized HLO size of both programs, compiled on abstract inputs (nothing runs), in
one interleaved run; the ratio is unrolled over rolled.

  python benchmarks/init_compile.py
  python benchmarks/init_compile.py --models tiny,60m --repeats 3
"""
import argparse
import datetime
import os
import platform
import statistics
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compile_stats  # noqa: E402
from benchmarks.model_step import policy_for  # noqa: E402
from gnmr_jax import sharding  # noqa: E402
from gnmr_jax.model import Transformer  # noqa: E402
from gnmr_jax.model_configs import model_config  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="tiny,60m,1b")
  parser.add_argument("--path", default="int8", help="low-cost path of the routed policy")
  parser.add_argument("--seq", type=int, default=8, help="tokens the init's forward sees")
  parser.add_argument("--repeats", type=int, default=1)
  args = parser.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  print(f"# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend "
        f"{jax.default_backend()}; routed {args.path}/bf16 Transformer init, 1x{args.seq} "
        f"tokens, compile only; median of {args.repeats}, interleaved")
  print("model | layers | unrolled s / kB | rolled (for_init) s / kB | unrolled/rolled s | kB")
  key = jax.eval_shape(lambda: jax.random.key(0))
  tokens = jnp.zeros((1, args.seq), jnp.int32)
  for name in args.models.split(","):
    cfg = model_config(name)
    cfg.scan_unroll = cfg.num_layers  # what train_loop.build sets for a routed policy
    model = Transformer(cfg, policy_for("gnmr", args.path))
    programs = {
        "unrolled": jax.jit(lambda k, m=model: nn.unbox(m.init(k, tokens)["params"])),
        "rolled": jax.jit(lambda k, m=model: sharding.init_unboxed(m, k, tokens)),
    }
    seconds, size = {n: [] for n in programs}, {}
    for _ in range(args.repeats):
      for n, fn in programs.items():
        _, s, size[n] = compile_stats(fn, key)
        seconds[n].append(s)
    med = {n: statistics.median(v) for n, v in seconds.items()}
    print(f"{name} | {cfg.num_layers} | {med['unrolled']:.2f} / {size['unrolled'] / 1e3:.0f} | "
          f"{med['rolled']:.2f} / {size['rolled'] / 1e3:.0f} | "
          f"{med['unrolled'] / med['rolled']:.1f} | {size['unrolled'] / size['rolled']:.1f}")


if __name__ == "__main__":
  main()
