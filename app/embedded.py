"""Real servers on loopback, started and stopped with the gateway: the embedded default's
stand-ins for remote machines.

- `EmbeddedServer`: llama-cpp-python's own OpenAI-compatible server serving the bundled
  Qwen2.5-Coder-1.5B (the "cloud provider"). Requests queue (`--interrupt_requests
  False`) instead of cutting off the stream in progress.
- `EmbeddedWorker`: a HAT worker (`tandem worker`) hosting the middle layers of a split LLM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from app.config import WORKER_TOKEN_VARIABLES, EmbeddedServerSettings, EmbeddedWorkerSettings
from app.launcher import child_setup, free_port, stop_group

log = logging.getLogger(__name__)


class _ManagedProcess:
    """A child process in its own process group (stopping it stops whatever it spawned) that dies with the
    gateway, its output in a file (an unread pipe would fill up and block it), optionally pinned to CPUs."""

    what = "process"

    def __init__(self, port: int, ready_path: str, startup_timeout: float, cpus: list[int] | None):
        self.port = port or free_port()
        self.ready_url = f"http://127.0.0.1:{self.port}{ready_path}"
        self.startup_timeout = startup_timeout
        self.cpus = cpus
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None  # inherit ours

    def start(self) -> None:
        self.log_file = tempfile.NamedTemporaryFile(prefix="tandem-embedded-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.environment(),
            preexec_fn=child_setup(self.cpus),  # it dies with the gateway, even a killed one
        )

    async def wait_ready(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.startup_timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    err = Path(self.log_file.name).read_text(errors="replace")[-2000:]  # noqa: ASYNC240 (fatal path)
                    raise RuntimeError(f"embedded {self.what} exited during start-up:\n{err}")
                try:
                    if (await client.get(self.ready_url)).status_code == 200:
                        log.info("embedded %s ready on port %d", self.what, self.port)
                        return
                except httpx.HTTPError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"embedded {self.what} not ready after {self.startup_timeout:g} s")
                await asyncio.sleep(0.25)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            stop_group(self.process, grace=10.0)
        finally:
            self.log_file.close()
            os.unlink(self.log_file.name)


class EmbeddedServer(_ManagedProcess):
    what = "cloud server"

    def __init__(self, settings: EmbeddedServerSettings, model_path: Path, alias: str):
        super().__init__(settings.port, "/v1/models", settings.startup_timeout, settings.cpus)
        self.settings = settings
        self.model_path = model_path
        self.alias = alias
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        log.info("starting embedded cloud server on %s (%s)", self.base_url, self.model_path.name)
        return [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path),
            "--model_alias", self.alias,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--n_ctx", str(self.settings.n_ctx),
            "--n_threads", str(self.settings.n_threads),
            "--n_threads_batch", str(self.settings.n_threads),
            "--flash_attn", str(self.settings.flash_attn),
            "--logits_all", str(self.settings.logits_all),
            "--interrupt_requests", "False",
            "--verbose", "False",
        ]  # fmt: skip


class EmbeddedWorker(_ManagedProcess):
    what = "HAT worker"

    def __init__(self, settings: EmbeddedWorkerSettings, model: str, m: int, auth_token: str | None, profile: str = ""):
        super().__init__(settings.port, "/health/ready", settings.startup_timeout, settings.cpus)
        self.settings = settings
        self.model = model
        self.m = m
        self.auth_token = auth_token
        self.profile = profile
        self.url = f"ws://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        log.info("starting embedded HAT worker on %s (%s, m=%d)", self.url, self.model, self.m)
        cmd = [sys.executable, "-m", "app.cli", "worker", "--model", self.model, "--m", str(self.m),
               "--host", "127.0.0.1", "--port", str(self.port), "--device", self.settings.device]  # fmt: skip
        if self.settings.num_threads:
            cmd += ["--threads", str(self.settings.num_threads)]
        if self.profile:
            cmd += ["--profile", self.profile]
        if self.settings.prefill_profile is not None:
            cmd.append("--prefill-profile" if self.settings.prefill_profile else "--no-prefill-profile")
        return cmd

    def environment(self) -> dict[str, str]:
        # The token reaches the worker through its environment, never its command line (ps shows that). It is the
        # gateway's own: a worker token the gateway inherited is for some other worker, and would lock this one.
        env = {name: value for name, value in os.environ.items() if name not in WORKER_TOKEN_VARIABLES}
        if self.auth_token:
            env[WORKER_TOKEN_VARIABLES[0]] = self.auth_token
        return env
