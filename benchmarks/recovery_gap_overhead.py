"""Cost of measuring the recovery gap (priority 'gap') on the train step, measured side by side.

Builds the jitted train step of one model config three ways and times them in
interleaved rounds, each round running every variant for the same block of steps
(a multiple of K, so a block holds its share of measured steps):
  norm       gnmr.priority='norm', no measurement (recovery_gap_every=0)
  gap_K      gnmr.priority='gap', recovery_gap_every=K for each K of --every
and prints, per K, `gap_K_over_norm: <ratio>` = time per step with the gap
measured every K steps / time per step without (goal at K=50: <= 1.03), as a ratio of
medians and as the median of per-round ratios (each round runs every variant back to back,
in a rotated order, so a round's ratio sees one load).

Then, because block timings on a shared 2-core VM swing by +-15% between rounds, a
paired single-step measurement: `--pairs` pairs of (one 'norm' step, one 'gap' step)
run back to back, the 'gap' step set to a step number that does not measure (the cond's
skip branch: the fixed cost every step pays) and, for --pairs / 4 pairs, to one that does
(the extra forward+backward); the median ratio of each, r_skip and r_measure, gives
  gap_K_over_norm (paired) = ((K - 1) * r_skip + r_measure) / K.

Model: the CPU model of experiments/scenario1 (d=128, 4 layers, seq 64, batch 16) in
its 4-bit per-tensor saved-activation regime (routed, recovery 8-bit), or --model tiny;
the default 'recovery' measuring pass (every projection on the recovery path).

Usage: python benchmarks/recovery_gap_overhead.py [--every 50,10] [--rounds 12] [--block 50]
       [--priority noise]  (the noise priority: the uniform pass, split halves)
"""

import argparse
import os
import platform
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import selection  # pylint: disable=g-import-not-at-top
from gnmr_jax import sharding, train_loop  # pylint: disable=g-import-not-at-top


def build(every: int, model: str, priority: str = "gap"):
  config = selection.arm_config("tensor4", priority if every else "norm", seed=0)
  config.diagnostics.recovery_gap_every = every
  if priority == "gap":
    config.diagnostics.recovery_gap_pass = "recovery"  # the default measuring pass
  # 'noise': the 'uniform' pass with split halves (experiments/selection.py's arm): all units
  # low-cost and all recovered, each gradient as two half-batch passes.
  config.logging.unit_log_every = 0
  if model == "tiny":
    config.model.d_model, config.model.num_layers, config.model.ffn_dim = 64, 2, 128
    config.model.num_heads = config.model.num_kv_heads = 2
  run = train_loop.build(config, devices=jax.devices()[:1])
  with sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(0))
    batch = train_loop.device_batch(run, next(run.data.train_iterator()))
  return run, state, batch


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--every", default="50,10", help="comma-separated K values")
  parser.add_argument("--rounds", type=int, default=12)
  parser.add_argument("--block", type=int, default=50, help="steps per timed block")
  parser.add_argument("--model", choices=("scenario", "tiny"), default="scenario")
  parser.add_argument("--priority", choices=("gap", "noise"), default="gap",
                      help="'noise': issue 23's priority and its measuring pass")
  parser.add_argument("--pairs", type=int, default=200,
                      help="single-step pairs for the skip branch (a quarter for the measure)")
  args = parser.parse_args(argv)
  every = [int(k) for k in args.every.split(",") if k]
  bad = [k for k in every if k < 1 or args.block % k]
  if bad:
    raise SystemExit(f"--every values must be >= 1 and divide --block ({args.block}): {bad}")
  variants = {"norm": build(0, args.model)}
  for k in every:
    variants[f"gap_{k}"] = build(k, args.model, args.priority)
  states = {name: v[1] for name, v in variants.items()}
  t0 = time.time()
  for name, (run, _, batch) in variants.items():  # compile + warm up
    with sharding.activation_sharding(run.mesh):
      states[name], metrics = run.train_step(states[name], batch)
      jax.block_until_ready(metrics)
  print(f"compiled {len(variants)} variants in {time.time() - t0:.0f} s")
  per_step = {name: [] for name in variants}
  names = list(variants)
  for r in range(args.rounds):
    # Rotated order: no variant always runs first (or right after the same one) in a round.
    for name in names[r % len(names):] + names[:r % len(names)]:
      run, _, batch = variants[name]
      with sharding.activation_sharding(run.mesh):
        start = time.perf_counter()
        for _ in range(args.block):
          states[name], metrics = run.train_step(states[name], batch)
        jax.block_until_ready(metrics)
        per_step[name].append((time.perf_counter() - start) / args.block)
  print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__}, {args.rounds} interleaved rounds of {args.block} steps, "
        f"model {args.model}, priority {args.priority}")
  base = statistics.median(per_step["norm"])
  for name, times in per_step.items():
    print(f"{name:10s} median {1e3 * statistics.median(times):8.2f} ms/step  "
          f"best {1e3 * min(times):8.2f}")
  for k in every:
    # Paired per round (the variants of one round ran back to back, under the same load),
    # then the median over rounds and the spread of the middle half.
    ratios = sorted(g / n for g, n in zip(per_step[f"gap_{k}"], per_step["norm"]))
    print(f"gap_{k}_over_norm per round: median {statistics.median(ratios):.3f}, "
          f"quartiles {_quartiles(ratios)}, range {ratios[0]:.3f}..{ratios[-1]:.3f}")
  for k in every:
    ratio = statistics.median(per_step[f"gap_{k}"]) / base
    print(f"gap_{k}_over_norm: {ratio:.3f}")
  if args.pairs:
    k = every[0]  # measured at steps 1, 1 + k, ...: step 2 skips, step 1 measures
    r_skip = paired(variants, states, f"gap_{k}", 2, args.pairs)
    r_measure = paired(variants, states, f"gap_{k}", 1, max(1, args.pairs // 4))
    print(f"paired single steps: skip/norm median {statistics.median(r_skip):.3f} "
          f"(quartiles {_quartiles(r_skip)}, n={len(r_skip)}), measure/norm median "
          f"{statistics.median(r_measure):.3f} (quartiles {_quartiles(r_measure)}, "
          f"n={len(r_measure)})")
    for kk in every:
      est = ((kk - 1) * statistics.median(r_skip) + statistics.median(r_measure)) / kk
      print(f"gap_{kk}_over_norm (paired): {est:.3f}")


def _quartiles(values):
  v = sorted(values)
  return f"{v[len(v) // 4]:.3f}..{v[(3 * len(v)) // 4]:.3f}"


def paired(variants, states, gap_name, step_number, pairs):
  """Per-pair time ratios gap_name/'norm', the gap step run at ``step_number`` (1-based)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ratios = []
  for i in range(pairs):
    times = {}
    order = ("norm", gap_name) if i % 2 == 0 else (gap_name, "norm")
    for name in order:
      run, _, batch = variants[name]
      state = states[name]
      if name == gap_name:  # the next step is `step_number` (it decides the cond)
        state = state._replace(step=jnp.asarray(step_number - 1, state.step.dtype))
      with sharding.activation_sharding(run.mesh):
        jax.block_until_ready(state)
        start = time.perf_counter()
        states[name], metrics = run.train_step(state, batch)
        jax.block_until_ready(metrics)
        times[name] = time.perf_counter() - start
    ratios.append(times[gap_name] / times["norm"])
  return ratios


if __name__ == "__main__":
  main()
