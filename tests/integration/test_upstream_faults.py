"""Whatever an upstream or a migration target does, a client that stays connected gets a complete answer
(finish reason, [DONE]) whose text is an exact prefix plus a continuation — or, only when no endpoint can serve,
an error event in the OpenAI envelope and [DONE]. Never a cut body, never a truncation marked `stop`.

Real parts: the gateway (`tandem serve` in a subprocess), the real SmolLM2 device model, and a scripted
OpenAI-compatible upstream on loopback (tests/integration/scripted_upstream.py) that fails in chosen ways.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from clients.chat_template import render_chat
from deploy.models import model_path
from tests.integration.disco_helpers import trace
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "What is the answer to everything?"}]
MAX_TOKENS = 12
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    """Answers start on the scripted cloud; faults move them to the device (no cost migration here)."""
    process = start_gateway(f"""
[gateway]
policy = "cloud"
fallback = true
stall_timeout = 6
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "{SMOL}"
n_ctx = 2048
[disco]
migration = false
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 3
retries = 0   # each test scripts one fault: it falls back, not retried (tests/integration/test_cloud_breaker.py)
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


@cache
def _smol_template() -> str:
    from llama_cpp import Llama

    return Llama(str(model_path(SMOL)), vocab_only=True, verbose=False).metadata["tokenizer.chat_template"]


def device_says(gw: GatewayProcess, prefix: str, max_tokens: int) -> str:
    """What the device generates greedily after the chat prompt + `prefix`, asked directly."""
    prompt = render_chat(_smol_template(), MESSAGES) + prefix
    r = httpx.post(
        gw.v1 + "/completions",
        json={"model": "device", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def stream(gw: GatewayProcess, model: str = "tandem", **extra) -> tuple[str, list[dict], bool]:
    """A raw streamed answer: (request id, its data events as JSON, whether it ended with [DONE])."""
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        raw = r.read().decode()
    assert raw.endswith("\n\n"), f"cut body: {raw[-200:]!r}"
    data = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return request_id, [json.loads(d) for d in data if d != "[DONE]"], done


def text_of(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", ()))


def finish_of(events: list[dict]) -> str | None:
    return next((c["finish_reason"] for e in events for c in e.get("choices", ()) if c["finish_reason"]), None)


def _raw(obj) -> Answer:
    return Answer(pieces=PIECES[:3], then="raw", raw=b"data: " + json.dumps(obj).encode() + b"\n\n")


MID_STREAM = {
    "closed at a chunk boundary": Answer(pieces=PIECES[:3], then="close"),
    "closed mid-chunk": Answer(pieces=PIECES[:3], then="close-mid-chunk"),
    "reset": Answer(pieces=PIECES[:3], then="reset"),
    "stall": Answer(pieces=PIECES[:3], then="stall"),
    "pings only": Answer(pieces=PIECES[:3], then="pings"),
    "invalid JSON": Answer(pieces=PIECES[:3], then="raw", raw=b"data: {not json\n\n"),
    "random bytes": Answer(pieces=PIECES[:3], then="raw", raw=bytes(range(256)) + b"\n\n"),
    "a JSON array": _raw([1, 2, 3]),
    "null": _raw(None),
    "a string": _raw("hello"),
    "choices not a list": _raw({"choices": "oops"}),
    "delta not an object": _raw({"choices": [{"delta": "x"}]}),
    "usage not an object": _raw({"usage": 5}),
    "text not a string": _raw({"choices": [{"text": 5}]}),
    "an error event": _raw({"error": {"message": "overloaded"}}),
    "a clean end without [DONE]": Answer(pieces=PIECES[:3], then="end"),
}

BEFORE_FIRST_TOKEN = {
    "HTTP 500": Answer(status=500),
    "HTTP 429": Answer(status=429),
    "hang": Answer(before="hang"),
    "a 200 HTML page": Answer(before="html"),
    "closed before a token": Answer(pieces=(), then="close"),
    "a clean end before a token": Answer(pieces=(), then="end"),
    "a wrong-shaped first chunk": Answer(pieces=(), then="raw", raw=b'data: {"choices": "oops"}\n\n'),
}


@pytest.mark.parametrize("fault", list(MID_STREAM))
def test_mid_stream_fault_migrates_with_the_exact_prefix(gw, upstream, fault):
    upstream.push(MID_STREAM[fault])
    request_id, events, done = stream(gw)
    assert done and finish_of(events) in ("stop", "length"), events[-2:]
    t = trace(gw, request_id)
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "failed"), ("device", "finished")]
    assert t["endpoints"][0]["error"]
    (migration,) = t["migrations"]
    assert migration["at_token"] == 3 and migration["reason"] in ("error", "stall")
    prefix = "".join(PIECES[:3])
    text = text_of(events)
    assert text.startswith(prefix), text
    # The device's part is exactly what it says after the prompt and the delivered prefix: nothing repeated,
    # skipped or lost at the seam, and nothing of the faulty chunk relayed.
    assert text[len(prefix) :] == device_says(gw, prefix, MAX_TOKENS - 3)
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == t["completion_tokens"] > 3


@pytest.mark.parametrize("fault", list(BEFORE_FIRST_TOKEN))
def test_fault_before_the_first_token_falls_back_to_the_device(gw, upstream, fault):
    upstream.push(BEFORE_FIRST_TOKEN[fault])
    request_id, events, done = stream(gw)
    assert done and finish_of(events) in ("stop", "length")
    assert text_of(events) == device_says(gw, "", MAX_TOKENS)
    t = trace(gw, request_id)
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "failed"), ("device", "finished")]


