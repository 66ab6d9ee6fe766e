"""Compile a config's steps for an accelerator, with no accelerator:

  .venv-aot/bin/python -m gnmr_jax.aot --config=configs/llama.py:1b --target=h100 \
      --config.precision.low_cost_path=fp8 --json=aot.json

Prints per step: memory per device and whether it fits, compile seconds, GEMMs by operand and
result dtype, conditionals, loops and collectives. Exit 0 when every step fits, 3 when one does
not (the report says which, and --fit_batch finds the largest batch that fits), 2 on bad input
or a missing install.

--fit chooses how the config's global batch trains on the target: the train step compiled over
gradient accumulation and remat policies, each with its memory and modelled tokens/s, and the
fastest that fits with the config overrides to use (gnmr_jax/aot/fit.py).

--step_time adds the train step's price on paper (gnmr_jax.aot.step_time: step seconds, tokens/s
and MFU per device, where the time goes, the calibration it rests on); a model output, so it is
asked for rather than printed beside what the compiler reports.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import report as report_lib
from gnmr_jax.aot import targets as targets_lib
from gnmr_jax.flag_parsing import flags_parser

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a configs/*.py file.',
                                          lock_config=True)
_TARGET = flags.DEFINE_string('target', None, 'Accelerator: ' + ', '.join(
    targets_lib.target_names()))
_STEPS = flags.DEFINE_list('steps', list(compile_lib.STEPS), 'Steps to compile.')
_JSON = flags.DEFINE_string('json', None, 'Also write the report here as JSON.')
_FIT_BATCH = flags.DEFINE_bool(
    'fit_batch', False, 'When the config\'s batch does not fit, halve it until it does and '
    'report the largest batch that fits.')
_FIT = flags.DEFINE_bool(
    'fit', False, 'Choose how the config\'s global batch trains on the target: compile the '
    'train step over (gradient accumulation, remat) combinations that keep the batch and print '
    'each one\'s memory and modelled tokens/s, and the fastest that fits with its overrides '
    '(gnmr_jax/aot/fit.py).')
_FIT_REMAT = flags.DEFINE_list(
    'fit_remat', ['none', 'dots_saveable', 'full'], 'With --fit: the remat policies to try, '
    'cheapest recomputation first.')
_STEP_TIME = flags.DEFINE_bool(
    'step_time', False, 'Also price the train step with the roofline step-time model: '
    'seconds, tokens/s and MFU per device, where the time goes, the calibration it rests on '
    '(a target without a device spec says so).')
flags.mark_flags_as_required(['config', 'target'])

USER_ERRORS = (ValueError, TypeError, KeyError, AttributeError, FileNotFoundError,
               compile_lib.AotSetupError)
EXIT_DOES_NOT_FIT = 3


def compile_fitting(config, target: str, steps, fit_batch: bool,
                    step_time: bool = False) -> dict:
  """compile_config, then (with fit_batch) halving the batch while a step does not fit."""
  report = compile_lib.compile_config(config, target, steps, step_time=step_time)
  if not fit_batch or compile_lib.fits(report):
    return report
  first, config = report, config.copy_and_resolve_references()
  while not compile_lib.fits(report) and config.data.batch_size % 2 == 0:
    config.data.batch_size //= 2
    try:
      report = compile_lib.compile_config(config, target, steps, step_time=step_time)
    except ValueError:  # the batch no longer divides over the mesh
      break
  first['largest_fitting_batch'] = (config.data.batch_size if compile_lib.fits(report)
                                    else None)
  first['fitting_report'] = report if compile_lib.fits(report) else None
  return first


def _fit_or_compile() -> tuple[dict, str, bool]:
  """(the JSON result, its text, whether it fits) of --fit, or of the compile report."""
  if _FIT.value:
    from gnmr_jax.aot import fit as fit_lib  # pylint: disable=g-import-not-at-top
    result = fit_lib.fit(_CONFIG.value, _TARGET.value, remats=tuple(_FIT_REMAT.value),
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    return result, fit_lib.format_fit(result), result['chosen'] is not None
  report = compile_fitting(_CONFIG.value, _TARGET.value, _STEPS.value, _FIT_BATCH.value,
                           _STEP_TIME.value)
  text = report_lib.format_report(report)
  if 'largest_fitting_batch' in report:
    found = report['largest_fitting_batch']
    text += '\n' + (f'largest batch that fits: {found}' if found else
                    'no batch down to the smallest the mesh divides fits')
  return report, text, compile_lib.fits(report)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  try:
    result, text, fits = _fit_or_compile()
  except USER_ERRORS as e:
    print(f'gnmr_jax.aot: error: {e}', file=sys.stderr)
    sys.exit(2)
  print(text)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(result, f, indent=1, sort_keys=True)
  if not fits:
    sys.exit(EXIT_DOES_NOT_FIT)


if __name__ == '__main__':
  app.run(main, flags_parser=flags_parser('gnmr_jax.aot', USER_ERRORS))
