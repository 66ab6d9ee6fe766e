"""The AOT tier: programs compiled for TPU and GPU targets on this CPU host (gnmr_jax.aot).

It needs the compilers of the aot extra (`make aot-venv`); `make test` runs it in .venv-aot with
GNMR_AOT_REQUIRED=1, where a missing compiler fails instead of skipping.
"""

import os

import jax
import pytest

from gnmr_jax.aot import compile as compile_lib

# Compile-only executables cannot be read back from jax's persistent cache (compile.py): no
# cache here, so an entry an older jax wrote never turns into a warning and a second compile.
jax.config.update('jax_enable_compilation_cache', False)

# The compiled programs' reports are cached instead (gnmr_jax/aot/program_cache.py), where
# tests/conftest.py puts them ($GNMR_AOT_CACHE_DIR beside jax's cache; none with
# GNMR_TEST_COMPILATION_CACHE=0): a warm run traces and lowers every step but compiles only
# what changed.
AOT_CACHE_BYTES = 1 << 30


def _prune(path, limit):
  """Oldest entries go past `limit` bytes (each code change adds entries)."""
  try:
    entries = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(path)]
  except OSError:
    return
  total = sum(size for _, size, _ in entries)
  for _, size, name in sorted(entries):
    if total <= limit:
      break
    try:
      os.remove(name)
      total -= size
    except OSError:
      pass


if os.environ.get('GNMR_AOT_CACHE_DIR'):
  _prune(os.environ['GNMR_AOT_CACHE_DIR'], AOT_CACHE_BYTES)


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
