"""The SSE wire format, the README's curl example run verbatim, and client disconnects."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import httpx
import pytest

from tests.conftest import ROOT

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def test_sse_framing(gateway):
    body = {"model": "device", "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", gateway.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        raw = b"".join(r.iter_raw())
    assert b"\r" not in raw
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        if event.startswith(":"):
            continue
        assert event.startswith("data: ")
        json.loads(event[6:])


def readme_curl() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- curl-example -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert match, "README.md must hold the curl example after a <!-- curl-example --> marker"
    return match.group(1)


def test_readme_curl_example_verbatim(gateway):
    command = readme_curl()
    assert "http://127.0.0.1:8000" in command
    # Only the address differs: the test gateway listens on a free port, not 8000.
    command = command.replace("http://127.0.0.1:8000", gateway.url)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=True).stdout
    datas = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip()


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("model", ["device", "cloud"])
def test_disconnect_mid_stream_cancels_backend_work(gateway, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway.v1 + "/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got >= 4:
                break
        assert gateway.metric("tandem_backend_active_streams", backend=model) == 1
    # The client is gone: the backend's work must stop (llama.cpp thread / upstream HTTP closed).
    assert wait_until(lambda: gateway.metric("tandem_backend_active_streams", backend=model) == 0, 60)
    assert gateway.metric("tandem_in_flight_requests") == 0
    # And nothing kept generating the remaining ~396 tokens: a fresh request is served at once.
    t0 = time.monotonic()
    r = httpx.post(
        gateway.v1 + "/chat/completions",
        timeout=60,
        json={"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200
    assert time.monotonic() - t0 < 10  # 396 leftover tokens would take 10-20 s on this CPU


def test_disconnect_during_a_non_streamed_answer_cancels_backend_work(gateway):
    """The client leaves while its whole answer is being collected: the device stops, far short of max_tokens. It
    leaves once the device has begun (an event), not after a fixed time, which a fast machine fills with the whole
    answer and a loaded one with none of it."""
    max_tokens = 1000  # the device's n_ctx is 2048
    body = json.dumps({"model": "device", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0})
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    before = gateway.metric("tandem_backend_generated_tokens", backend="device")

    def generated() -> float:
        return gateway.metric("tandem_backend_generated_tokens", backend="device") - before

    with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))) as client:
        client.sendall(request)
        assert wait_until(lambda: generated() >= 4, 120)  # the answer is under way; the client then hangs up
    assert wait_until(lambda: gateway.metric("tandem_backend_active_streams", backend="device") == 0, 60)
    assert gateway.metric("tandem_in_flight_requests") == 0
    stopped_at = generated()
    time.sleep(0.5)
    assert generated() == stopped_at  # nothing goes on generating
    assert 4 <= stopped_at < max_tokens, stopped_at


def test_disconnect_before_first_token_cancels(gateway):
    """A client that leaves while its request waits in the device queue, before its first
    token, frees its place: the model never generates for it. It leaves once the gateway holds its request (an
    event), not after a fixed time, in which a fast machine would finish the busy stream and start this one."""
    body = {"model": "device", "messages": MESSAGES, "temperature": 0, "stream": True}
    busy_tokens = 100
    before = gateway.metric("tandem_backend_generated_tokens", backend="device")
    with httpx.stream(
        "POST", gateway.v1 + "/chat/completions", json={**body, "max_tokens": busy_tokens}, timeout=60
    ) as busy:
        lines = busy.iter_lines()
        next(lines)  # the device is now busy with this stream
        queued = json.dumps({**body, "max_tokens": 60})
        with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))) as client:
            client.sendall(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(queued)}\r\n\r\n{queued}".encode()
            )
            assert wait_until(lambda: gateway.metric("tandem_in_flight_requests") == 2, 60)
        assert wait_until(lambda: gateway.metric("tandem_in_flight_requests") == 1, 60)  # dropped, the busy one runs
        rest = list(lines)  # let the busy stream finish
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    assert wait_until(lambda: gateway.metric("tandem_backend_active_streams", backend="device") == 0, 60)
    time.sleep(0.5)
    assert gateway.metric("tandem_backend_generated_tokens", backend="device") - before == busy_tokens
