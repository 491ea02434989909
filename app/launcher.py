"""Start a real `tandem serve` in a subprocess on a free loopback port and wait until it
is ready. Used by the integration tests and the benchmarks, so both exercise exactly
what a user runs. The same for llama.cpp's own `llama-server` (built by the set-up:
deploy/llama_server.py), the real peer they run beside it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the repo: `python -m app.cli` runs from here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class GatewayProcess(ServerProcess):
    def metric(self, name: str, **labels: str) -> float:
        """Read one sample from /metrics (0.0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return 0.0


S = TypeVar("S", bound=ServerProcess)


def start_gateway(
    config: str,
    wait_for: tuple[str, ...] | None = None,
    ready_timeout: float = 300.0,
    cpus: list[int] | None = None,
    options: tuple[str, ...] = (),
) -> GatewayProcess:
    """Start `tandem serve` (with `options`, e.g. --reset-budget); return once every backend is ready, or only those
    named in `wait_for` (a gateway whose cloud is down on purpose never becomes fully ready)."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-test-"))
    cfg = tmp / "config.toml"
    cfg.write_text(config)
    log_path = tmp / "gateway.log"
    env = os.environ.copy()
    if "state_file" not in config:  # never touch the user's real budget state from a test or bench
        env["TANDEM_GATEWAY__STATE_FILE"] = str(tmp / "budget.json")
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg), "--port", str(port), *options],
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    gw = GatewayProcess(f"http://127.0.0.1:{port}", process, log_path)

    def ready() -> bool:
        r = httpx.get(gw.url + "/health/ready", timeout=2)
        return r.status_code == 200 or bool(wait_for and all(r.json()["backends"].get(n) for n in wait_for))

    return _when_ready(gw, "gateway", ready, ready_timeout, poll=0.25)


def _when_ready(server: S, what: str, ready: Callable[[], bool], timeout: float, poll: float) -> S:
    """`server` once `ready()` says so; stopped, with the end of its log in the error, if it exits or times out."""
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up:\n{server.log()[-3000:]}")
        try:
            if ready():
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"{what} not ready after {timeout} s:\n{server.log()[-3000:]}")
        time.sleep(poll)


def stop_server(server: ServerProcess) -> None:
    """Stop a server started here (its whole process group): SIGTERM, then SIGKILL after 20 s."""
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


stop_gateway = stop_server


def start_llama_server(
    model_path: str | Path,
    *,
    alias: str | None = None,
    extra_args: tuple[str, ...] = (),
    ctx_size: int = 4096,
    threads: int | None = None,
    cpus: list[int] | None = None,
    ready_timeout: float = 120.0,
) -> ServerProcess:
    """llama.cpp's `llama-server` (the set-up's build, deploy/llama_server.py) serving one GGUF on a free loopback
    port, offline, without its web UI; returned once /health answers 200 (the model is loaded). Its OpenAI API is
    at `.v1`, the model named `alias` (default: the file's stem). Stop it with stop_server."""
    from deploy.llama_server import binary_path

    binary = binary_path()
    if not binary.is_file():
        raise RuntimeError(f"llama-server is not built at {binary}: run `make llama-server` (the set-up does)")
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-llama-server-"))
    log_path = tmp / "llama-server.log"
    command = [
        str(binary), "--model", str(model_path), "--alias", alias or Path(model_path).stem,
        "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx_size), "--offline", "--no-webui",
        *(("--threads", str(threads), "--threads-batch", str(threads)) if threads else ()), *extra_args,
    ]  # fmt: skip
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    # 503 while the model loads
    return _when_ready(
        server, "llama-server", lambda: httpx.get(server.url + "/health", timeout=2).status_code == 200,
        ready_timeout, poll=0.1,
    )  # fmt: skip
