"""`gnmr_jax` command: `gnmr_jax plot WORKDIR [WORKDIR ...]` draws loss curves and recovery heatmaps."""

from __future__ import annotations

import argparse
import os
import sys

from gnmr_jax import plots


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="gnmr_jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  plot = sub.add_parser("plot", help="write PNG plots of run directories")
  plot.add_argument("workdirs", nargs="+")
  plot.add_argument("--compare", default="", help="also write a loss comparison PNG here")
  args = parser.parse_args(argv)
  for workdir in args.workdirs:
    if not os.path.isdir(workdir):
      print(f"gnmr_jax plot: {workdir} is not a directory", file=sys.stderr)
      return 2
    for name, path in plots.plot_run(workdir).items():
      print(f"{name}: {path}")
  if args.compare:
    runs = {os.path.basename(w.rstrip("/")): w for w in args.workdirs}
    print(f"comparison: {plots.plot_losses(runs, args.compare, 'loss comparison')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
