# fbtrain: make install | train | dev | test | lint | bench | bench-sample | gpu-check | clean
# Needs Python (3.10 or newer), make, and for the fast C++ core a C++ compiler (g++); the
# rest, ninja included, goes into $(VENV). Without a compiler fbtrain runs on its slower
# PyTorch core.
#
#   make train                                   # configs/tiny_shakespeare.yaml
#   make train CONFIG=configs/tiny.yaml DATA=input.txt
#   make test

PY ?= python3
VENV ?= .venv
DATA ?=
CONFIG ?= configs/tiny_shakespeare.yaml
# torch is installed first and pinned: a bare `pip install torch` can pull a multi-GB CUDA
# build. For the CPU-only wheel elsewhere: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install dev train test lint bench bench-sample gpu-check clean distclean

# What training needs and nothing more; `make test` and `make lint` add the dev extra.
install: $(STAMP)

# Re-runs only when pyproject.toml changes (or the venv is gone): a second `make` is instant.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH)'
	$(BIN)/python -m pip install -e .
	@# Compile the C++ core now (once); without a compiler say so and go on (FBTRAIN_CORE).
	$(BIN)/python -c 'from fbtrain.models.core.select import core; core()'
	touch $@

# pytest and ruff (the dev extra), on top of install.
dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

train: install
	$(BIN)/fbtrain train --config $(CONFIG) --resume auto $(if $(DATA),--set data.path=$(DATA))

test: dev
	$(BIN)/python -m pytest

lint: dev
	$(BIN)/ruff check .

bench: install
	$(BIN)/python scripts/benchmark.py

bench-sample: install
	$(BIN)/python scripts/bench_sample.py

# On a CUDA machine: tests, exactness, benchmarks, a short training run, sampling and
# profiling in one report (at most about 8 minutes); elsewhere a toy run on the CPU.
gpu-check: dev
	$(BIN)/python scripts/gpu_check.py --require-cuda $(if $(DATA),--data $(DATA))

# Build and tool caches; keeps $(VENV) and runs/ (see distclean).
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

# Also removes the virtual environment (runs/ is never touched).
distclean: clean
	rm -rf $(VENV)
