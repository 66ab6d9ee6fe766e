"""Which micro-batch, accumulation and remat train a global batch on the chip a user has
(gnmr_jax.aot.fit, issue 48): one cell per (config, target), compiled deviceless.

  .venv-aot/bin/python benchmarks/aot_fit.py              # compile the cells not yet written
  .venv-aot/bin/python benchmarks/aot_fit.py --no_compile # the table of the cells written

Each cell is benchmarks/results/aot_fit/<config>__<target>.json (the fit's candidates and its
choice); a cell that exists is read, not recompiled, so a long run resumes.
"""
import argparse
import datetime
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "aot_fit")
GLOBAL_BATCH = 256  # x 256 tokens: the global batch

# (config name in configs/llama.py, target, overrides): the low-cost path each chip runs.
CELLS = (
    ("350m", "v5e-1", {"precision.low_cost_path": "int8"}),
    ("350m", "t4", {"precision.low_cost_path": "int8"}),
    ("1b", "v6e-1", {"precision.low_cost_path": "int8"}),
)


def cell_path(name: str, target: str) -> str:
  return os.path.join(RESULTS, f"{name}__{target}.json")


def run_cell(name: str, target: str, overrides: dict) -> dict:
  from gnmr_jax import versions as versions_lib  # pylint: disable=g-import-not-at-top
  from gnmr_jax.aot import fit as fit_lib  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import llama  # pylint: disable=g-import-not-at-top
  config = llama.get_config(name)
  config.data.batch_size = GLOBAL_BATCH
  for key, value in overrides.items():
    group, field = key.split(".")
    config[group][field] = value
  result = fit_lib.fit(config, target, log=lambda line: print(line, file=sys.stderr, flush=True))
  result.update(config_name=f"llama:{name}", overrides_given=overrides,
                precision={"mode": config.precision.mode,
                           "low_cost_path": config.precision.low_cost_path},
                versions=versions_lib.package_versions(versions_lib.COMPILERS),
                date=str(datetime.date.today()),
                host=f"{os.cpu_count()} {platform.machine()} cores")
  return result


def table(results: list) -> list:
  from gnmr_jax.aot import fit as fit_lib  # pylint: disable=g-import-not-at-top
  lines = ["# deviceless compiles on a CPU host; train step at a global batch of "
           f"{GLOBAL_BATCH} sequences; tokens/s per device from the step-time model "
           "(gnmr_jax/aot/step_time.py), '-' where the device has no spec", ""]
  for r in results:
    lines += [f"## llama:{r['config_name'].split(':')[-1]} on {r['target']}, "
              f"{r['precision']['low_cost_path']} {r['precision']['mode']} "
              f"(compiled {r['date']}; jax {r['versions'].get('jax', '?')}, "
              f"libtpu {r['versions'].get('libtpu', '-')})",
              fit_lib.format_fit(r), ""]
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--no_compile", action="store_true",
                      help="only print the cells already written")
  args = parser.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  results = []
  for name, target, overrides in CELLS:
    path = cell_path(name, target)
    if not os.path.exists(path):
      if args.no_compile:
        continue
      print(f"fitting llama:{name} on {target} ...", file=sys.stderr, flush=True)
      result = run_cell(name, target, overrides)
      with open(path + ".tmp", "w", encoding="utf-8") as f:  # a crash leaves no cell behind
        json.dump(result, f, indent=1, sort_keys=True)
      os.replace(path + ".tmp", path)
    with open(path, encoding="utf-8") as f:
      results.append(json.load(f))
  print("\n".join(table(results)))


if __name__ == "__main__":
  main()
