"""Compile time of the whole train step per controller: what a measuring pass adds (issue 23).

Builds the train step of `configs/tiny.py:runlocal` (int8 / bf16 routed, 2 layers, 14 units)
with `train_loop.build` for each controller and compiles it on abstract inputs, without
running: the config default (the paper's rule at alpha 4 / beta 3, a transient alarm), 'norm',
and 'noise' with `noise_gate='any'` ('noisegate' of the experiments), whose 'uniform' measuring
pass (split halves, or one recovery pass with --no-split) sits in the step under a `lax.cond`,
so it is compiled into every step program whether or not a step measures. Columns: compile
seconds (median of --repeats fresh compiles, the persistent cache off) and the XLA fusions of
the optimized program; the ratio is over the default.

  python benchmarks/step_compile.py
  python benchmarks/step_compile.py --controllers default,noise_unit --repeats 5
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

import tiny  # noqa: E402  pylint: disable=g-import-not-at-top
from gnmr_jax import train_loop  # noqa: E402

NOISE = {"priority": "noise", "alpha": 4.0, "beta": 3.0, "gap_decay": 0.5, "noise_rank": "norm"}
CONTROLLERS = {
    "default": {},
    "norm": {"priority": "norm"},
    "noisegate": {**NOISE, "noise_gate": "any"},
    "noise_unit": {**NOISE, "noise_rank": "pi"},
}


class _Shapes:
  """The only thing `build` reads from the data: the vocabulary size (bytes + specials)."""
  vocab_size = 260


def config_for(name: str, split: bool):
  config = tiny.get_config("runlocal")
  config.logging.plots = config.logging.tensorboard = False
  config.gnmr.update(CONTROLLERS[name])
  if config.gnmr.priority == "noise":
    config.diagnostics.update(recovery_gap_every=50, recovery_gap_start=0,
                              recovery_gap_pass="uniform", recovery_gap_split=split)
  return config


def compile_once(config):
  """(seconds, fusions) of one fresh XLA compile of the jitted train step."""
  run = train_loop.build(config, data=_Shapes(), devices=jax.devices()[:1])
  state = run.abstract_state
  tokens = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32)
  lowered = run.train_step.lower(state, {"inputs": tokens, "targets": tokens})
  start = time.perf_counter()
  compiled = lowered.compile()
  return time.perf_counter() - start, compiled.as_text().count(" fusion")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--controllers", default="default,norm,noisegate")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no-split", dest="split", action="store_false",
                      help="'noise': one recovery pass instead of two half batches")
  args = parser.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  names = args.controllers.split(",")
  unknown = [n for n in names if n not in CONTROLLERS]
  if unknown:
    raise SystemExit(f"unknown controllers {unknown}; valid: {list(CONTROLLERS)}")
  print(f"# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend "
        f"{jax.default_backend()}; configs/tiny.py:runlocal train step, compile only; "
        f"median of {args.repeats}, rounds interleaved; split halves {args.split}")
  times = {n: [] for n in names}
  fusions = {}
  for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
    for name in names:
      seconds, fusions[name] = compile_once(config_for(name, args.split))
      times[name].append(seconds)
  base = statistics.median(times[names[0]])
  print("controller | compile s (median) | all rounds | fusions | compile / "
        f"{names[0]}")
  for name in names:
    med = statistics.median(times[name])
    print(f"{name} | {med:.2f} | {', '.join(f'{t:.2f}' for t in times[name])} | "
          f"{fusions[name]} | {med / base:.2f}")


if __name__ == "__main__":
  main()
