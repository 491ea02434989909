"""Start a real `tandem serve` in a subprocess on a free loopback port and wait until it
is ready. Used by the integration tests and the benchmarks, so both exercise exactly
what a user runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the repo: `python -m app.cli` runs from here


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
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return 0.0


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
