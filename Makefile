# Both targets set everything up on a fresh machine: .venv, install, data preparation.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/tiny
CONFIG ?= configs/tiny.py

.PHONY: train test venv bench clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py --config=$(CONFIG) --workdir=$(WORKDIR)

# Two workers, one file each at a time, longest files first (tests/conftest.py: SECONDS).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/controller_overhead.py

clean:
	rm -rf $(VENV) workdirs
