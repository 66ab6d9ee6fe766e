"""Runs every benchmark script and writes BENCHMARKS.md from their output (never typed by hand).

  python benchmarks/run_all.py [--out BENCHMARKS.md]
  python benchmarks/run_all.py --only "recovery gap"   # rerun the matching sections only

Each section holds the script's command line and its stdout verbatim, with the date, the
machine and the library versions of the run that produced it.
"""
import argparse
import datetime
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [
    ("Controller overhead (issue 2)", ["benchmarks/controller_overhead.py"]),
    ("Routing: static vs routed precision paths (issue 3)", ["benchmarks/routing.py"]),
    ("Saved-activation memory (issue 3)", ["benchmarks/activation_memory.py"]),
    ("Model train step: bf16 vs static vs routed (issues 3, 4)", ["benchmarks/model_step.py"]),
    ("Compile cost of the unrolled routed step per model config (issue 3)",
     ["benchmarks/compile_cost.py", "--models", "tiny,60m,130m,1b,7b,13b"]),
    ("Cost of measuring the recovery gap every K steps (selection issue)",
     ["benchmarks/recovery_gap_overhead.py"]),
    ("Emulated NVFP4 / MXFP8 train step against bf16 and int8 (issue 22)",
     ["benchmarks/microscaling_step.py"]),
    ("Cost of the 'noise' priority's measuring pass ('uniform', split halves) (issue 23)",
     ["benchmarks/recovery_gap_overhead.py", "--priority", "noise", "--every", "50,100",
      "--block", "100"]),
    ("Compile time of the controller update against the number of param leaves (issue 19)",
     ["benchmarks/controller_compile.py"]),
    ("Compile time of the train step per controller: what a measuring pass adds (issue 23)",
     ["benchmarks/step_compile.py"]),
    ("Compile time of the routed Transformer's init: layer scan unrolled vs rolled (issue 19)",
     ["benchmarks/init_compile.py"]),
    ("Step-time cost of each arm of the NVFP4 experiment, wsd8long (issue 23)",
     ["benchmarks/arm_step_cost.py", "--rounds", "3", "--warm", "25"]),
    # Deviceless compiles (.venv-aot, make aot-venv): cells are JSONs under
    # benchmarks/results/aot/, compiled once and reused, so a long matrix resumes.
    # --no_compile: the tables of the cells compiled so far; run the script itself to resume.
    ("Compiled for (issue 36)",
     ["benchmarks/aot_compiled.py", "--matrix", "compiled_for", "--no_compile"]),
    ("Compiled for: the fit chosen from the compiled program, accumulation and remat (issue 48)",
     ["benchmarks/aot_fit.py", "--no_compile"]),
    ("Routed step at scale: routed / static (issue 37)",
     ["benchmarks/aot_compiled.py", "--matrix", "routed_cost", "--no_compile"]),
    # Cells under benchmarks/results/step_time/ (--part calibration / projections resume them).
    ("Step time on paper: a roofline model calibrated on the H200 anchors (issue 39)",
     ["benchmarks/aot_step_time.py", "--no_compile"]),
    ("The step around the GEMMs: attention kernels, fused loss, layer layout (issue 44)",
     ["benchmarks/aot_step_time.py", "--part", "fast_step", "--no_compile"]),
    ("Scaling recipes: quantization that costs less than it saves (issue 45)",
     ["benchmarks/aot_step_time.py", "--part", "quantization", "--no_compile"]),
]
AOT_PYTHON = os.path.join(ROOT, ".venv-aot", "bin", "python")  # scripts named aot_* run there


def environment_line() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  from gnmr_jax import versions as versions_lib  # pylint: disable=g-import-not-at-top
  found = versions_lib.versions(("jax", "flax", "optax", "orbax-checkpoint"))
  return (f"{versions_lib.describe(found)}, "
          f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})")


def _sections(text: str) -> dict:
  """'## title' -> the section's lines (title line included), in file order.

  A '## ' line inside a section's fenced output is the script's, not a title (until
  2026-12-07 such lines cut the saved-activation section short on every --only run).
  """
  out, current, fenced = {}, None, False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif line.startswith("## ") and not fenced:
      current = line[3:]
      out[current] = []
    if current is not None:
      out[current].append(line)
  return out


def run_section(title, cmd) -> list:
  print(f"running {' '.join(cmd)} ...", file=sys.stderr, flush=True)
  python = AOT_PYTHON if os.path.basename(cmd[0]).startswith("aot_") else sys.executable
  out = subprocess.run([python, *cmd], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, check=False)
  body = out.stdout.strip() if out.returncode == 0 else (
      f"FAILED (exit {out.returncode}):\n{out.stderr.strip()[-3000:]}")
  return [f"## {title}", "", f"`python {' '.join(cmd)}` ({datetime.date.today()}, "
          f"{platform.node()}, {os.cpu_count()} CPU cores; {environment_line()})", "", "```", body,
          "```", ""]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
  parser.add_argument("--only", default="",
                      help="rerun only the sections whose title contains this text and keep "
                           "the others of --out as they are")
  args = parser.parse_args()
  chosen = [(t, c) for t, c in SCRIPTS if args.only.lower() in t.lower()]
  if not chosen:
    raise SystemExit(f"--only {args.only!r} matches no section; titles: {[t for t, _ in SCRIPTS]}")
  lines = ["# Benchmarks", "",
           f"Generated by `python benchmarks/run_all.py` (last full run {datetime.date.today()}, "
           f"{platform.node()}, {os.cpu_count()} CPU cores; {environment_line()}).", "",
           "Every ratio is measured side by side in one run (interleaved), so machine noise "
           "hits both sides alike. No GPU numbers yet: none was lent to the sessions so far; "
           "`scripts/gpu_checks.sh` is the H200 run (all GPU checks in one call).", ""]
  old = {}
  if args.only and os.path.exists(args.out):
    with open(args.out, encoding="utf-8") as f:
      text = f.read()
    old = _sections(text)
    lines = text.split("\n## ", 1)[0].splitlines() + [""]
  for title, cmd in SCRIPTS:
    if (title, cmd) in chosen:
      lines += run_section(title, cmd)
    elif title in old:
      lines += old[title] + ([""] if old[title][-1] else [])
  with open(args.out, "w", encoding="utf-8") as f:
    f.write("\n".join(lines).rstrip() + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
