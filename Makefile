# voltserve: `make serve` serves, `make test` tests. Both install what they need into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# -P: the working directory (the checkout's root, whose kernels/, shared/ and services/ folders
# would shadow packages of those names) is never put on sys.path.
PYTEST := $(PY) -P -m pytest
# Exact versions of everything `make` installs: requirements/cpu.lock on a machine without
# `nvidia-smi` (torch's CPU build, which pip would otherwise replace by a multi-GB CUDA build),
# requirements/cuda.lock with one. `make lock` writes both from pyproject.toml's ranges.
LOCK ?= requirements/$(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu).lock
UV_VERSION := 0.13.9
MODEL ?=
DEMO_MODEL ?= .cache/demo-model
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install serve test test-fast test-latest lock lint format check-kernels gpu-check clean

# Bytecode is compiled by the first import instead of by pip (PIP_NO_COMPILE): pip would compile
# every file of torch, transformers and their dependencies, most of which no test imports.
PIP_ENV := PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_COMPILE=1 PIP_PROGRESS_BAR=off
# The packages are installed by uv where it installs (pip puts it in the venv first): on a machine
# with no cache, pip fetches the ~1 GB one file after another, uv several at a time. Where uv
# cannot be installed, pip installs the same specs. uv reads no pip configuration, so the
# find-links folders and constraint files that pip is configured with (a torch wheel on disk)
# are passed to it; like PIP_NO_COMPILE, uv compiles no bytecode.
UV := $(VENV)/bin/uv
UV_ENV := UV_NO_PROGRESS=1 UV_PYTHON_DOWNLOADS=never
# $(call pip_setting,KEY): the values of KEY in pip's configuration files and PIP_* variables.
pip_setting = $(sort $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$(1)='\(.*\)'$$/\1/p"))
UV_OPTS = $(foreach d,$(call pip_setting,find-links),--find-links $(d)) \
	$(foreach c,$(call pip_setting,constraint),--constraint $(c))
# $(call pkg_install,SPECS): uv when the venv has a working one, else pip.
pkg_install = if $(UV) --version >/dev/null 2>&1; then \
	$(UV_ENV) $(UV) pip install -q --python $(PY) $(UV_OPTS) $(1); \
	else $(PIP_ENV) $(PIP) install -q $(1); fi
# Two steps: first what the kernels import (enough for `voltserve check-kernels` run from the
# checkout), then the rest; `make test` compiles the kernels while the rest is installed. Both
# take their versions from the lock; voltserve itself goes in with the first, editable and
# without dependencies (the lock holds them all, so nothing unlocked can come in with it), so the
# compile check imports it as `voltserve.*` from the install, not from the working directory.
# LATEST=1 (`make test-latest`) installs the newest release of every dependency within
# pyproject.toml's ranges instead, torch excepted (its CPU build is not on PyPI).
KERNEL_DEPS := torch numba-cuda[cu12] numpy cffi
LOCKED_TORCH = $(shell grep '^torch==' $(LOCK))
ifeq ($(LATEST),1)
KERNEL_SPECS = --upgrade "$(LOCKED_TORCH)" $(KERNEL_DEPS)
PROJECT_SPECS = --upgrade "$(LOCKED_TORCH)" -e '.[dev]'
INSTALLED_FROM = newest releases
else
KERNEL_SPECS = -c $(LOCK) $(KERNEL_DEPS)
PROJECT_SPECS = -r $(LOCK)
INSTALLED_FROM = $(LOCK)
endif
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP_ENV) $(PIP) install -q uv==$(UV_VERSION) || $(PIP_ENV) $(PIP) install -q --upgrade pip

$(VENV)/.kernel-deps: pyproject.toml $(LOCK) | $(PY)
	$(call pkg_install,$(KERNEL_SPECS))
	$(call pkg_install,--no-deps -e .)
	touch $@

$(VENV)/.installed: $(VENV)/.kernel-deps
	$(call pkg_install,$(PROJECT_SPECS))
	echo "$(INSTALLED_FROM)" >$@

install: $(VENV)/.installed

