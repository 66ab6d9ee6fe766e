# Both targets set everything up on a fresh machine: .venv, install, data preparation.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/tiny
CONFIG ?= configs/tiny.py

# The deviceless AOT compilers (libtpu, the CUDA PJRT plugin and ptxas) live in .venv-aot, which
# also sees .venv's packages through a .pth file: plain CPU runs in .venv never load libtpu.
AOT_VENV := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed
TARGET ?= h100

.PHONY: train test venv bench clean aot aot-venv docs

# uv installs the locks (same versions as pip resolves, checked 2026-12-07) in ~10 s where pip
# took ~70 s on 2 cores: parallel, no bytecode compilation, and a per-machine cache (~/.cache/uv)
# that makes a fresh clone's set-up a few seconds.
UV_VERSION := 0.13.10
UV := $(BIN)/uv

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(UV) pip install -q --python $(BIN)/python -r requirements.lock
	$(UV) pip install -q --python $(BIN)/python --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

$(AOT_STAMP): $(STAMP) requirements-aot.lock
	test -x $(AOT_VENV)/bin/python || $(PY) -m venv --without-pip $(AOT_VENV)  # uv installs into it
	$(AOT_VENV)/bin/python scripts/aot_venv_link.py "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(UV) pip install -q --python $(AOT_VENV)/bin/python --no-deps -r requirements-aot.lock
	touch $(AOT_STAMP)

aot-venv: $(AOT_STAMP)

# make aot CONFIG=configs/llama.py:1b TARGET=v5e-4 ARGS='--config.mesh.fsdp=-1 --json=aot.json'
aot: $(AOT_STAMP)
	$(AOT_VENV)/bin/python -m gnmr_jax.aot --config=$(CONFIG) --target=$(TARGET) $(ARGS)

train: $(STAMP)
	$(BIN)/python train.py --config=$(CONFIG) --workdir=$(WORKDIR)

# Two workers, one file each at a time, longest files first (tests/conftest.py: SECONDS), the
# CPU programs compiled without XLA's optimizations (docs/guides/pipeline.md, "The test suite");
# then the AOT tier (optimized programs compiled for TPU and GPU targets) in .venv-aot.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on
# these machines): the suite starts ~40 Python processes (two workers, train.py, notebooks,
# doctests, scripts), and without .pyc files each one compiled jax, flax, optax, orbax and
# TensorFlow from source again (~3 s each in a fresh clone's new .venv: 4.6 s to import
# train.py and TFDS without them, 1.9 s with).
BYTECODE := env -u PYTHONDONTWRITEBYTECODE
test: $(STAMP) $(AOT_STAMP)
	$(BYTECODE) JAX_DISABLE_MOST_OPTIMIZATIONS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 \
	    --ignore=tests/aot tests
	$(BYTECODE) GNMR_AOT_REQUIRED=1 $(AOT_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10 \
	    tests/aot

# The documentation site (docs/conf.py): guides, notebooks as committed, API reference from the
# docstrings; warnings are errors, as in tests/test_docs_build.py.
docs: $(STAMP)
	$(BIN)/python -m sphinx -q -W --keep-going -c docs -b html . docs/_build/html
	@echo "docs/_build/html/index.html"

bench: $(STAMP)
	$(BIN)/python benchmarks/controller_overhead.py

clean:
	rm -rf $(VENV) $(AOT_VENV) workdirs
