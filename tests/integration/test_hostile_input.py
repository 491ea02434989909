"""Hostile and broken input gets a clear 4xx in the OpenAI envelope, with an x-request-id, loses nothing and
leaves the gateway serving: lone surrogates, unbounded integers, deeply nested JSON, oversize bodies, huge
prompts, empty prompts, and clients that connect and never finish their request.

Real parts: the gateway process of conftest's `faulty_gateway` (SmolLM2 device, API keys, a read timeout of
1 s for requests).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.conftest import ADMIN_KEY, API_KEY
from tests.integration.test_errors import assert_envelope

AUTH = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


def post_raw(gw, body: bytes, path: str = "/chat/completions", **kw) -> httpx.Response:
    return httpx.post(gw.v1 + path, content=body, headers=AUTH, timeout=60, **kw)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "device", "messages": [{"role": "user", "content": "\\ud800 x"}]}', "messages[0].content"),
        (b'{"model": "device", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "\\udfff"]}', "stop"),
    ],
)
def test_lone_surrogates_are_named(faulty_gateway, body, param):
    r = post_raw(faulty_gateway, body)
    assert_envelope(r, 400, param, "lone UTF-16 surrogate")
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed", "n"])
def test_unbounded_integers_are_refused_at_the_schema(faulty_gateway, field):
    huge = b"1" + b"0" * 400
    body = b'{"model": "device", "messages": [{"role": "user", "content": "hi"}], "' + field.encode() + b'": ' + huge
    assert_envelope(post_raw(faulty_gateway, body + b"}"), 400, field, "")


def test_huge_token_ids_in_a_completion_prompt(faulty_gateway):
    r = post_raw(faulty_gateway, b'{"model": "device", "prompt": [1, 1' + b"0" * 400 + b"]}", path="/completions")
    assert_envelope(r, 400, "prompt[1]", "less than or equal to 2147483647")


def test_empty_completion_prompt_is_a_400(faulty_gateway):
    r = post_raw(faulty_gateway, b'{"model": "device", "prompt": "", "max_tokens": 2}', path="/completions")
    assert_envelope(r, 400, "prompt", "prompt is empty")


def test_deeply_nested_budget_update(faulty_gateway):
    admin = {**AUTH, "authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.put(faulty_gateway.v1 + "/budget", content=b"[" * 100_000, headers=admin, timeout=30)
    assert_envelope(r, 400, None, "nested too deeply")
    assert httpx.get(faulty_gateway.v1 + "/budget", headers=admin).json()["budget"] == 0.5  # nothing stored


def test_oversize_bodies_are_refused_before_they_are_read(faulty_gateway):
    filler = b"x" * (3 * 1024 * 1024)
    body = b'{"model": "device", "messages": [{"role": "user", "content": "' + filler + b'"}]}'
    r = post_raw(faulty_gateway, body)
    assert_envelope(r, 413, None, "at most 2097152 bytes")
    assert r.headers["x-request-id"].startswith("req-")

    def chunks():  # no Content-Length: counted as it arrives
        yield body[:1024]
        for i in range(1024, len(body), 65536):
            yield body[i : i + 65536]

    assert_envelope(post_raw(faulty_gateway, chunks()), 413, None, "at most")


def test_a_huge_prompt_is_tokenised_off_the_event_loop(faulty_gateway):
    """A ~1.9 MB message takes the device tokenizer a while; meanwhile the gateway keeps answering."""
    big = {"model": "device", "messages": [{"role": "user", "content": "lorem ipsum dolor " * 100_000}]}
    result: dict = {}

    def send_big() -> None:
        t0 = time.monotonic()
        result["response"] = httpx.post(faulty_gateway.v1 + "/chat/completions", json=big, headers=AUTH, timeout=120)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=send_big)
    thread.start()
    probes = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(faulty_gateway.url + "/health", timeout=30).status_code == 200
        probes.append(time.monotonic() - t0)
        time.sleep(0.01)
    thread.join()
    assert_envelope(result["response"], 400, "messages", "context window")
    # Probed while the big request was in flight, and never held up by it: a probe waiting on a tokenizer that held
    # the loop would take most of the request's time. Relative, so that a fast machine (a short request, a probe or
    # two) and a loaded one (a long request) are held to the same rule.
    assert probes, result["seconds"]
    assert max(probes) < result["seconds"] / 2, (probes, result["seconds"])


def test_validation_errors_carry_a_request_id(faulty_gateway):
    r = httpx.post(faulty_gateway.v1 + "/chat/completions", json={"model": "device"}, headers=AUTH)
    assert r.status_code == 400 and r.headers["x-request-id"].startswith("req-")
    r = httpx.get(faulty_gateway.url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and r.headers["x-request-id"]


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model"',
    ],
    ids=["nothing", "half the headers", "half the body"],
)
def test_half_sent_requests_do_not_hold_connections(faulty_gateway, sent):
    port = int(faulty_gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, 5), "the gateway kept a half-sent request's connection open"
    # ... and a whole request on a new connection is answered as usual.
    assert httpx.get(faulty_gateway.url + "/health").status_code == 200
