"""app/launcher.py for real: a process that started servers through it and is killed from outside leaves none
behind, and a server whose start-up fails is reported at once.

Real parts: a parent Python process (standing in for pytest under a `timeout`) starts llama.cpp's llama-server, or a
real `tandem serve` whose embedded cloud server it starts in turn, through the launcher, prints their pids and sleeps;
the test sends the parent SIGTERM or SIGKILL and watches /proc until every one of those servers is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.launcher import ROOT, start_gateway
from deploy.models import model_path

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc are Linux's")

PARENT = r"""
import sys, time
from app.launcher import start_gateway, start_llama_server
from deploy.models import model_path

if sys.argv[1] == "llama-server":
    server = start_llama_server(model_path("smollm2-135m-instruct"), ctx_size=512, threads=1)
    print(server.process.pid, flush=True)
else:
    from tests.integration.disco_helpers import embedded_server_pid
    gw = start_gateway(sys.argv[2], ready_timeout=120)
    print(gw.process.pid, embedded_server_pid(gw), flush=True)
time.sleep(600)
"""

# The smallest gateway that starts a server of its own: SmolLM2 as the device and as the embedded cloud.
GATEWAY_WITH_EMBEDDED_CLOUD = """
[gateway]
policy = "device"
[disco]
profile_device = false
[device]
model = "smollm2-135m-instruct"
n_ctx = 512
[clouds.cloud]
model = "smollm2-135m-instruct"
[clouds.cloud.embedded]
model = "smollm2-135m-instruct"
port = 0
n_ctx = 512
n_threads = 1
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def servers_started_by_a_parent(*args: str) -> tuple[subprocess.Popen, list[int]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline()  # once its servers are ready
    assert line, f"the parent exited ({parent.wait()}) before its servers were ready"
    pids = [int(p) for p in line.split()]
    assert all(alive(p) for p in pids)
    return parent, pids


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after `seconds` (none, as soon as all are gone)."""
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_llama_server_dies_with_the_process_that_started_it(sig: signal.Signals) -> None:
    parent, pids = servers_started_by_a_parent("llama-server")
    try:
        parent.send_signal(sig)
        assert parent.wait(timeout=10) == -sig  # it ends as that signal ends it: the hook passes SIGTERM on
        assert gone_within(pids, 5.0) == []
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_parent_takes_the_gateway_and_the_gateways_own_server_with_it() -> None:
    """SIGKILL: no handler runs in the parent; the kernel tells the gateway, and the gateway its embedded server."""
    parent, pids = servers_started_by_a_parent("gateway", GATEWAY_WITH_EMBEDDED_CLOUD)
    try:
        parent.kill()
        parent.wait(timeout=10)
        assert gone_within(pids, 15.0) == []
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_gateway_whose_start_up_fails_is_reported_at_once(tmp_path: Path) -> None:
    """A device model cut short (its metadata whole, its tensors missing): the gateway keeps running to report the
    failure on /health/ready, and the launcher stops it and says why instead of waiting out its ready timeout."""
    garbage = tmp_path / "cut-short.gguf"
    with open(model_path("smollm2-135m-instruct"), "rb") as whole:
        garbage.write_bytes(whole.read(8 << 20))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="start-up failed") as failure:
        start_gateway(f'[device]\nmodel = "{garbage}"\n[clouds.cloud]\nbase_url = "http://127.0.0.1:9/v1"\n')
    assert time.monotonic() - started < 60
    assert "cut-short.gguf" in str(failure.value)
