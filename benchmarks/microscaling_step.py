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

Native block-scaled GEMMs (issue 38; Blackwell GPUs): `--variants` picks labels, e.g.
  python benchmarks/microscaling_step.py --model 1b --batch 16 --seq 256 \
      --variants "bf16,fp8,mxfp8,mxfp8 native,nvfp4,nvfp4 native"
times them beside the emulated ones and bf16. On a device without block-scaled tensor cores
the native variants are skipped (said in the output); `--native cpu_reference` runs them on
the CPU with the GEMM as its definition (testing.register_cpu_scaled_matmul): a dry run of the
code path, never a timing of native hardware.
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import types

import flax.linen as nn
import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.scenario1_saved_activation import base  # noqa: E402
from gnmr_jax import precision  # noqa: E402
from gnmr_jax.model_configs import model_config  # noqa: E402
from gnmr_jax.precision import native_microscaling, testing  # noqa: E402
from gnmr_jax.model import Transformer  # noqa: E402

# label -> precision config fields of a static policy.
EMULATED = {"microscaling_impl": "emulated"}
NATIVE = {"microscaling_impl": "native"}
VARIANTS = {
    "bf16": {"low_cost_path": "bf16"},
    "int8": {"low_cost_path": "int8"},
    "fp8": {"low_cost_path": "fp8"},
    "mxfp8": {"low_cost_path": "mxfp8", **EMULATED},
    "nvfp4": {"low_cost_path": "nvfp4", **EMULATED},
    "nvfp4 rtn": {"low_cost_path": "nvfp4", "nvfp4_gradient_rounding": "nearest", **EMULATED},
    "nvfp4 fwd-only": {"low_cost_path": "nvfp4", "nvfp4_forward_only": True, **EMULATED},
    "mxfp8 native": {"low_cost_path": "mxfp8", **NATIVE},
    "nvfp4 native": {"low_cost_path": "nvfp4", **NATIVE},
}
DEFAULT_VARIANTS = "bf16,int8,mxfp8,nvfp4,nvfp4 rtn,nvfp4 fwd-only"
# A stand-in device for --native cpu_reference: make_policy builds the native paths for it.
BLACKWELL = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA B200 (stand-in)",
                                  compute_capability="10.0")


def make_step(model_cfg, fields, device=None):
  cfg = precision.default_precision_config()
  cfg.mode = "static"
  cfg.update(fields)
  model = Transformer(model_cfg, precision.make_policy(cfg, device=device))

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
  parser.add_argument("--model", default="scenario",
                      help="'scenario' (scenario 1's cpu model) or a model_configs name (1b)")
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--seq", type=int, default=None)
  parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                      help=f"comma-separated labels of {list(VARIANTS)}; bf16 is always timed")
  parser.add_argument("--native", choices=("device", "cpu_reference"), default="device",
                      help="native variants on the device (skipped where it cannot run them) "
                      "or, as a dry run, on the CPU with the GEMM as its definition")
  parser.add_argument("--only_if_native", action="store_true",
                      help="exit at once (status 0) where the device has no block-scaled "
                      "tensor cores: scripts/gpu_checks.sh spends no device time there")
  args = parser.parse_args()
  if (args.only_if_native and args.native == "device"
      and not native_microscaling.supports_native(jax.devices()[0])):
    print(f"skipped: {native_microscaling.describe(jax.devices()[0])} has no block-scaled "
          "tensor cores (CUDA compute capability >= 10 runs them)")
    return
  labels = ["bf16"] + [v for v in args.variants.split(",") if v != "bf16"]
  unknown = [v for v in labels if v not in VARIANTS]
  if unknown:
    raise SystemExit(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
  if args.model == "scenario":
    config = base("cpu")
    model_cfg, batch, seq = config.model, config.data.batch_size, config.data.seq_len
  else:
    model_cfg, batch, seq = model_config(args.model), 16, 256
  batch, seq = args.batch or batch, args.seq or seq
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, model_cfg.vocab_size)
  device = None
  if args.native == "cpu_reference":
    testing.register_cpu_scaled_matmul()
    device = BLACKWELL
  steps = {}
  for label in labels:
    try:
      steps[label] = make_step(model_cfg, VARIANTS[label], device)
    except ValueError as e:  # a native variant on a device without block-scaled tensor cores
      print(f"{label}: skipped ({e})")
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
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}, {os.cpu_count()} cpus); "
        f"{'scenario-1 cpu' if args.model == 'scenario' else args.model} model "
        f"d={model_cfg.d_model} "
        f"L={model_cfg.num_layers} ffn={model_cfg.ffn_dim} dtype={model_cfg.dtype} "
        f"tokens/step={batch}x{seq}; {args.rounds} interleaved rounds x {args.iters} calls"
        + ("; native GEMMs as their CPU definition (a dry run, not native speed)"
           if args.native == "cpu_reference" else ""))
  print("path | median ms | x bf16 (median of per-round ratios) | min..max ratio")
  for label in calls:
    r = ratios[label]
    print(f"{label} | {statistics.median(seconds[label]) * 1e3:.1f} | "
          f"{statistics.median(r):.2f} | {min(r):.2f}..{max(r):.2f}")
  print("microscaling_over_bf16: " + " ".join(
      f"{label.replace(' ', '_')}={statistics.median(ratios[label]):.2f}"
      for label in calls if label.startswith(("mxfp8", "nvfp4")) and label in VARIANTS
      and (label in ("mxfp8", "nvfp4") or "native" in label)))


if __name__ == "__main__":
  main()
