"""Faults become migrations: a cloud server that stalls, then one that is killed, mid-answer.

Real parts: the gateway's own embedded llama.cpp server (Qwen2.5-Coder-1.5B) is
SIGSTOPped / SIGKILLed while it streams; the answer must finish on the device
(Qwen2.5-Coder-0.5B) and continue exactly after what the client already got.
"""

from __future__ import annotations

import signal

import pytest

from tests.conftest import start_gateway, stop_gateway
from tests.integration.disco_helpers import (
    embedded_server_pid,
    independent_continuation,
    signal_at,
    signal_process,
    stream_chunks,
    trace,
)

MESSAGES = [{"role": "user", "content": "Explain in detail how a hash map works in Python."}]


@pytest.fixture(scope="module")
def fault_gateway(tmp_path_factory):
    state = tmp_path_factory.mktemp("state") / "budget.json"
    gw = start_gateway(f"""
[gateway]
policy = "cloud"
stall_timeout = 5.0
state_file = "{state}"
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
migration = false      # only faults move answers here
profile_device = false
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
[clouds.cloud.embedded]
port = 0
n_ctx = 2048
""")
    yield gw
    stop_gateway(gw)


def _check_continuity(gw, request_id, pieces, finish, reason):
    t = trace(gw, request_id)
    assert finish in ("stop", "length")
    assert [m["reason"] for m in t["migrations"]] == [reason]
    m = t["migrations"][0]
    assert (m["from"], m["to"]) == ("cloud", "device")
    k = m["at_token"]
    assert 0 < k < len(pieces)
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    # The device's part is exactly what the device says after prompt + the delivered prefix:
    # no token repeated, skipped or lost at the seam.
    assert independent_continuation(gw, "device", MESSAGES, prefix, len(pieces) - k) == rest
    outcomes = [(e["endpoint"], e["outcome"]) for e in t["endpoints"]]
    assert outcomes == [("cloud", "failed"), ("device", "finished")]
    return t


def test_stalled_cloud_mid_stream_migrates_to_device(fault_gateway):
    pid = embedded_server_pid(fault_gateway)
    stall_after_three, stopped = signal_at(pid, signal.SIGSTOP, 3)
    try:
        rid, pieces, finish = stream_chunks(fault_gateway, MESSAGES, max_tokens=12, on_chunk=stall_after_three)
    finally:
        signal_process(pid, signal.SIGCONT)
    assert stopped.is_set()
    t = _check_continuity(fault_gateway, rid, pieces, finish, "stall")
    assert "stalled" in t["endpoints"][0]["error"]


def test_killed_cloud_mid_stream_migrates_to_device(fault_gateway):
    kill_after_three, killed = signal_at(embedded_server_pid(fault_gateway), signal.SIGKILL, 3)
    rid, pieces, finish = stream_chunks(fault_gateway, MESSAGES, max_tokens=12, on_chunk=kill_after_three)
    assert killed.is_set()
    _check_continuity(fault_gateway, rid, pieces, finish, "error")
    # With the cloud gone, new answers fall back to the device before their first token.
    rid, pieces, finish = stream_chunks(fault_gateway, MESSAGES, max_tokens=4)
    assert pieces and trace(fault_gateway, rid)["endpoints"][-1]["endpoint"] == "device"
