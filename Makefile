# Quick start: `make demo` and `make test`. Both build .venv on a fresh machine first.
# `make demo` installs only what the demo needs (torch and txckpt's own dependencies);
# `make test` (and `make venv`, which .ci/run calls) adds the test and bench extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: venv demo test test-fast typecheck bench bench-quick reliability clean

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on these machines; a bare `torch` pulls a multi-GB CUDA build.
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e . $(TORCH)
	touch $(BASE)

$(STAMP): $(BASE) pyproject.toml
	$(PY) -m pip install -e '.[test,bench]' $(TORCH)
	touch $(STAMP)

venv: $(STAMP)

demo: $(BASE)
	$(PY) -m txckpt.demo

test: $(STAMP)
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m benchmarks run

bench-quick: $(STAMP)
	$(PY) -m benchmarks run --quick

reliability: $(STAMP)
	$(PY) -m tests.reliability

clean:
	rm -rf $(VENV) build *.egg-info
