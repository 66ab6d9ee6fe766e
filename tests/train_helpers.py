"""Shared helpers for the train-loop tests: the seconds-long config with test data paths, the
one shared trained run (`tiny_run` in conftest.py), plumbing runs without XLA optimizations, and
a compilation counter."""
import collections
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
  # The train-loop tests check the paper's rule (masks, detection) at the paper's thresholds,
  # which fire within 8 steps: pinned rather than the config default (the same rule at alpha 4 /
  # beta 3, t_lock 2, a transient alarm that mostly leaves the mask empty).
  config.gnmr.update(priority="gnmr", alpha=2.0, beta=1.5, t_lock=5)
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


# --- the shared trained run ----------------------------------------------------------------------

TinyRun = collections.namedtuple("TinyRun", "config data workdir summary")


def tiny_run_config(data, **overrides):
  """The config of the shared run: small_config's 8 steps on one device, every step logged, a
  checkpoint every 2 steps (the last 3 kept), no intermediate eval. Tests that resume it or
  rerun part of it (stop_at) use this config, so their train step is the same program (a
  persistent-cache hit); other train.steps values change the LR schedule, so another program."""
  return small_config(data, **{"logging.log_every": 1, "train.eval_every": 0,
                               "checkpoint.every_steps": 2, "checkpoint.max_to_keep": 3,
                               **overrides})


def train_tiny_run(data_dirs, workdir):
  """Trains tiny_run_config for its 8 steps on one device, without XLA optimizations (its readers
  are plumbing tests that compare against it bit for bit in that setting)."""
  import jax  # pylint: disable=g-import-not-at-top
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  config = tiny_run_config(data_dirs)
  data = make_data(config.data)
  with xla_optimizations(False):
    summary = train_loop.train_and_evaluate(config, workdir, data=data, devices=jax.devices()[:1])
  assert summary["step"] == config.train.steps and summary["resumed_from_step"] == 0, summary
  return TinyRun(config, data, workdir, summary)


# --- counting compilations -------------------------------------------------------------------

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

Compile = collections.namedtuple("Compile", "fun_name persistent_cache_hit seconds")


class CompileLog:
  """Records every XLA backend compilation in a block (like optax's test_utils.log_compilations,
  but from jax.monitoring events instead of log text).

  jax 0.10.2 records BACKEND_COMPILE_EVENT (with the jitted function's name as `fun_name`) each
  time it hands a lowered program to the backend: on the first call of a jitted function for
  given shapes and shardings, never on a call served by jax's in-memory caches. Inside it, the
  persistent compilation cache records CACHE_HIT_EVENT when it serves the executable from disk;
  otherwise XLA compiles it. So `compiles` counts programs handed to XLA per function name, and
  `persistent_cache_hit` says whether XLA actually compiled them. Usage:
  `with CompileLog() as log: ...`, then `log.of("train_step")`.
  """

  def __init__(self):
    self.compiles = []
    self._hit = False

  def _on_event(self, event, **kwargs):
    del kwargs
    if event == CACHE_HIT_EVENT:
      self._hit = True

  def _on_duration(self, event, seconds, **kwargs):
    if event == BACKEND_COMPILE_EVENT:
      self.compiles.append(Compile(str(kwargs.get("fun_name")), self._hit, seconds))
      self._hit = False

  def __enter__(self):
    import jax  # pylint: disable=g-import-not-at-top
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def __exit__(self, *exc):
    import jax  # pylint: disable=g-import-not-at-top
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)

  def of(self, name):
    """The compilations of the jitted functions whose name contains `name`."""
    return [c for c in self.compiles if name in c.fun_name]

  def __str__(self):
    return "\n".join(
        f"{c.fun_name}: {'persistent cache hit' if c.persistent_cache_hit else 'compiled'} "
        f"({c.seconds:.2f} s)" for c in self.compiles) or "no compilations"
