"""Start a real `tandem serve` in a subprocess on a free loopback port and wait until it
is ready. Used by the integration tests and the benchmarks, so both exercise exactly
what a user runs. The same for llama.cpp's own `llama-server` (built by the set-up:
deploy/llama_server.py), the real peer they run beside it.

A server started here dies with the process that started it, however that ends, so a
test run killed from outside (a `timeout` around pytest, SIGTERM, SIGKILL) leaves no
server behind: each runs in its own process group (stopping it stops what it spawned),
on Linux with PR_SET_PDEATHSIG (the kernel sends it SIGTERM, llama-server SIGKILL, when
its parent dies, even by SIGKILL), and this process stops the groups it still has at exit and on SIGTERM.
`child_setup` is the same start for the gateway's own embedded servers (app/embedded.py).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the repo: `python -m app.cli` runs from here

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Looked up here, not in the forked child: between fork and exec only the call itself runs.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


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


class StartupFailed(Exception):
    """The server says its start-up failed (it keeps running to report it): stop waiting for it."""


# The servers this process started and has not stopped, by pid: stopped at exit and on SIGTERM.
_running: dict[int, subprocess.Popen] = {}
_exit_hooked = False
_previous_sigterm: Callable | int | None = None  # the SIGTERM handler `track` found, called after its own


def child_setup(cpus: list[int] | None = None, death_signal: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets `death_signal` when this process dies (Linux) and runs on `cpus` (all if
    None). SIGTERM lets one of our servers stop what it started in turn; a foreign server with nothing to stop gets
    SIGKILL (see start_llama_server).

    The kernel ties PR_SET_PDEATHSIG to the thread that forks, not the process: set only when starting from the main
    thread, whose end is the process's; a child started from another thread relies on `track`'s hooks."""
    parent = os.getpid()
    die_with_parent = _prctl is not None and threading.current_thread() is threading.main_thread()

    def setup() -> None:
        if die_with_parent:
            _prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the line above: no signal will come
                os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)  # before exec, so every thread the process creates inherits it

    return setup


def track(process: subprocess.Popen) -> None:
    """Stop `process`'s group when this process exits or is sent SIGTERM, unless it was stopped before (stop_group)."""
    global _exit_hooked, _previous_sigterm
    if not _exit_hooked:
        atexit.register(_stop_running)
        _exit_hooked = True
    if _previous_sigterm is None and threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        if _previous_sigterm is not signal.SIG_IGN:  # a process that ignores SIGTERM is not ended by it
            signal.signal(signal.SIGTERM, _on_sigterm)
    _running[process.pid] = process


def stop_group(process: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a process started in its own group (and whatever it spawned there): SIGTERM, SIGKILL after `grace` s."""
    _running.pop(process.pid, None)
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _stop_running() -> None:
    for process in list(_running.values()):
        stop_group(process, grace=5.0)


def _on_sigterm(signum: int, frame) -> None:
    """Pass SIGTERM on to the servers still running, then do what this process did on SIGTERM before."""
    for pid in list(_running):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end as SIGTERM ends it, exit status included
    os.kill(os.getpid(), signal.SIGTERM)


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
        preexec_fn=child_setup(cpus),
    )
    track(process)
    gw = GatewayProcess(f"http://127.0.0.1:{port}", process, log_path)

    def ready() -> bool:
        r = httpx.get(gw.url + "/health/ready", timeout=2)
        if r.status_code == 200:
            return True
        body = r.json()
        if wait_for and all(body["backends"].get(n) for n in wait_for):
            return True
        if body.get("status") == "failed":  # its start-up raised: nothing will become ready, waiting is futile
            raise StartupFailed(body.get("error", ""))
        return False

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
        except StartupFailed as failure:
            stop_server(server)
            raise RuntimeError(f"{what} start-up failed ({failure}):\n{server.log()[-3000:]}") from None
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"{what} not ready after {timeout} s:\n{server.log()[-3000:]}")
        time.sleep(poll)


def stop_server(server: ServerProcess) -> None:
    """Stop a server started here (its whole process group): SIGTERM, then SIGKILL after 20 s."""
    stop_group(server.process)


stop_gateway = stop_server


# llama-server's reuse of earlier requests' work, all of it off (the llama.cpp that the pinned llama-cpp-python
# vendors): one slot (of several, a prompt takes the one whose cache it shares most with), no prompt cache (a slot's
# KV prefix kept, only the new tail evaluated, in other batches than a cold prompt's), and no host-memory cache of
# saved slot states (`--cache-ram`, 8 GiB by default: a slot taken by a new prompt saves its state there and restores
# the saved state of the prompt it is given). Slot save/restore to disk is off unless --slot-save-path is given.
FRESH_PROMPT_ARGS = ("--parallel", "1", "--no-cache-prompt", "--cache-ram", "0")


def start_llama_server(
    model_path: str | Path,
    *,
    alias: str | None = None,
    extra_args: tuple[str, ...] = (),
    ctx_size: int = 4096,
    threads: int | None = None,
    cpus: list[int] | None = None,
    ready_timeout: float = 120.0,
    fresh_prompts: bool = False,
) -> ServerProcess:
    """llama.cpp's `llama-server` (the set-up's build, deploy/llama_server.py) serving one GGUF on a free loopback
    port, offline, without its web UI; returned once /health answers 200 (the model is loaded). Its OpenAI API is
    at `.v1`, the model named `alias` (default: the file's stem). Stop it with stop_server.

    fresh_prompts: every request is evaluated from position 0 with nothing of an earlier one reused
    (FRESH_PROMPT_ARGS), so the same input takes the same computation path and greedy answers compare across
    requests. By default llama-server reuses what it can, and a repeated prompt then takes another path."""
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
        *(("--threads", str(threads), "--threads-batch", str(threads)) if threads else ()),
        *(FRESH_PROMPT_ARGS if fresh_prompts else ()), *extra_args,
    ]  # fmt: skip
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # SIGKILL when this process dies: llama-server answers a second SIGTERM (the hook's, then the kernel's)
            # with exit() inside its signal handler, which can deadlock in its exit handlers and leave it running
            # (seen in the suite: "Received second interrupt, terminating immediately." and still alive 5 s later).
            # It has nothing to save and starts nothing of its own.
            preexec_fn=child_setup(cpus, death_signal=signal.SIGKILL),
        )
    track(process)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    # 503 while the model loads
    return _when_ready(
        server, "llama-server", lambda: httpx.get(server.url + "/health", timeout=2).status_code == 200,
        ready_timeout, poll=0.1,
    )  # fmt: skip
