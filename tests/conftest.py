"""Shared fixtures: real gateway processes on loopback, started with `tandem serve`.

Each fixture writes a TOML config, starts the real CLI in a subprocess on a free
port and waits for /health/ready, so the tests talk to exactly what a user runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayProcess:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """Read one sample from /metrics (0.0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(name + ("{" + want + "}" if want else " ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def start_gateway(config: str, wait_for: tuple[str, ...] | None = None, ready_timeout: float = 300.0) -> GatewayProcess:
    """Start `tandem serve`; return once every backend is ready, or only those named in
    `wait_for` (a gateway whose cloud is down on purpose never becomes fully ready)."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-test-"))
    cfg = tmp / "config.toml"
    cfg.write_text(config)
    log_path = tmp / "gateway.log"
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg), "--port", str(port)],
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=os.environ.copy(),
    )
    gw = GatewayProcess(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + ready_timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited during start-up:\n{gw.log()[-3000:]}")
        try:
            r = httpx.get(gw.url + "/health/ready", timeout=2)
            if r.status_code == 200 or (wait_for and all(r.json()["backends"].get(n) for n in wait_for)):
                return gw
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_gateway(gw)
            raise RuntimeError(f"gateway not ready after {ready_timeout} s:\n{gw.log()[-3000:]}")
        time.sleep(0.25)


def stop_gateway(gw: GatewayProcess) -> None:
    if gw.process.poll() is None:
        os.killpg(gw.process.pid, signal.SIGTERM)
        try:
            gw.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(gw.process.pid, signal.SIGKILL)
            gw.process.wait()


EMBEDDED_CONFIG = """
[gateway]
policy = "device"
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
[clouds.cloud.embedded]
model = "qwen2.5-coder-1.5b-instruct"
port = 0
n_ctx = 2048
"""


@pytest.fixture(scope="session")
def gateway() -> Iterator[GatewayProcess]:
    """The embedded default: real llama.cpp device model + real loopback cloud server."""
    gw = start_gateway(EMBEDDED_CONFIG)
    yield gw
    stop_gateway(gw)


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


@pytest.fixture(scope="session")
def faulty_gateway(silent_server) -> Iterator[GatewayProcess]:
    """A gateway whose cloud is down (nothing listens) and a second cloud that stalls,
    with no failover, an API key, and the small SmolLM2 as its device model."""
    dead = free_port()
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
cloud = "cloud"
fallback = false
api_keys = ["{API_KEY}", "second-key"]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
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
    dead = free_port()
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
fallback = true
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[clouds.cloud]
base_url = "http://127.0.0.1:{dead}/v1"
model = "remote-model"
""",
        wait_for=("device",),
    )
    yield gw
    stop_gateway(gw)
