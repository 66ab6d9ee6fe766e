"""The LLaMA model's fwd+bwd step: bf16 vs static low-cost vs GNMR-routed, side by side.

For each low-cost path (int8, fp8): the static step (no cond in the program) and the routed
step (mode='gnmr', layers unrolled as policy.scan_unroll asks) with 0, 1 and max_o units
recovered, all timed interleaved in one run against the bf16 step. Ratios:
  x_bf16      bf16 step time / this step time (tokens/s relative to bf16)
  rec0/static routed with an empty mask / the faster of the static steps, rolled scan or
              unrolled (routing's own cost; goal <= 1.03)
  recK/interp routed with K units recovered / linear interpolation between the static and
              bf16 steps at K of N units (goal <= 1.03)
Also compile seconds, optimized-HLO size and XLA's temp memory (MiB) of each program: the
unrolled programs defeat model.remat on XLA:CPU (temp grows with the unrolled layers), so
check it on the GPU too. Last line:
`model_routed_empty_over_static: <worst ratio>`.

  python benchmarks/model_step.py                      # tiny config, CPU size
  python benchmarks/model_step.py --model 1b --batch 32 --seq 256   # the H200 goal size
  python benchmarks/model_step.py --model 1b --batch 32 --seq 256 --compile_only  # check it on a CPU
"""
import argparse
import datetime
import functools
import os
import platform
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compile_stats, interleaved_seconds, temp_mib  # noqa: E402
from gnmr_jax import precision  # noqa: E402
from gnmr_jax.model import PROJECTIONS, UNITS_PER_LAYER, Transformer  # noqa: E402
from gnmr_jax.model_configs import model_config  # noqa: E402


def policy_for(mode, path, max_o=4):
  cfg = precision.default_precision_config()
  cfg.mode, cfg.low_cost_path = mode, path
  return precision.make_policy(cfg, max_recovered=max_o)


def mask_tree(num_layers, k):
  """A recovery mask with k (layer, projection) units on, spread over layers."""
  units = [(group, proj) for group, projs in PROJECTIONS.items() for proj in projs]
  n = num_layers * len(units)
  on = np.zeros(n, bool)
  if k:
    on[np.linspace(0, n - 1, k).astype(int)] = True
  on = on.reshape(len(units), num_layers)
  tree = {"layers": {group: {} for group in PROJECTIONS}}
  for (group, proj), bits in zip(units, on):
    tree["layers"][group][proj] = {"kernel": jnp.asarray(bits)}
  return tree


def init_params(model, seq, abstract=False):
  """The model's plain (unboxed) params for sequences of ``seq`` tokens; shapes only if abstract."""
  init = lambda k: nn.unbox(model.init(k, jnp.zeros((1, seq), jnp.int32))["params"])
  return jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(jax.random.key(0))


def make_step(model_cfg, policy, unroll=None):
  cfg = ml_collections.ConfigDict(model_cfg.to_dict())
  cfg.scan_unroll = (policy.scan_unroll(cfg.num_layers, jax.devices()[0].platform)
                     if unroll is None else unroll)
  model = Transformer(cfg, policy)

  def loss(params, tokens, mask):
    logits = model.apply({"params": params}, tokens, recovery_mask=mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  return model, jax.jit(jax.value_and_grad(loss))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="tiny")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--paths", default="int8,fp8")
  parser.add_argument("--max_o", type=int, default=4)
  parser.add_argument("--dtype", default="bfloat16", help="compute dtype of the model")
  parser.add_argument("--remat", default="none",
                      help="model.remat for every program (default none: the step's own matmul "
                           "cost, as the GPU anchors measured it; 'config' keeps the config's)")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--compile_only", action="store_true",
                      help="compile every program, time nothing (check a GPU size on a CPU)")
  args = parser.parse_args()
  model_cfg = model_config(args.model)
  model_cfg.dtype = args.dtype
  if args.remat != "config":
    model_cfg.remat = args.remat
  model_cfg.vocab_size = max(model_cfg.vocab_size, 256)
  L = model_cfg.num_layers
  n_units = UNITS_PER_LAYER * L
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, model_cfg.vocab_size)
  bf16_model, bf16_step = make_step(model_cfg, policy_for("static", "bf16"))
  params = init_params(bf16_model, args.seq, abstract=args.compile_only)
  masks = {k: mask_tree(L, k) for k in (0, 1, args.max_o)}
  print(f"# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}); model {args.model} "
        f"L={L} d={model_cfg.d_model} tokens/step={args.batch * args.seq} units={n_units} "
        f"max_o={args.max_o} dtype={args.dtype} remat={model_cfg.remat}")
  print("path | variant | compile_s | hlo_kB | temp_MiB | ms | x_bf16 | rec0/static | "
        f"rec1/interp | rec{args.max_o}/interp")
  worst = 0.0
  for path in args.paths.split(","):
    static = policy_for("static", path)
    steps = {"bf16": bf16_step, "static": make_step(model_cfg, static)[1],
             "static unrolled": make_step(model_cfg, static, unroll=L)[1],
             "routed": make_step(model_cfg, policy_for("gnmr", path, args.max_o))[1]}
    # Compiled once each (static programs get no mask); the timed calls reuse them.
    compiled = {name: compile_stats(fn, params, tokens, masks[0] if name == "routed" else None)
                for name, fn in steps.items()}
    stats = {name: (c[1], c[2], temp_mib(c[0])) for name, c in compiled.items()}
    if args.compile_only:
      for name, (c, h, m) in stats.items():
        print(f"{path} | {name} | {c:.1f} | {h / 1e3:.0f} | {m:.0f} | - | - | - | - | -")
      continue
    calls = {(name, 0): functools.partial(compiled[name][0], params, tokens, None)
             for name in ("bf16", "static", "static unrolled")}
    for k in masks:
      calls[("routed", k)] = functools.partial(compiled["routed"][0], params, tokens, masks[k])
    t = interleaved_seconds(calls, rounds=args.rounds, iters=args.iters)
    # Routing's cost is measured against the faster static program (rolled or unrolled).
    t_bf16, t_static = t["bf16", 0], min(t["static", 0], t["static unrolled", 0])
    interp = lambda k: t_static + (t_bf16 - t_static) * k / n_units
    ratios = [t["routed", 0] / t_static, t["routed", 1] / interp(1),
              t["routed", args.max_o] / interp(args.max_o)]
    worst = max(worst, ratios[0])
    for name, ms in (("bf16", t_bf16), ("static", t["static", 0]),
                     ("static unrolled", t["static unrolled", 0]), ("routed", t["routed", 0])):
      c, h, m = stats[name]
      extra = " | ".join(f"{r:.3f}" for r in ratios) if name == "routed" else "- | - | -"
      print(f"{path} | {name} | {c:.1f} | {h / 1e3:.0f} | {m:.0f} | {ms * 1e3:.2f} | "
            f"{t_bf16 / ms:.2f} | {extra}")
  print(f"model_routed_empty_over_static: {float('nan') if args.compile_only else worst:.3f}")


if __name__ == "__main__":
  main()
