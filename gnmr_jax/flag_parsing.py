"""absl flag parsing for the command lines (train.py, python -m gnmr_jax.aot): bad flags or
config overrides end with one line naming what is wrong and exit 2, not a traceback."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from absl import flags


def flags_parser(prog: str, user_errors: tuple) -> Callable[[Sequence[str]], list]:
  """An ``app.run(main, flags_parser=...)`` parser that prints `prog: <error>` and exits 2."""

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      print(f'{prog}: {e}', file=sys.stderr)
      sys.exit(2)
    except user_errors as e:  # config_flags reports unknown --config.* keys this way
      print(f'{prog}: bad --config override: {e}'.replace('\\n', ' '), file=sys.stderr)
      sys.exit(2)

  return parse
