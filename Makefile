# Quick start: `make demo` and `make test`. Both build .venv on a fresh machine first.
# `make demo` installs only what the demo needs (torch and txckpt's own dependencies);
# `make test` (and `make venv`, which .ci/run calls) adds the test and bench extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

VENV4 := .venv-tf4
PY4 := $(VENV4)/bin/python
STAMP4 := $(VENV4)/.installed

.PHONY: venv demo test test-fast campaign typecheck lint check bench bench-quick reliability clean format-check

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

# The three tiers (tests/harness/tiers.py says which marker puts a test where):
#   test-fast  in-process only, no child process, server or real Trainer: the inner loop (< 2 min)
#   test       everything but the long campaigns: what every change runs (< 15 min here)
#   campaign   reliability campaign, crash sweeps, DeepSpeed, GCS/Azure rows, and the Trainer
#              tests again on transformers 4.57 in a venv of their own (< 25 min here)
test-fast: $(STAMP)
	$(PY) -m pytest -q -rs --tier fast $(PYTEST_ARGS)

# `make test` runs on TEST_JOBS pytest-xdist workers (each test whole in one worker; `TEST_JOBS=0`
# runs in one process). Its time is mostly child processes importing torch and transformers, one
# core each: two workers use both cores of these machines.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=25 --tier test -n $(TEST_JOBS) $(PYTEST_ARGS)

$(STAMP4): pyproject.toml
	$(PYTHON) -m venv $(VENV4)
	$(PY4) -m pip install -q --upgrade pip
	$(PY4) -m pip install -q $(TORCH)
	$(PY4) -m pip install -q -e '.[test]' 'transformers==4.57.*' $(TORCH)
	touch $(STAMP4)

# The campaign tier runs in two steps. First the reliability campaign (tests/test_reliability.py)
# alone: its module fixture runs its cases two at a time itself (~1.2 cores busy, measured), and on
# an xdist worker beside the other worker's sweeps it passed its 900 s timeout (clean-clone trial
# at fee55cb). Then the rest on TEST_JOBS xdist workers (--dist worksteal: a few tests take
# minutes, and an idle worker takes queued tests from the busy one). Both steps draw from one sweep
# seed (TXCKPT_SWEEP_SEED, from the clock unless given; tests/harness/sampling.py), printed in each
# summary; the second runs even when the first failed, and PYTEST_ARGS goes to both. The Trainer
# tests on transformers 4.57 after them are `make test`'s own, on TEST_JOBS workers too. (Run beside
# the reliability campaign on one worker, clean-clone trial at 551067e, they took 10 min 14 s and
# stretched the reliability campaign from 4 min 44 s to 8 min 3 s: 2 min more than one after the
# other.)
campaign: $(STAMP) $(STAMP4)
	export TXCKPT_SWEEP_SEED="$${TXCKPT_SWEEP_SEED:-$$(date +%N | cut -c1-6)}"; \
	$(PY) -m pytest -q -rs --durations=5 --tier campaign tests/test_reliability.py $(PYTEST_ARGS); first=$$?; \
	$(PY) -m pytest -q -rs --durations=25 --tier campaign -n $(TEST_JOBS) --dist worksteal \
		--ignore=tests/test_reliability.py $(PYTEST_ARGS) && exit $$first
	$(PY4) -c "import transformers; print('transformers', transformers.__version__)"
	$(PY4) -m pytest -q -rs --durations=10 -m "trainer and not lightning" -n $(TEST_JOBS) $(PYTEST_ARGS)

typecheck: $(STAMP)
	$(PY) -m mypy

# The linter ([tool.ruff.lint] in pyproject.toml says which rules and why) over everything Python.
LINT_PATHS := txckpt tests benchmarks emulators
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)

# `make check`: what to run before a commit (.pre-commit-config.yaml runs the same on each commit):
# the linter, the type checker and `ruff format --check` ([tool.ruff.format]; the tree was
# formatted in one commit of its own, so a diff shows what changed, not how it is laid out).
# FORMAT_CHECK=0 leaves the format check out (a work in progress, before `ruff format`).
FORMAT_CHECK ?= 1
check: lint typecheck
ifeq ($(FORMAT_CHECK),1)
check: format-check
endif

format-check: $(STAMP)
	$(PY) -m ruff format --check $(LINT_PATHS)

bench: $(STAMP)
	$(PY) -m benchmarks run

bench-quick: $(STAMP)
	$(PY) -m benchmarks run --quick

reliability: $(STAMP)
	$(PY) -m tests.reliability

clean:
	rm -rf $(VENV) $(VENV4) build *.egg-info
