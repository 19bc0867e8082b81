# Everything runs from .venv, built from pyproject.toml on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench stubs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# pytest exits 5 when it collected nothing; that is a failure here, not a pass.
test: lint
	$(BIN)/pytest; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests" >&2; exit 1; fi; exit $$rc

# A real coordinator on a free local port and simulated engines against it,
# with every fault on; under a minute, ending with a summary (leaked: 0).
demo: $(STAMP)
	$(BIN)/handoff demo

# The service benchmark (bench/service.py): about 20 minutes, 10 of them the soak.
bench: $(STAMP)
	$(BIN)/python -m bench.service

stubs: $(STAMP)
	$(BIN)/python -m handoff_server.stubs --write

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
