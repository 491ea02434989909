"""A real Redis-protocol server for the tests: Valkey where it is installed, else Redis 7+ (`make setup` installs
one; README says how without root). Started on a free loopback port with persistence off and a temp directory,
stopped and started again on the same port by the tests of a lost store."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from app.launcher import child_setup, free_port

SERVERS = ("valkey-server", "redis-server")


def server_binary() -> str:
    """The store's binary; without one, only the tests that need a store fail, with the line that installs it."""
    for name in SERVERS:
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.fail(
        "these tests need a Redis-protocol server on PATH (valkey-server or redis-server 7+): "
        "sudo apt-get install redis-server (or valkey-server); make setup does it as root",
        pytrace=False,
    )


class StoreServer:
    def __init__(self) -> None:
        self.binary = server_binary()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-store-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), "--protected-mode", "yes", "--loglevel", "warning"]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=child_setup()
        )  # child_setup: it dies with the test run, even one killed from outside
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def replica_config(cloud_url: str, store: StoreServer, prefix: str, on_loss: str, admin: str, state: str = "") -> str:
    """A gateway replica on `store`: the cloud policy on one priced cloud named "cloud" at `cloud_url`, the SmolLM2
    device on one thread (replicas share the cores), the store polled often; `state`: more lines of [state]."""
    return f"""
[gateway]
policy = "cloud"
cloud = "cloud"
state_file = ""
stall_timeout = 60  # the device's first answer on a loaded 2-core machine
admin_keys = ["{admin}"]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
n_threads = 1
[disco]
profile_device = false
migration = false
[clouds.cloud]
base_url = "{cloud_url}"
model = "scripted"
[clouds.cloud.price]
prefill_per_million = 150.0
decode_per_million = 600.0
[state]
backend = "valkey"
url = "{store.url}"
key_prefix = "{prefix}"
on_store_loss = "{on_loss}"
poll_seconds = 0.5
timeout = 0.5
{state}
"""
