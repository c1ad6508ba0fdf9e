# `make demo` and `make test` work on a fresh clone: each sets up .venv first if needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo clean

setup: $(STAMP)

# torch is pinned and installed first: this machine carries the 2.13.0 CPU wheel on disk, while a looser
# requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest

demo: setup
	$(PY) -m printpress.demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