$(DEMO_MODEL)/config.json: | install
	$(VENV)/bin/voltserve make-demo-model $(DEMO_MODEL)

ifeq ($(MODEL),)
serve: install $(DEMO_MODEL)/config.json
	$(VENV)/bin/voltserve serve --model $(DEMO_MODEL) --served-model-name demo-model --port $(PORT) $(SERVE_ARGS)
else
serve: install
	$(VENV)/bin/voltserve serve --model $(MODEL) --port $(PORT) $(SERVE_ARGS)
endif

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

check-kernels: install
	$(VENV)/bin/voltserve check-kernels --cc 7.0

# CI runs `make test`: lint, then every non-GPU test spread over the CPUs (pytest-xdist). The
# cc 7.0 compile of every kernel (`voltserve check-kernels --cc 7.0`) runs inside the suite,
# first (tests/kernels/conftest.py); loadgroup keeps tests that share a fixture on one worker
# and the collection order (tests/conftest.py puts the long work first) is the schedule.
PYTEST_PAR ?= -n auto --dist loadgroup --no-loadscope-reorder
# The compile check starts as soon as the kernels' packages are in, in the background, while the
# rest is installed (tests/kernels/conftest.py waits for its folder).
CC70_DIR := .cache/cc70-check
test: $(VENV)/.kernel-deps
	rm -rf $(CC70_DIR) && mkdir -p $(CC70_DIR)
	( env -u NUMBA_ENABLE_CUDASIM $(PY) -P -m voltserve.cli check-kernels --cc 7.0 \
	    --json $(CC70_DIR)/results.json --ptx-dir $(CC70_DIR)/ptx \
	    >$(CC70_DIR)/stdout 2>$(CC70_DIR)/stderr; echo $$? >$(CC70_DIR)/returncode ) &
	$(MAKE) --no-print-directory install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	VOLTSERVE_CC70_CHECK_DIR=$(CC70_DIR) $(PYTEST) -q -m "not gpu" $(PYTEST_PAR) --timeout 900 --durations=60

# The suite against the newest release of every dependency, in a venv of its own: run it to see
# the next upstream break the day it ships, before it reaches the lock. Not part of `make test`.
test-latest:
	rm -rf .cache/venv-latest
	$(MAKE) --no-print-directory test VENV=.cache/venv-latest LATEST=1

# Rewrites both locks from pyproject.toml's ranges (the newest releases within them), for Python
# 3.11 on x86-64 Linux. cpu.lock takes torch's CPU build of CPU_TORCH from where pip is
# configured to find it (find-links), written without its +cpu label so that the pin resolves on
# a machine without that file too. cuda.lock takes PyPI's newest CUDA 12 build of torch
# (numba-cuda[cu12] rules out the CUDA 13 ones) and the NVIDIA libraries it pins.
CPU_TORCH := torch==2.13.0
LOCK_COMPILE = $(UV_ENV) $(UV) pip compile -q pyproject.toml --extra dev --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"
lock: | $(PY)
	mkdir -p .cache && echo "$(CPU_TORCH)" >.cache/cpu-torch.txt
	$(LOCK_COMPILE) $(UV_OPTS) -c .cache/cpu-torch.txt -o requirements/cpu.lock
	sed -i 's/^\(torch==[^+]*\)+cpu$$/\1/' requirements/cpu.lock
	! grep -q '^nvidia-cublas' requirements/cpu.lock || \
	    { echo "cpu.lock took torch's CUDA build: point pip's find-links at the CPU wheel" >&2; exit 1; }
	$(LOCK_COMPILE) -o requirements/cuda.lock

# While working: the same in parallel without the slow tests (the kernel compile check and the
# longest simulator and service runs). Not what CI runs: `make test` runs everything.
test-fast: install
	$(VENV)/bin/ruff check .
	$(PYTEST) -q -m "not gpu and not slow" $(PYTEST_PAR) --timeout 300

# Runs every GPU test and benchmark on a CUDA host; results land in OUT (default ./gpu-results).
gpu-check:
	bash scripts/gpu_check.sh $(or $(OUT),gpu-results)

clean:
	rm -rf $(VENV) .cache .pytest_cache
