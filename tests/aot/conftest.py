"""The AOT tier: programs compiled for TPU and GPU targets on this CPU host (gnmr_jax.aot).

It needs the compilers of the aot extra (`make aot-venv`); `make test` runs it in .venv-aot with
GNMR_AOT_REQUIRED=1, where a missing compiler fails instead of skipping.
"""

import os

import pytest

from gnmr_jax.aot import compile as compile_lib


def _missing() -> str | None:
  for platform in ('tpu', 'gpu'):
    try:
      compile_lib.check_install(platform)
    except compile_lib.AotSetupError as e:
      return str(e)
  return None


def pytest_collection_modifyitems(config, items):
  del config
  missing = _missing()
  if missing is None:
    return
  if os.environ.get('GNMR_AOT_REQUIRED') == '1':
    raise pytest.UsageError(f'GNMR_AOT_REQUIRED=1 but {missing}')
  skip = pytest.mark.skip(reason=f'AOT tier: {missing}')
  for item in items:
    if 'tests/aot/' in str(item.fspath).replace(os.sep, '/'):
      item.add_marker(skip)
