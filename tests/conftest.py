"""Shared fixtures: real gateway processes on loopback, started with `tandem serve`.

Each fixture writes a TOML config, starts the real CLI in a subprocess on a free
port and waits for /health/ready, so the tests talk to exactly what a user runs.
"""

from __future__ import annotations

import os

# llama.cpp's and torch's OpenMP threads wait for each other at every barrier and by default spin there first. The
# suite runs several such processes on two cores (a gateway's device, its embedded cloud, llama-server, workers), and
# when anything else also wants the cores a spinning thread holds the one the thread it waits for needs: with one
# other busy process on the box, test_openai_sdk.py took 134 s spinning and 34 s passive. Alone on a quiet box,
# passive waiting costs decode speed instead (`tandem bench device`: 48 -> 30 tok/s, BENCHMARKS.md), which is why
# the product keeps the default; the whole suite, mostly several processes at once, came out ahead (clean `make
# test`: 13 min 35 s for 1354 tests against 13 min 46 s for 1317 spinning), and `make test` now runs two pytest
# processes (BENCHMARKS.md, "The suite's time": two modules took 86 s passive, 224 s spinning 30,000 times under
# load). The servers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One OpenMP thread per process (llama.cpp's and torch's, the servers' included): three pytest processes and their
# servers share two cores, so a second thread in each only adds barriers. The gateway modules on the session's
# gateway, side by side: 19,004 against 20,226 busy ticks, 105 against 109 s (BENCHMARKS.md, "The suite's time",
# session 24); no oracle depends on the thread count (the whole suite passes either way).
os.environ.setdefault("OMP_THREAD_LIMIT", "1")
# ... and torch told so: with the limit at 1 but torch's intra-op pool at its default (the cores), oneDNN's bfloat16
# matrix products split their work for two threads that never both run, and half the result is garbage (NaN in a
# plain bf16 matmul on an AVX512-BF16 CPU; HAT's int8 heads and the privacy bench's shortlist use bf16). Torch's
# default of one thread matches the limit.
os.environ.setdefault("OMP_NUM_THREADS", "1")


import atexit
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.launcher import GatewayProcess, ServerProcess, start_gateway, start_llama_server, stop_gateway, stop_server
from deploy.models import model_path
from tests.integration.browser_helpers import require_browser
from tests.integration.otlp_receiver import OTLPReceiver
from tests.integration.scripted_upstream import ScriptedUpstream
from tests.integration.store_helpers import StoreServer


def _hermetic_user_dirs() -> None:
    """No test reads or writes the user's home, state, config or cache directories, but the read-only caches of
    the bundled models, the built binaries and the agent CLIs: those three are pinned where the user's environment
    puts them, then HOME and the XDG base directories move to a folder of this run (a budget saved by the user's own
    gateway, a prompt cache, a CLI's settings stay out of every result). Every process the suite starts inherits
    it; pytest-xdist's workers take their controller's folder (TANDEM_TEST_HOME)."""
    if os.environ.get("TANDEM_TEST_HOME"):
        return
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    for variable, folder in (
        ("TANDEM_MODEL_DIR", "models"),
        ("TANDEM_BIN_DIR", "bin"),
        ("TANDEM_AGENTS_DIR", "agents"),
    ):
        os.environ.setdefault(variable, os.path.join(cache, "tandem", folder))
    home = tempfile.mkdtemp(prefix="tandem-test-home-")
    atexit.register(shutil.rmtree, home, True)
    os.environ["TANDEM_TEST_HOME"] = os.environ["HOME"] = home
    for variable, folder in (("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config"), ("XDG_CACHE_HOME", "cache")):
        os.environ[variable] = os.path.join(home, folder)
        os.makedirs(os.environ[variable])


_hermetic_user_dirs()

_RESERVED: list[socket.socket] = []


