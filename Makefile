# fbtrain: make install | train | quick | dev | test | lint | bench | bench-sample | gpu-check |
#          gpu-memory | clean
# Needs Python (3.10 or newer), make, and for the fast C++ core a C++ compiler (g++); the
# rest, ninja included, goes into $(VENV). Without a compiler fbtrain runs on its slower
# PyTorch core.
#
#   make train                                   # configs/tiny_shakespeare.yaml
#   make train CONFIG=configs/tiny.yaml DATA=input.txt
#   make quick                                   # the main job's model, 600 steps (~2 min)
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
# A value as one shell word, whatever it holds (DATA="my text.txt"): in '...', each ' as '\''.
shell_word = '$(subst ','\'',$(1))'

# Quiet: errors still print, the ~100 lines of progress and "already satisfied" do not.
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install dev train quick test lint bench bench-sample gpu-check gpu-memory clean distclean

# What training needs and nothing more; `make test` and `make lint` add the dev extra.
install: $(STAMP)

# Re-runs only when pyproject.toml changes (or the venv is gone): a second `make` is instant.
# pip is quiet (-q), so each phase says what it installs first: torch alone can take minutes.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || echo "make install: creating the virtual environment $(VENV) ($(PY) -m venv)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "make install: installing $(TORCH) from $(if $(TORCH_INDEX),$(TORCH_INDEX),PyPI (or a local index pip is set to)): a large download, can take minutes"
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH)'
	@echo "make install: installing fbtrain (editable) and its dependencies from pyproject.toml (typer, pyyaml, tensorboard, ...)"
	$(PIP) -e .
	@# Compile the C++ core now (once); without a compiler say so and go on (FBTRAIN_CORE).
	@echo "make install: loading fbtrain's C++ core (compiled on first use, about a minute)"
	$(BIN)/python -c 'from fbtrain.models.core.select import core; core()'
	touch $@

# pytest and ruff (the dev extra), on top of install.
dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "make dev: installing the dev extra from pyproject.toml (pytest, pytest-xdist, ruff)"
	$(PIP) -e '.[dev]'
	touch $@

# FBTRAIN_MAKE_TARGET: an interrupted run then says to run `make train` again to resume.
train: install
	FBTRAIN_MAKE_TARGET=train $(BIN)/fbtrain train --config $(CONFIG) --resume auto $(if $(DATA),--set $(call shell_word,data.path=$(DATA)))

# The tests whose numbers can move under torch's CPU dispatch (model, cores, training,
# evaluation, sampling, a legacy checkpoint's resume): `make test` runs them
# a second time with torch's kernels held to AVX2, as an AVX2-only CPU computes them (on an
# AVX-512 machine the softmax, for one, then differs in its low bits): a result checked
# against one computed another way (the C++ core, a float64 reference, a stored
# checkpoint) may then fall outside its tolerance. MKL_ENABLE_INSTRUCTIONS does the same
# for MKL's matmuls on an Intel CPU (MKL ignores it on an AMD one); the C++ core is
# compiled -mavx2 -mfma on every x86 machine, so it does not change (its ATen calls do).
# Left out of the second pass: the files whose checks compare a computation only with itself
# or hold no float result (checkpoint files and RNG streams, signals and locks, export
# copies, the programs' generator): the same there under any dispatch.
NUMERIC_TESTS := tests/test_models.py tests/test_cores.py tests/test_core_spec.py \
	tests/test_batches.py tests/test_train.py tests/test_evaluate.py tests/test_sample.py \
	tests/test_legacy_checkpoints.py
AVX2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
# Test processes (pytest-xdist), each with one torch thread: on two cores two processes
# of single-threaded tiny models keep both busy, where one process's threads mostly wait
# on each other. make test JOBS=8 on a larger machine.
JOBS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(JOBS) --dist worksteal

# See it work: the main job's model and data for 600 of its 1,500 steps (614,400 tokens),
# into runs/quick; it ends with a sample.
quick: install
	FBTRAIN_MAKE_TARGET=quick $(BIN)/fbtrain train --config configs/tiny_shakespeare.yaml --set train.max_steps=600 \
	    --set run.name=quick --resume auto $(if $(DATA),--set $(call shell_word,data.path=$(DATA)))

# Each pass ends with its 25 slowest tests (--durations) and, failing, says which it was.
test: dev
	@# The C++ core built (or loaded) once, before two processes would race to build it.
	$(BIN)/python -c 'from fbtrain.models.core.select import core; core()'
	@echo "make test: pass 1 of 2, every test"
	$(PYTEST) --durations=25 || { rc=$$?; echo "make test: pass 1 of 2 (every test) failed; pass 2 (AVX2) did not run"; exit $$rc; }
	@# Torch ignoring the setting would make the second pass a plain repeat: refuse that.
	@$(AVX2) $(BIN)/python -c 'import sys, torch; c = torch.backends.cpu.get_cpu_capability(); print("make test: pass 2 of 2, the numeric tests with dispatch held to", c); sys.exit(c == "AVX512")'
	$(AVX2) $(PYTEST) --durations=25 $(NUMERIC_TESTS) || { rc=$$?; echo "make test: pass 2 of 2 (the numeric tests held to AVX2) failed; pass 1 passed"; exit $$rc; }

lint: dev
	$(BIN)/ruff check .

bench: install
	$(BIN)/python scripts/benchmark.py

bench-sample: install
	$(BIN)/python scripts/bench_sample.py

# On a CUDA machine, the first GPU check (docs/performance.md, "First GPU check"): its
# sections' files into $(GPU_CHECK_DIR), within a hard 7-minute budget. It runs on the python
# that already imports torch - $(VENV)'s, else $(PY) (a lent GPU machine's own, which has no
# network for pip) - and only where neither does is `make dev` run first. The same without
# make: python3 scripts/gpu_check.py --out runs/gpu-check
GPU_CHECK_DIR ?= runs/gpu-check
gpu-check:
	@py=$(BIN)/python; $$py -c 'import torch' 2>/dev/null || py=$(PY); \
	$$py -c 'import torch' 2>/dev/null || { $(MAKE) dev && py=$(BIN)/python; }; \
	echo "$$py scripts/gpu_check.py --require-cuda --out $(GPU_CHECK_DIR)"; \
	$$py scripts/gpu_check.py --require-cuda --out $(GPU_CHECK_DIR) $(if $(DATA),--data $(call shell_word,$(DATA)))

# The peak device memory of one training step at each curriculum stage of $(CONFIG), on fake
# CUDA (scripts/fakecuda: no GPU needed, a C++ compiler is; minutes a stage at gpu.yaml's
# sizes). make gpu-memory CONFIG=configs/gpu.yaml BATCH=512
BATCH ?=
gpu-memory: install
	$(BIN)/python scripts/fakecuda/run.py memory --config $(CONFIG) \
	    $(if $(BATCH),--set train.batch_size=$(BATCH))

# Build and tool caches; keeps $(VENV) and runs/ (see distclean).
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

# Also removes the virtual environment (runs/ is never touched).
distclean: clean
	rm -rf $(VENV)
