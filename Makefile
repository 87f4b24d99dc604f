# voltserve: `make serve` serves, `make test` tests. Both install what they need into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# On CPU machines take the CPU build of torch (pip would otherwise pull a multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
MODEL ?=
DEMO_MODEL ?= .cache/demo-model
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install serve test test-fast lint format check-kernels gpu-check clean

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
# checkout), then the rest; `make test` compiles the kernels while the rest is installed.
KERNEL_DEPS := "numba-cuda[cu12]>=0.30,<0.31" "numpy<2.5" cffi
$(VENV)/.kernel-deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_ENV) $(PIP) install -q uv || $(PIP_ENV) $(PIP) install -q --upgrade pip
	$(call pkg_install,"$(TORCH_SPEC)" $(KERNEL_DEPS))
	touch $@

$(VENV)/.installed: $(VENV)/.kernel-deps
	$(call pkg_install,-e '.[dev]')
	touch $@

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
	( env -u NUMBA_ENABLE_CUDASIM $(PY) -m voltserve.cli check-kernels --cc 7.0 \
	    --json $(CC70_DIR)/results.json --ptx-dir $(CC70_DIR)/ptx \
	    >$(CC70_DIR)/stdout 2>$(CC70_DIR)/stderr; echo $$? >$(CC70_DIR)/returncode ) &
	$(MAKE) --no-print-directory install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	VOLTSERVE_CC70_CHECK_DIR=$(CC70_DIR) $(PY) -m pytest -q -m "not gpu" $(PYTEST_PAR) --timeout 900 --durations=60

# While working: the same in parallel without the slow tests (the kernel compile check and the
# longest simulator and service runs). Not what CI runs: `make test` runs everything.
test-fast: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not gpu and not slow" $(PYTEST_PAR) --timeout 300

# Runs every GPU test and benchmark on a CUDA host; results land in OUT (default ./gpu-results).
gpu-check:
	bash scripts/gpu_check.sh $(or $(OUT),gpu-results)

clean:
	rm -rf $(VENV) .cache .pytest_cache