def test_non_streamed_answer_survives_a_malformed_chunk(gw, upstream):
    upstream.push(_raw({"choices": [{"delta": "x"}]}))
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "tandem", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prefix = "".join(PIECES[:3])
    assert choice["message"]["content"] == prefix + device_says(gw, prefix, MAX_TOKENS - 3)
    assert choice["finish_reason"] in ("stop", "length")


def test_pinned_cloud_fault_is_an_error_event_and_the_trace_says_so(gw, upstream):
    """Pinned to the cloud (no migration): when no endpoint may serve, the client gets the error in the
    envelope and [DONE] after the delivered tokens, and the trace shows the cloud failed, not won."""
    upstream.push(_raw({"choices": [{"text": 5}]}))
    request_id, events, done = stream(gw, model="cloud")
    assert done
    assert text_of(events) == "".join(PIECES[:3])
    error = events[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"} and "not a string" in error["message"]
    t = trace(gw, request_id)
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "failed")]
    assert "not a string" in t["error"] and t["finish_reason"] is None


def test_pinned_cloud_truncation_is_not_reported_as_stop(gw, upstream):
    upstream.push(Answer(pieces=PIECES[:3], then="end"))
    request_id, events, done = stream(gw, model="cloud")
    assert done and finish_of(events) is None
    assert trace(gw, request_id)["finish_reason"] is None
    assert "without a finish reason" in events[-1]["error"]["message"]


def test_error_before_the_first_token_has_a_request_id_with_a_trace(gw, upstream):
    upstream.push(Answer(status=500))
    r = httpx.post(gw.v1 + "/chat/completions", json={"model": "cloud", "messages": MESSAGES}, timeout=30)
    assert r.status_code == 502 and set(r.json()) == {"error"}
    t = trace(gw, r.headers["x-request-id"])
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "failed")]
    assert "scripted 500" in t["error"]


def test_responses_api_fault_after_the_first_token_is_a_failed_event(gw, upstream):
    """POST /v1/responses pinned to the cloud: a fault after tokens were delivered ends the stream with a
    `response.failed` event (the SDK yields it; no [DONE] in this API), and its trace says the cloud failed."""
    upstream.push(_raw({"choices": [{"text": 5}]}))
    c = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=60)
    events = list(c.responses.create(model="cloud", input=MESSAGES[0]["content"], max_output_tokens=12, stream=True))
    *body, failed = events
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error" and "not a string" in failed.response.error.message
    text = "".join(e.delta for e in body if e.type == "response.output_text.delta")
    assert text == "".join(PIECES[:3]) == failed.response.output[0].content[0].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    t = trace(gw, failed.response.id)
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "failed")]