def dead_port() -> int:
    """A loopback port where nothing listens, for the whole session: the socket stays bound but never
    listens (connections are refused), so no server started later can be handed the same port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return s.getsockname()[1]


ROOT = Path(__file__).resolve().parent.parent


# The embedded default's shape (`make serve`), with the 0.5B standing in for its 1.5B cloud as well: the modules on this
# gateway test the wire, the SDKs and the seams (the traces say which endpoint wrote what), which hold whichever model
# writes; the 1.5B costs ~3 times the CPU a token, and on two cores the suite's time is CPU (BENCHMARKS.md, "The
# suite's time"). Where the cloud must be the better model (test_quality_agents.py) or where its text is told from the
# device's (test_policy_moves.py, test_migration_targets.py, test_ollama_api.py, test_anthropic_sdk.py), the module's
# gateway keeps the 1.5B. Device and cloud share a model name here: a request naming it goes to the device.
# Unlike `make serve`, it does not profile the device at start (the TTFT line only DiSCo's races read; the modules
# that race keep it: test_disco_live.py).
EMBEDDED_CONFIG = """
[gateway]
policy = "device"
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false   # its three prefills (16, 128, 512 tokens) cost ~9 CPU-seconds a start
[clouds.cloud]
model = "qwen2.5-coder-0.5b-instruct"
tokenizer = "device"
continuation = "completions"
[clouds.cloud.embedded]
model = "qwen2.5-coder-0.5b-instruct"
port = 0
n_ctx = 2048
"""


@pytest.fixture(scope="session")
def gateway() -> Iterator[GatewayProcess]:
    """The embedded default's shape (EMBEDDED_CONFIG): the real llama.cpp device + a real loopback cloud server."""
    gw = start_gateway(EMBEDDED_CONFIG)
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="session")
def llama_server_smollm() -> Iterator[ServerProcess]:
    """llama.cpp's own llama-server (built by the set-up) serving SmolLM2-135M on loopback, under the model name
    "smollm2-135m-instruct": a real upstream with a tokenizer other than the device's Qwen one. Its OpenAI API is at
    `.v1`; it takes GBNF `grammar` and `json_schema` fields and continues a trailing assistant message (prefill)."""
    # Fresh prompts: every request evaluated from position 0, nothing reused (its slots' KV prefixes and its
    # host-memory cache of saved states are on by default), so the tests that compare its greedy text across requests
    # compare along one computation path, whatever other modules asked it before.
    server = start_llama_server(
        model_path("smollm2-135m-instruct"), alias="smollm2-135m-instruct", ctx_size=2048, fresh_prompts=True
    )
    yield server
    stop_server(server)


class SilentServer:
    """Accepts TCP connections and never answers: a cloud that stalls."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture(scope="session")
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


API_KEY = "test-key-7f3a"
ADMIN_KEY = "admin-key-91c2"


@pytest.fixture(scope="session")
def faulty_gateway(silent_server) -> Iterator[GatewayProcess]:
    """A gateway whose cloud is down (nothing listens) and a second cloud that stalls,
    with no failover, an API key, a 1 s read timeout for requests, and the small SmolLM2 as its device model."""
    dead = dead_port()
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
cloud = "cloud"
fallback = false
api_keys = ["{API_KEY}", "second-key"]
admin_keys = ["{ADMIN_KEY}"]
request_read_timeout = 1
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
[clouds.cloud]
base_url = "http://127.0.0.1:{dead}/v1"
model = "remote-model"
connect_timeout = 2
[clouds.stalled]
base_url = "http://127.0.0.1:{silent_server.port}/v1"
model = "stalled-model"
read_timeout = 1.5
""",
        wait_for=("device",),
    )
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="session")
def fallback_gateway() -> Iterator[GatewayProcess]:
    """Cloud policy, cloud down, failover on: answers must come from the device."""
    dead = dead_port()
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
fallback = true
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
[clouds.cloud]
base_url = "http://127.0.0.1:{dead}/v1"
model = "remote-model"
""",
        wait_for=("device",),
    )
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    """A scripted OpenAI-compatible upstream on loopback (tests/integration/scripted_upstream.py), one per module;
    each test starts with an empty script and no recorded requests."""
    server = ScriptedUpstream()
    yield server
    server.close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    """An OTLP/HTTP trace receiver on loopback (tests/integration/otlp_receiver.py), one per module."""
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="session")
def store_server() -> Iterator[StoreServer]:
    """A real Redis-protocol server (Valkey or Redis 7+) on a free loopback port, persistence off, for the session."""
    server = StoreServer()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser_installed() -> None:
    """Asked first by a module's browser fixture: without Chromium only the tests that need it fail, naming the line
    that installs it, before their gateway starts; the rest of the suite runs."""
    require_browser()
