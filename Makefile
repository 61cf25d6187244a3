# weightship: `make demo` runs the main job on embedded defaults; `make test` runs everything CI runs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PG_DIR ?= /tmp/weightship-test-pg-$(shell id -u)
PG_PORT ?= 54329

.PHONY: demo test lint unit venv clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Starts PostgreSQL for the run and always stops it again.
unit: $(STAMP)
	@set -e; url=$$(scripts/postgres.sh start $(PG_DIR) $(PG_PORT)); \
	trap 'scripts/postgres.sh stop $(PG_DIR)' EXIT; \
	WEIGHTSHIP_TEST_PG_URL=$$url $(BIN)/pytest $(PYTEST_ARGS)

test: lint unit

demo: $(STAMP)
	$(BIN)/python demo/demo.py

clean:
	rm -rf $(VENV) .weightship .pytest_cache .mypy_cache .ruff_cache
