"""Shared helpers for the train-loop tests: the seconds-long config with test data paths, and
plumbing runs without XLA optimizations."""
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top


def small_config(data, **overrides):
  """configs/tiny.py:runlocal without plots/TensorBoard, all devices on `data`.

  Args:
    data: (data_dir, sdist_path) from the `data_dirs` fixture, or a whole data ConfigDict.
    **overrides: 'group.field' -> value.
  """
  config = tiny.get_config("runlocal")
  if isinstance(data, tuple):
    config.data.data_dir, config.data.sdist_path = data
  else:
    config.data = data
  config.logging.plots = False
  config.logging.tensorboard = False
  config.mesh.fsdp = 1
  config.mesh.data = -1
  # The train-loop tests check the paper's rule (masks, detection): pin it rather than the
  # default priority ('norm').
  config.gnmr.priority = "gnmr"
  config.diagnostics.recovery_gap_every = 0
  for key, value in overrides.items():
    group, field = key.split(".")
    config[group][field] = value
  return config


# --- plumbing tests: no XLA optimizations ------------------------------------------------------

_FLAG = "jax_disable_most_optimizations"
_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"


@contextlib.contextmanager
def xla_optimizations(enabled: bool):
  """Runs the block with XLA's optimizations on or off (`jax_disable_most_optimizations`, as
  flax's lm1b train_test does), in this process and in the subprocesses it starts (the env var).

  For plumbing tests (resume, refusal, preemption, log files, fault detection): the tiny
  programs compile in about half the time and run about as fast. A test that compares two runs
  bit for bit must run both sides in one setting. The flag is part of the persistent cache key,
  but not of jax's in-memory caches, so a switch clears those: an executable compiled in one
  setting is never reused in the other.
  """
  import jax  # pylint: disable=g-import-not-at-top
  disable = not enabled
  previous = bool(jax.config.read(_FLAG))
  previous_env = os.environ.get(_ENV)
  if previous != disable:
    jax.clear_caches()
    jax.config.update(_FLAG, disable)
  os.environ[_ENV] = "1" if disable else "0"
  try:
    yield
  finally:
    if previous_env is None:
      os.environ.pop(_ENV, None)
    else:
      os.environ[_ENV] = previous_env
    if previous != disable:
      jax.clear_caches()
      jax.config.update(_FLAG, previous)
