"""Train a LLaMA-style model with GNMR.

  python train.py --config=configs/tiny.py --workdir=workdirs/tiny \
      --config.gnmr.max_o=5 --config.train.steps=200

Bad flags or config values end with one line naming what is wrong (exit 2), a run that
diverges (train.max_consecutive_nonfinite non-finite steps in a row) with one line after saving
its last good checkpoint (exit 3), SIGTERM with a checkpoint and exit 0; the training
loop itself lives in gnmr_jax.train_loop so notebooks run the same code.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from gnmr_jax import distributed, train_loop
from gnmr_jax.flag_parsing import flags_parser

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and plots go here.")
flags.mark_flags_as_required(["config", "workdir"])

USER_ERRORS = (ValueError, TypeError, KeyError, AttributeError, FileNotFoundError)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    distributed.maybe_initialize()
    summary = train_loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except USER_ERRORS as e:
    print(f"train.py: error: {e}", file=sys.stderr)
    sys.exit(2)
  except FloatingPointError as e:  # too many consecutive non-finite steps; checkpoint saved
    print(f"train.py: training diverged: {e}", file=sys.stderr)
    sys.exit(3)
  print(train_loop.format_summary(summary), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=flags_parser("train.py", USER_ERRORS))
