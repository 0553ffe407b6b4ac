# fbtrain: make install | train | test | lint | bench | bench-sample | clean
# Needs Python (3.11), make, and g++ with ninja (for the C++ core); the rest goes into $(VENV).
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

.PHONY: install train test lint bench bench-sample clean distclean

install: $(STAMP)

# Re-runs only when pyproject.toml changes (or the venv is gone): a second `make` is instant.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH)'
	$(BIN)/python -m pip install -e '.[dev]'
	$(BIN)/python -c 'from fbtrain.models.feedback_core import native_ops; native_ops()'
	touch $@

train: install
	$(BIN)/fbtrain train --config $(CONFIG) --resume auto $(if $(DATA),--set data.path=$(DATA))

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python scripts/benchmark.py

bench-sample: install
	$(BIN)/python scripts/bench_sample.py

# Build and tool caches; keeps $(VENV) and runs/ (see distclean).
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

# Also removes the virtual environment (runs/ is never touched).
distclean: clean
	rm -rf $(VENV)
