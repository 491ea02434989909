"""A real OpenAI-compatible server on loopback, started and stopped with the gateway.

It stands in for a remote provider in the embedded default: llama-cpp-python's
own server process serving the bundled Qwen2.5-Coder-1.5B. Requests queue
(`--interrupt_requests False`) instead of cutting off the stream in progress.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from app.config import EmbeddedServerSettings
from app.launcher import free_port

log = logging.getLogger(__name__)


class EmbeddedServer:
    def __init__(self, settings: EmbeddedServerSettings, model_path: Path, alias: str):
        self.settings = settings
        self.model_path = model_path
        self.alias = alias
        self.port = settings.port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path),
            "--model_alias", self.alias,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--n_ctx", str(self.settings.n_ctx),
            "--n_threads", str(self.settings.n_threads),
            "--n_threads_batch", str(self.settings.n_threads),
            "--interrupt_requests", "False",
            "--verbose", "False",
        ]  # fmt: skip
        log.info("starting embedded cloud server on %s (%s)", self.base_url, self.model_path.name)
        # Its own process group, so stopping it also stops anything it spawned.
        # Its output goes to a file: an unread pipe would fill up and block the server.
        self.log_file = tempfile.NamedTemporaryFile(prefix="tandem-embedded-", suffix=".log", delete=False)
        cpus = self.settings.cpus
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Set before exec, so every thread the server creates inherits it.
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )

    async def wait_ready(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.settings.startup_timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    err = Path(self.log_file.name).read_text(errors="replace")[-2000:]  # noqa: ASYNC240 (fatal path)
                    raise RuntimeError(f"embedded cloud server exited during start-up:\n{err}")
                try:
                    if (await client.get(self.base_url + "/models")).status_code == 200:
                        log.info("embedded cloud server ready on %s", self.base_url)
                        return
                except httpx.HTTPError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"embedded cloud server not ready after {self.settings.startup_timeout:g} s")
                await asyncio.sleep(0.25)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        finally:
            self.log_file.close()
            os.unlink(self.log_file.name)
