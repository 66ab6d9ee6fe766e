"""Step-time cost of each arm of issue 23's NVFP4 experiment, measured side by side in one run.

Builds the train step of every arm of experiments/noise_fraction.py in a wsd8 regime (8 layers,
d 128, emulated NVFP4 low-cost path, bf16 recovery), runs each arm's own step for --warm steps
(past the controller's warmup: the mask after warmup, on one repeated batch, so a spike rule
fires less than over a real run), then times blocks
of --block steps in interleaved rounds (a block is a multiple of the measuring period K = 50, so
it holds the 'noise' and 'gap' arms' share of measured steps). Prints per arm the median time
per step and `<arm>_over_static_low`, the ratio to static NVFP4 (per round, then the median).

The late switches spend their recovery in the last eighth of the run: they are timed in both
phases (`late_switch@before`: the routed step with an empty mask; `late_switch@after`: every
unit recovered, built with switch_step 1) and their cost is the step-weighted mean of the two
(7/8 before, 1/8 after), as training would pay it.

`static_low_unrolled` is static NVFP4 with its layer scan fully unrolled, as the routed arms'
is (`precision.routed_scan_unroll` 0; a static policy keeps `model.scan_unroll`, 1): the ratios
against it (`<arm>_over_static_low_unrolled`) separate what routing and the controller cost from
what unrolling the layer loop changes on this machine.

What the ratios mean: on a CPU the NVFP4 path is *emulated* (quantize + dequantize + a float
matmul), so it costs more than bf16 here, and an arm that recovers units runs faster, not
slower. These are no accelerator figures. They measure what routing, the controller and the
measuring pass add to the program on this machine; the accelerator cost of recovered units
needs a device with native FP4 (none here).

Usage: python benchmarks/arm_step_cost.py [--regime wsd8long] [--rounds 4] [--block 50]
       [--warm 60] [--arms static_low,static_rec,...]
"""

import argparse
import os
import platform
import statistics
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

from experiments import noise_fraction  # noqa: E402  pylint: disable=g-import-not-at-top
from gnmr_jax import sharding, train_loop  # noqa: E402  pylint: disable=g-import-not-at-top

ARMS = ("static_low", "static_low_unrolled", "static_rec", "last_blocks", "late_switch",
        "late_switch_fwd", "alarm", "norm", "gnmr", "random", "noise", "gap")
LATE = ("late_switch", "late_switch_fwd")


def build(regime, arm, data, after_switch=False):
  """(run, initial state, one device batch) of one arm (after_switch: switch_step 1;
  'static_low_unrolled': static NVFP4 with its layer scan unrolled as a routed step's is)."""
  unrolled = arm == "static_low_unrolled"
  config = noise_fraction.arm_config(regime, "static_low" if unrolled else arm, seed=0)
  if unrolled:
    config.model.scan_unroll = config.model.num_layers
  if config.precision.mode == "static":  # static_low's pre-flight measurements: not a cost of it
    config.diagnostics.update(recovery_gap_every=0, recovery_gap_split=False)
  if after_switch:
    config.gnmr.switch_step = 1
  config.logging.unit_log_every = 0
  config.diagnostics.recovery_gap_start = 0  # measured at gnmr.warmup + 1, then every K
  run = train_loop.build(config, devices=jax.devices()[:1], data=data)
  with sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(0))
    batch = train_loop.device_batch(run, next(run.data.train_iterator()))
  return run, state, batch


def run_block(variant, steps):
  run, state, batch = variant["run"], variant["state"], variant["batch"]
  with sharding.activation_sharding(run.mesh):
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = run.train_step(state, batch)
    jax.block_until_ready((state, metrics))
  variant["state"] = state
  return (time.perf_counter() - start) / steps


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--regime", default="wsd8long", choices=list(noise_fraction.WSD8_VARIANTS))
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--block", type=int, default=50, help="steps per timed block (K | block)")
  parser.add_argument("--warm", type=int, default=60, help="untimed steps first (controller "
                      "warmup, compile)")
  args = parser.parse_args(argv)
  arms = [a for a in args.arms.split(",") if a]
  unknown = sorted(set(arms) - set(ARMS))
  if unknown:
    raise SystemExit(f"unknown arms {unknown}; valid: {list(ARMS)}")
  if "static_low" not in arms:
    raise SystemExit("--arms must include static_low (the ratios' denominator)")
  every = noise_fraction.GAP["recovery_gap_every"]
  if args.block % every or args.block < 1:
    raise SystemExit(f"--block must be a positive multiple of the measuring period {every}")
  warmup = noise_fraction.base_config(args.regime).gnmr.warmup
  if args.warm <= warmup + 1:
    raise SystemExit(f"--warm must pass the controller's warmup ({warmup} steps): got {args.warm}")
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  data = make_data(noise_fraction.base_config(args.regime).data)
  names = []
  variants = {}
  for arm in arms:
    phases = ("before", "after") if arm in LATE else (None,)
    for phase in phases:
      name = f"{arm}@{phase}" if phase else arm
      run, state, batch = build(args.regime, arm, data, after_switch=phase == "after")
      variants[name] = {"run": run, "state": state, "batch": batch}
      names.append(name)
  t0 = time.time()
  for name in names:
    run_block(variants[name], args.warm)
  print(f"built and warmed {len(names)} variants ({args.warm} steps each) in "
        f"{time.time() - t0:.0f} s")
  per_step = {name: [] for name in names}
  for r in range(args.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:  # rotated order per round
      per_step[name].append(run_block(variants[name], args.block))
  steps = noise_fraction.base_config(args.regime).train.steps
  switch = steps - steps // 8 + 1  # noise_fraction.arm_config's switch step
  weights = {"before": (switch - 1) / steps, "after": (steps - switch + 1) / steps}
  per_arm = {}
  for arm in arms:
    if arm in LATE:
      per_arm[arm] = [sum(weights[p] * per_step[f"{arm}@{p}"][r] for p in weights)
                      for r in range(args.rounds)]
    else:
      per_arm[arm] = per_step[arm]
  print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} jax {jax.__version__} "
        f"backend {jax.default_backend()} ({os.cpu_count()} cpus); regime {args.regime} "
        f"(8 layers, d 128, NVFP4 emulated / bf16); {args.rounds} interleaved rounds of "
        f"{args.block} steps after {args.warm}; late switches weighted "
        f"{weights['before']:.3f} before / {weights['after']:.3f} after step {switch}")
  for name in names:
    times = per_step[name]
    print(f"{name:24s} median {1e3 * statistics.median(times):8.2f} ms/step  "
          f"best {1e3 * min(times):8.2f}")
  for base in ("static_low", "static_low_unrolled"):
    if base not in arms:
      continue
    for arm in arms:
      ratios = sorted(a / b for a, b in zip(per_arm[arm], per_arm[base]))
      print(f"{arm}_over_{base}: {statistics.median(ratios):.3f} (per-round range "
            f"{ratios[0]:.3f}..{ratios[-1]:.3f})")


if __name__ == "__main__":
  main()
