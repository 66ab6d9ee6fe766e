"""Train-step cost of the emulated microscaling paths (mxfp8, nvfp4) against bf16 and int8.

Times the forward+backward step (jax.value_and_grad of the next-token loss) of
gnmr_jax.model's Transformer at the scenario model's size (scenario 1's
`base('cpu')`: d=128, 4 layers, ffn 344, 16 x 64 tokens, its compute dtype),
every projection on one static precision path. The steps run interleaved: each
round times every variant once (median of `--iters` calls), and a variant's
ratio is the median over rounds of its time / the bf16 time of the same round,
so background load shared by a round cancels. Goal: mxfp8 and nvfp4 <= 2x bf16
on a CPU (the formats are emulated: quantize-dequantize, then a bf16 dot). Last
line: `microscaling_over_bf16: mxfp8=<ratio> nvfp4=<ratio>`.

  python benchmarks/microscaling_step.py
  python benchmarks/microscaling_step.py --rounds 9 --iters 5
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import flax.linen as nn
import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.scenario1_saved_activation import base  # noqa: E402
from gnmr_jax import precision  # noqa: E402
from gnmr_jax.model import Transformer  # noqa: E402

# label -> precision config fields of a static policy.
VARIANTS = {
    "bf16": {"low_cost_path": "bf16"},
    "int8": {"low_cost_path": "int8"},
    "mxfp8": {"low_cost_path": "mxfp8"},
    "nvfp4": {"low_cost_path": "nvfp4"},
    "nvfp4 rtn": {"low_cost_path": "nvfp4", "nvfp4_gradient_rounding": "nearest"},
    "nvfp4 fwd-only": {"low_cost_path": "nvfp4", "nvfp4_forward_only": True},
}


def make_step(model_cfg, fields):
  cfg = precision.default_precision_config()
  cfg.mode = "static"
  cfg.update(fields)
  model = Transformer(model_cfg, precision.make_policy(cfg))

  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  return model, jax.jit(jax.value_and_grad(loss))


def median_call_seconds(fn, iters):
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--iters", type=int, default=3)
  args = parser.parse_args()
  config = base("cpu")
  model_cfg, batch, seq = config.model, config.data.batch_size, config.data.seq_len
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, model_cfg.vocab_size)
  steps = {label: make_step(model_cfg, fields) for label, fields in VARIANTS.items()}
  model = steps["bf16"][0]
  params = jax.jit(lambda k: nn.unbox(model.init(k, tokens)["params"]))(jax.random.key(0))
  calls = {}
  for label, (_, step) in steps.items():
    compiled = step.lower(params, tokens).compile()
    calls[label] = lambda compiled=compiled: compiled(params, tokens)
    jax.block_until_ready(calls[label]())  # warm-up
  ratios = {label: [] for label in calls}
  seconds = {label: [] for label in calls}
  for _ in range(args.rounds):
    this_round = {label: median_call_seconds(call, args.iters) for label, call in calls.items()}
    for label, t in this_round.items():
      seconds[label].append(t)
      ratios[label].append(t / this_round["bf16"])
  print(f"# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend "
        f"{jax.default_backend()} ({os.cpu_count()} cpus); scenario-1 cpu model d={model_cfg.d_model} "
        f"L={model_cfg.num_layers} ffn={model_cfg.ffn_dim} dtype={model_cfg.dtype} "
        f"tokens/step={batch}x{seq}; {args.rounds} interleaved rounds x {args.iters} calls")
  print("path | median ms | x bf16 (median of per-round ratios) | min..max ratio")
  for label in calls:
    r = ratios[label]
    print(f"{label} | {statistics.median(seconds[label]) * 1e3:.1f} | "
          f"{statistics.median(r):.2f} | {min(r):.2f}..{max(r):.2f}")
  print("microscaling_over_bf16: " + " ".join(
      f"{label}={statistics.median(ratios[label]):.2f}" for label in ("mxfp8", "nvfp4")))


if __name__ == "__main__":
  main()
