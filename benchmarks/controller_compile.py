"""XLA compile time of the controller's update against the number of param leaves (issue 19).

The controller keeps each per-unit field (mask, lock, statistics: 11 for `gnmr`, 16 for the
budgeted priorities) as one array over the units (`control.UnitValues`). Until 2026-12-02 it
kept each as a tree mirroring the params, so its jitted update wrote one output per (field,
leaf) and the program grew with the number of leaves (per-layer / stacked was 11-12x at 16
layers: 9.7 s for `gnmr`, 11.6 s for 'norm', 1262 / 1371 fusions). This compiles,
without running, `tx.update` of `gnmr_jax.gnmr` and of `gnmr_jax.norm_level` on the same
number of units laid out two ways: layer-stacked (7 leaves of shape [L, d, d], the
Transformer's layout) and per-layer modules (7 * L leaves of shape [d, d], as a Flax Linen or
NNX model without `nn.scan` holds them). Columns: compile seconds and XLA fusions of the
optimized program; the ratio is per-layer over stacked.

  python benchmarks/controller_compile.py                 # L = 2, 4, 16
  python benchmarks/controller_compile.py --layers 2,32
"""
import argparse
import datetime
import platform
import time

import jax
import jax.numpy as jnp

from gnmr_jax import control
from gnmr_jax.model import PROJECTIONS, UNITS_PER_LAYER

NAMES = tuple(name for names in PROJECTIONS.values() for name in names)


def compile_seconds(transform, params):
  """(compile seconds, fusions) of jit(transform.update) on abstract params and state."""
  state = jax.eval_shape(transform.init, params)
  lowered = jax.jit(transform.update).lower(params, state, params)
  start = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  return seconds, compiled.as_text().count(" fusion")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="2,4,16")
  parser.add_argument("--width", type=int, default=32)
  args = parser.parse_args()
  # Compile for real: no persistent cache (run_all passes the environment through), and one
  # throwaway compile so the first row does not pay the backend's start-up.
  jax.config.update("jax_enable_compilation_cache", False)
  compile_seconds(control.gnmr(alpha=2.0, beta=1.5, delta=8, max_o=1, t_lock=0),
                  {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})
  print(f"# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend "
        f"{jax.default_backend()}; compile only (XLA:{jax.default_backend()}); d={args.width}")
  print("controller | layers | units | stacked: leaves / s / fusions | per-layer: leaves / s / "
        "fusions | per-layer / stacked compile")
  d = args.width
  controllers = {  # layer_axis: the stacked leaves' regex, or None for per-layer modules
      "gnmr": lambda axis: control.gnmr(alpha=2.0, beta=1.5, delta=8, max_o=4, t_lock=5,
                                        units=r"kernel", layer_axis=axis),
      "norm": lambda axis: control.norm_level(max_o=4, t_lock=5, units=r"kernel",
                                              layer_axis=axis),
  }
  for layers in (int(x) for x in args.layers.split(",")):
    stacked = {"layers": {n: {"kernel": jax.ShapeDtypeStruct((layers, d, d), jnp.float32)}
                          for n in NAMES}}
    per_layer = {f"layer{l}": {n: {"kernel": jax.ShapeDtypeStruct((d, d), jnp.float32)}
                               for n in NAMES} for l in range(layers)}
    for name, make in controllers.items():
      s_sec, s_fus = compile_seconds(make(r"^layers/"), stacked)
      p_sec, p_fus = compile_seconds(make(None), per_layer)
      print(f"{name} | {layers} | {UNITS_PER_LAYER * layers} | {len(NAMES)} / {s_sec:.2f} / {s_fus} | "
            f"{UNITS_PER_LAYER * layers} / {p_sec:.2f} / {p_fus} | {p_sec / s_sec:.1f}", flush=True)


if __name__ == "__main__":
  main()
