"""Guard on compilations (optax's `log_compilations()` test, for the train loop): a run compiles
its train step once, and rebuilding the same config compiles nothing new once the persistent
compilation cache is warm. Fails when the step recompiles per call or per build (e.g. a Python
value that changes every step reaching the program as a constant), which is also what keeps the
suite fast."""
import os

import jax
import pytest

from gnmr_jax import train_loop
from gnmr_jax.data import make_data
from tests.train_helpers import CompileLog, tiny_run_config

STEPS = 8


@pytest.mark.plumbing  # counts compilations, not numerics: no XLA optimizations, as tiny_run
def test_train_step_compiles_once_per_run_and_a_rebuild_compiles_nothing(tmp_path, data_dirs):
  """Counts the programs jax hands to XLA (train_helpers.CompileLog: jax.monitoring's
  backend-compile event, named by the jitted function, and the persistent cache's hit event).

  1. train_and_evaluate for STEPS steps: the train step goes to XLA exactly once (compiled, or
     served by the persistent cache when another test compiled this config first); steps 2..8
     reuse the executable.
  2. A second build of the same config in this process: new closures, so jax traces and lowers
     them again and asks XLA once more, but the identical program is a persistent-cache hit:
     nothing at all is compiled for the init and the steps.
  """
  config = tiny_run_config(data_dirs)
  assert config.train.steps == STEPS
  data = make_data(config.data)
  with CompileLog() as first:
    summary = train_loop.train_and_evaluate(config, str(tmp_path / "run"), data=data,
                                            devices=jax.devices()[:1])
  assert summary["step"] == STEPS
  assert len(first.of("train_step")) == 1, f"the train step went to XLA more than once:\n{first}"
  assert len(first.of("eval_step")) == 1, str(first)

  if not jax.config.jax_compilation_cache_dir:
    pytest.skip("no persistent compilation cache (GNMR_TEST_COMPILATION_CACHE=0): the first "
                "part passed, the rebuild has nothing to hit")
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  batches = data.train_iterator()
  with CompileLog() as second, train_loop.sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(config.train.seed))
    for _ in range(3):
      state, metrics = run.train_step(state, train_loop.device_batch(run, next(batches)))
    jax.block_until_ready(metrics)
  assert len(second.of("train_step")) == 1, str(second)
  assert len(second.of("init_state")) == 1, str(second)
  compiled = [c for c in second.compiles if not c.persistent_cache_hit]
  assert not compiled, f"a rebuild of the same config compiled anew:\n{second}"


def test_the_machine_cache_is_pruned_oldest_first_to_half_its_bound(tmp_path):
  """conftest.prune_cache: past the bound, the oldest-written executables (and their atime
  files) go until half the bound is left; under it nothing is touched."""
  import conftest  # pylint: disable=g-import-not-at-top  (tests/conftest.py, already loaded)
  sizes = [300, 100, 200, 400, 50]  # written in this order, one second apart
  for i, size in enumerate(sizes):
    (tmp_path / f"jit_f-{i}-cache").write_bytes(b"x" * size)
    (tmp_path / f"jit_f-{i}-atime").write_bytes(b"t")
    os.utime(tmp_path / f"jit_f-{i}-cache", (1000 + i, 1000 + i))
  (tmp_path / "unrelated.txt").write_bytes(b"y" * 5000)
  assert conftest.prune_cache(str(tmp_path), 1050) == 0  # 1050 bytes held: at the bound
  # Over a bound of 1000: drop 300, 100, 200 (oldest first) to reach <= 500; 400 + 50 stay.
  assert conftest.prune_cache(str(tmp_path), 1000) == 3
  left = sorted(p.name for p in tmp_path.iterdir())
  assert left == ["jit_f-3-atime", "jit_f-3-cache", "jit_f-4-atime", "jit_f-4-cache",
                  "unrelated.txt"]



def test_the_machine_cache_drops_entries_a_killed_writer_truncated(tmp_path):
  """conftest.drop_unreadable_entries: an entry that does not decompress (jax writes in place and
  never rewrites a key) is deleted; whole entries and other files stay."""
  import zlib  # pylint: disable=g-import-not-at-top
  import conftest  # pylint: disable=g-import-not-at-top
  try:
    import zstandard  # pylint: disable=g-import-not-at-top
    compress = zstandard.ZstdCompressor().compress
  except ImportError:  # what jax uses then
    compress = zlib.compress
  whole = compress(b"\x00\x00\x00\x01" + b"executable bytes" * 100)
  (tmp_path / "jit_a-1-cache").write_bytes(whole)
  (tmp_path / "jit_b-2-cache").write_bytes(whole[:len(whole) // 2])
  (tmp_path / "notes.txt").write_bytes(b"not an entry")
  assert conftest.drop_unreadable_entries(str(tmp_path)) == 1
  assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_a-1-cache", "notes.txt"]
