"""Issue 38: what jax.nn.scaled_dot_general computes, against the project's NVFP4 / MXFP8 recipe.

The project's native path (gnmr_jax/precision/native_microscaling.py) multiplies the project's
own codes and scales in the block-scaled GEMM; `jax.nn.scaled_dot_general`, the peer a user
would reach for, quantizes by its own rules. Both run here on the CPU: its quantizer is plain
JAX, and its GEMM runs as its definition (testing.register_cpu_scaled_matmul: dequantize, then
a float32 dot), so what differs is the semantics, not the hardware.

  python experiments/microscaling_semantics.py --part quantize   # the quantizers, per tensor
  python experiments/microscaling_semantics.py --part train --seeds 3
  python experiments/microscaling_semantics.py --part report     # writes the markdown report

--part train: one JSON per (regime, arm, seed) under
experiments/results/microscaling_semantics/<regime>/<arm>/seed<k>.json, skipped when it exists
(an interrupted sweep resumes). Regimes 'nvfp4' and 'mxfp8' of experiments/noise_fraction.py
(d 128, 4 layers, 200 steps on the CPU; ffn_dim 352, a multiple of 32), static. Arms: 'recipe' (the project's path: the same
numerics native or emulated), 'recipe_perturb' (the same with the initial params times
(1 + 1e-7 z): the noise floor), 'jax' (every projection through `jax.nn.scaled_dot_general`
with `get_scaled_dot_general_config(mode)`'s defaults, operands in float32), and for NVFP4
'recipe_fwd' (the recipe's forward, a bf16 backward: what jax's NVFP4 backward is like).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

from experiments import common  # noqa: E402  pylint: disable=g-import-not-at-top
from gnmr_jax import versions as versions_lib  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import noise_fraction  # noqa: E402  pylint: disable=g-import-not-at-top
from experiments import selection_report  # noqa: E402  pylint: disable=g-import-not-at-top

RESULTS = os.path.join(common.RESULTS_DIR, "microscaling_semantics")
REPORT = os.path.join(RESULTS, "REPORT.md")
REGIMES = ("nvfp4", "mxfp8")
ARMS = ("recipe", "recipe_perturb", "jax", "recipe_fwd")
# 'recipe_fwd' (NVFP4 only): the recipe's forward with a bf16 backward (nvfp4_forward_only),
# as jax's NVFP4 leaves its backward unquantized: jax against it isolates the forward's rules.
ARMS_OF = {"nvfp4": ARMS, "mxfp8": ARMS[:3]}
SDG_PATHS = {"nvfp4": "jax_sdg_nvfp4", "mxfp8": "jax_sdg_mxfp8"}


# --- jax.nn.scaled_dot_general as a precision path ----------------------------------------


def _sdg_dot(mode):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  configs = [jax.nn.get_scaled_dot_general_config(mode)] * 3

  def dot(x, kernel):  # float32 operands: its quantizer computes in the operands' dtype
    return jax.nn.scaled_dot_general(x.astype(jnp.float32), kernel.astype(jnp.float32),
                                     (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32, configs=configs)
  return dot


def register_sdg_paths() -> None:
  """Registers 'jax_sdg_nvfp4' / 'jax_sdg_mxfp8': jax.nn.scaled_dot_general with its default
  configs, forward and its own backward (NVFP4: unquantized, clipped inputs' gradients zeroed;
  MXFP8: the gradient and the saved operands quantized)."""
  import jax  # pylint: disable=g-import-not-at-top
  from gnmr_jax import precision  # pylint: disable=g-import-not-at-top
  from gnmr_jax.precision import path as path_lib, registry, testing  # pylint: disable=g-import-not-at-top
  testing.register_cpu_scaled_matmul()
  for mode, name in SDG_PATHS.items():
    if name in registry.available_paths():
      continue
    dot = _sdg_dot(mode)

    def forward(x, kernel, dot=dot):
      return dot(x, kernel).astype(x.dtype), ()

    def backward(residuals, x, kernel, g, dot=dot):
      del residuals
      dx, dkernel = jax.vjp(dot, x, kernel)[1](g.astype("float32"))
      return dx.astype(g.dtype), dkernel.astype(kernel.dtype)

    path = path_lib.Path(forward=forward, backward=backward, saves_input=True)
    precision.register_path(name, lambda config, role, path=path: path)


# --- the quantizers, tensor by tensor -------------------------------------------------------


def _tensors():
  rng = np.random.default_rng(0)
  normal = rng.standard_normal((64, 256)).astype(np.float32)
  zero_blocks = normal.copy()
  zero_blocks[:, :64] = 0
  outliers = normal.copy()
  outliers[:, ::32] = 1e4
  return {
      "normal": normal,
      "heavy-tailed (~20 binades)": (normal * np.exp(3 * rng.standard_normal(normal.shape))
                                     ).astype(np.float32),
      "small (1e-4 x normal)": 1e-4 * normal,
      "large (1e4 x normal)": 1e4 * normal,
      "all-zero blocks (1/4 of them)": zero_blocks,
      "an outlier (1e4) in every block": outliers,
  }


def quantize_rows():
  """[(tensor, format, rule, relative error, elements != the recipe's, NaNs)]."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax._src.cudnn import scaled_matmul_stablehlo as sm  # pylint: disable=g-import-not-at-top
  from gnmr_jax.precision import microscaling as ms  # pylint: disable=g-import-not-at-top

  def jax_dequantized(x, mode, global_scale=None):
    config = jax.nn.get_scaled_dot_general_config(mode, global_scale)
    codes, scales = sm.quantize(jnp.asarray(x)[None], config)
    block = config.block_size
    values = (codes.astype(jnp.float32).reshape(1, x.shape[0], -1, block)
              * scales.astype(jnp.float32)[..., None]).reshape(x.shape)
    return np.asarray(values * config.global_scale if mode == "nvfp4" else values)

  rows = []
  for name, x in _tensors().items():
    amax = np.float32(np.abs(x).max())
    current = jnp.array([amax * np.float32(1 / (6 * 448))], jnp.float32)  # the recipe's s_t
    candidates = [
        ("nvfp4", "recipe", np.asarray(ms.nvfp4_dequantized(jnp.asarray(x), 1))),
        ("nvfp4", "jax, global scale 1 (default)", jax_dequantized(x, "nvfp4")),
        ("nvfp4", "jax, global scale = the recipe's", jax_dequantized(x, "nvfp4", current)),
        ("mxfp8", "recipe", np.asarray(ms.mxfp8_dequantized(jnp.asarray(x), 1))),
        ("mxfp8", "jax", jax_dequantized(x, "mxfp8")),
    ]
    recipe = {fmt: values for fmt, rule, values in candidates if rule == "recipe"}
    x64 = x.astype(np.float64)
    for fmt, rule, values in candidates:
      finite = np.where(np.isfinite(values), values, 0).astype(np.float64)
      error = np.linalg.norm(finite - x64) / np.linalg.norm(x64)
      differ = np.mean(~((values == recipe[fmt]) | (np.isnan(values) & np.isnan(recipe[fmt]))))
      rows.append((name, fmt, rule, error, differ, int(np.sum(~np.isfinite(values)))))
  return rows


def quantize_table() -> list:
  lines = ["| tensor [64, 256] | format | quantizer | relative error ||Q(x) - x|| / ||x|| "
           "(non-finite as 0) | elements != recipe | non-finite |", "|---|---|---|---|---|---|"]
  for name, fmt, rule, error, differ, bad in quantize_rows():
    lines.append(f"| {name} | {fmt} | {rule} | {error:.4f} | {100 * differ:.1f}% | {bad} |")
  return lines


# --- training ------------------------------------------------------------------------------


# jax.nn.scaled_dot_general asserts that every contraction is a multiple of the block (the
# recipe pads): the scenario model's ffn_dim 344 becomes 352 in every arm here.
FFN_DIM = 352


def arm_config(regime, arm, seed):
  base_arm = "static_low_perturb" if arm == "recipe_perturb" else "static_low"
  config = noise_fraction.arm_config(regime, base_arm, seed)
  config.model.ffn_dim = FFN_DIM
  config.diagnostics.recovery_gap_every = 0
  config.logging.unit_log_every = 0
  config.precision.microscaling_impl = "emulated"  # the native GEMM's numerics (tests show it)
  if arm == "jax":
    config.precision.low_cost_path = SDG_PATHS[regime]
  elif arm == "recipe_fwd":
    config.precision.nvfp4_forward_only = True
  return config


def result_path(regime, arm, seed):
  return os.path.join(RESULTS, regime, arm, f"seed{seed}.json")


def run_one(regime, arm, seed):
  register_sdg_paths()
  return common.trained_json(result_path(regime, arm, seed), "microscaling_semantics", regime,
                             arm, seed, arm_config(regime, arm, seed))


def load(regime):
  return common.load_runs(os.path.join(RESULTS, regime), ARMS)


def _paired_text(rows, reference) -> str:
  if not reference:
    return "-"
  d, se, n = selection_report.paired(rows.values(), reference.values())
  return f"{d:+.4f} +- {se:.4f} (n={n})" if n >= 2 else "-"


def train_table() -> list:
  lines = ["| regime | arm | seeds | final eval loss (mean) | loss - recipe, paired (mean +- SE) "
           "| loss - recipe_fwd, paired | noise floor: max abs(recipe_perturb - recipe) |",
           "|---|---|---|---|---|---|---|"]
  for regime in REGIMES:
    results = load(regime)
    floor = [abs(results["recipe_perturb"][k]["eval_loss"] - results["recipe"][k]["eval_loss"])
             for k in set(results.get("recipe_perturb", {})) & set(results.get("recipe", {}))]
    for arm in ARMS_OF[regime]:
      rows = results.get(arm, {})
      if not rows:
        lines.append(f"| {regime} | {arm} | 0 | not run | - | - | - |")
        continue
      mean = np.mean([r["eval_loss"] for r in rows.values()])
      versus = lambda other: "-" if arm in ("recipe", other) else _paired_text(
          rows, results.get(other, {}))
      lines.append(f"| {regime} | {arm} | {len(rows)} | {mean:.4f} | {versus('recipe')} | "
                   f"{versus('recipe_fwd') if arm == 'jax' else '-'} | "
                   f"{f'{max(floor):.4f}' if floor else '-'} |")
  return lines


def report() -> str:
  runs = [r for regime in REGIMES for arm in load(regime).values() for r in arm.values()]
  dated = sorted({(r["date"], r["device"]) for r in runs})
  versions = runs[0]["versions"] if runs else versions_lib.versions()
  return "\n".join(
      ["# jax.nn.scaled_dot_general against the project's NVFP4 / MXFP8 recipe",
       "", "Generated by `python experiments/microscaling_semantics.py --part report` "
       "(never edited by hand). Both run on the CPU: jax's quantizer is plain JAX and its "
       "block-scaled GEMM runs as its definition (dequantize, float32 dot).", "",
       "## The quantizers, one tensor each (round to nearest; NVFP4 along rows of 16, MXFP8 "
       "of 32)", ""] + quantize_table()
      + ["", f"## Training: the scenario CPU model (d 128, ffn {FFN_DIM}, 4 layers, 200 steps), "
         "static, every projection on the path", "",
         f"Runs: {', '.join(f'{d} on {dev}' for d, dev in dated) or 'none yet'}; "
         f"versions {versions}.", ""] + train_table()) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("quantize", "train", "report"), required=True)
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args(argv)
  if args.part == "quantize":
    print("\n".join(quantize_table()))
  elif args.part == "train":
    common.enable_compilation_cache()
    for seed in range(args.seeds):
      for regime in args.regimes.split(","):
        for arm in args.arms.split(","):
          if arm in ARMS_OF[regime]:
            run_one(regime, arm, seed)
  else:
    text = report()
    os.makedirs(RESULTS, exist_ok=True)
    with open(REPORT, "w", encoding="utf-8") as f:
      f.write(text)
    print(text)


if __name__ == "__main__":
  main()
