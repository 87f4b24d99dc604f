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

.PHONY: install serve test lint format check-kernels gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
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

# The cc 7.0 compile of every kernel (`voltserve check-kernels --cc 7.0`) runs inside the suite:
# tests/kernels/test_check_kernels.py, which also checks that each registered signature compiled.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not gpu" --timeout 600

# Runs every GPU test and benchmark on a CUDA host; results land in OUT (default ./gpu-results).
gpu-check:
	bash scripts/gpu_check.sh $(or $(OUT),gpu-results)

clean:
	rm -rf $(VENV) .cache .pytest_cache
