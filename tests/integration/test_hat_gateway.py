"""HAT as a cloud endpoint of the gateway: the OpenAI SDK streams through the split model
(device half in the gateway, middle layers in a real `tandem worker` process on loopback),
and DiSCo migrates answers device -> HAT and HAT -> device from the delivered prefix. The gateway exports its
OpenTelemetry spans to a real OTLP/HTTP receiver on loopback: a HAT session is a span under its leg."""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Iterator
from unittest import mock

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, free_port
from tests.conftest import start_gateway, stop_gateway
from tests.integration.disco_helpers import independent_continuation, stream_chunks, trace
from tests.integration.otlp_receiver import OTLPReceiver

ADMIN = {"authorization": "Bearer admin"}
MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def hat_gateway(upstream, receiver):
    worker_port = free_port()
    with mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "100"}):  # the SDK's batch: every 0.1 s, not 5 s
        gw = start_gateway(f"""
[gateway]
policy = "device"
cloud = "hat"
admin_keys = ["admin"]
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
[clouds.hat]
kind = "hat"
model = "qwen2.5-coder-0.5b-instruct"
m = 2
# Fixed prefill chunks: Eq. 3 sizes them from the measured bandwidth and the worker's g, and two prefills of the same
# input in other chunks are two computation paths (a migration's continuation is compared with a direct one).
chunk_size = 16
[clouds.hat.embedded]
port = {worker_port}
[clouds.plain]
base_url = "{upstream.base_url}"
model = "scripted"
continuation = "chat"
[telemetry]
enabled = true
endpoint = "{receiver.url}/v1/traces"
""")
    gw.worker_url = f"http://127.0.0.1:{worker_port}"
    yield gw
    stop_gateway(gw)


def test_sdk_streams_through_hat(hat_gateway, receiver):
    c = openai.OpenAI(base_url=hat_gateway.v1, api_key="x", max_retries=0, timeout=180)
    raw = c.chat.completions.with_raw_response.create(
        model="hat",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-tandem-backend"] == "hat"
    chunks = list(raw.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip()
    assert chunks[-1].usage.completion_tokens == 8
    t = trace(hat_gateway, raw.headers["x-request-id"])
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("hat", "finished")]
    assert {"hat", "hat:qwen2.5-coder-0.5b-instruct"} <= {m.id for m in c.models.list().data}

    # The session was on the live feed (replayed from the held history with Last-Event-ID 0) and in the endpoints.
    opened = closed = None
    with httpx.stream("GET", hat_gateway.v1 + "/events", headers={"Last-Event-ID": "0"}, timeout=10) as feed:
        for line in feed.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                opened = event if event["type"] == "hat.session.opened" and opened is None else opened
                closed = event if event["type"] == "hat.session.closed" else closed
            if closed is not None:
                break
    assert opened["session"] == closed["session"] and opened["backend"] == "hat"
    assert closed["worker"] == hat_gateway.worker_url and closed["mu"] >= 0 and closed["m"] == 2
    assert closed["draft_shape"].startswith("chain") and closed["rounds"] >= 1 and closed["accept_length"] >= 1
    (hat,) = [e for e in httpx.get(hat_gateway.v1 + "/endpoints", timeout=10).json()["data"] if e["name"] == "hat"]
    assert hat["locality"] == "split" and hat["hat"]["sessions"] >= 1
    assert [w["url"].partition("://")[2] for w in hat["hat"]["workers"]] == [hat_gateway.worker_url.partition("://")[2]]

    # The OpenTelemetry trace at a real OTLP/HTTP receiver: the HAT leg, and under it the session with the worker
    # used, its rounds and accept length (the same as the feed's).
    request_id = raw.headers["x-request-id"]
    assert opened["request_id"] == closed["request_id"] == request_id
    spans = receiver.wait_for(lambda spans: any(s["name"] == "tandem.hat.session" for s in spans))
    (root,) = [s for s in spans if s["attributes"].get("tandem.request_id") == request_id]
    (leg,) = [s for s in spans if s["parent"] == root["span_id"]]
    assert leg["name"] == "chat hat:qwen2.5-coder-0.5b-instruct" and leg["kind"] == "CLIENT"
    assert (
        leg["attributes"]["gen_ai.provider.name"] == "tandem.hat" and leg["attributes"]["tandem.outcome"] == "finished"
    )
    assert [name for name, _ in leg["events"]] == ["tandem.hat.session.opened", "gen_ai.first_token"]
    (session,) = [s for s in spans if s["parent"] == leg["span_id"]]
    a, worker = session["attributes"], urllib.parse.urlsplit(hat_gateway.worker_url)
    assert session["name"] == "tandem.hat.session" and session["kind"] == "CLIENT"
    assert (a["server.address"], a["server.port"]) == (worker.hostname, worker.port)
    assert a["tandem.hat.session"] == closed["session"] and a["tandem.hat.worker"] == closed["worker"]
    assert a["tandem.hat.rounds"] == closed["rounds"] >= 1 and a["tandem.hat.accept_length"] == closed["accept_length"]
    assert a["tandem.hat.m"] == 2 and a["tandem.hat.draft_shape"].startswith("chain") and a["tandem.hat.mu"] >= 0
    assert leg["start"] <= session["start"] < session["end"] and session["trace_id"] == root["trace_id"]


def _knobs(gw, **patch):
    r = httpx.put(gw.v1 + "/budget", json=patch, headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("policy", "patch", "source", "target"),
    [
        # DiSCo with no budget for its constrained side starts on the other endpoint, and moves when that pays.
        ("disco-s", {"exchange_rate": 1e6, "prices": {"hat": {"prefill": 0.0, "decode": 0.0}}}, "device", "hat"),
        ("disco-d", {"exchange_rate": 0.0, "prices": {"hat": {"prefill": 0.0, "decode": 1000.0}}}, "hat", "device"),
    ],
)
def test_migration_between_device_and_hat(hat_gateway, policy, patch, source, target):
    # HAT decodes at ~3 tok/s on this CPU, slower than a 4.8 tok/s reader: the client would never
    # be B tokens ahead, so DiSCo would (rightly) never start a migration. A slow reader lets it.
    _knobs(hat_gateway, migration=True, budget=0.0, consumption_rate=1.0, **patch)
    rid, pieces, finish = stream_chunks(hat_gateway, MESSAGES, policy=policy, max_tokens=12)
    t = trace(hat_gateway, rid)
    assert finish in ("stop", "length")
    assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [(source, target, "cost")], t
    m = t["migrations"][0]
    assert m["prefix_ids"]  # one vocabulary: the target continues from the delivered token ids
    k = m["at_token"]
    assert 0 < k < len(pieces)
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    assert independent_continuation(hat_gateway, target, MESSAGES, prefix, len(pieces) - k) == rest
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [(source, "migrated-from"), (target, "finished")]


def test_sdk_json_schema_through_hat(hat_gateway):
    """response_format json_schema pinned to HAT: the device half masks its head's logits with the grammar."""
    import json

    schema = {
        "type": "object",
        # Bounded, so the answer always fits max_tokens (an unbounded number can run on until it is cut).
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    c = openai.OpenAI(base_url=hat_gateway.v1, api_key="x", max_retries=0, timeout=180)
    raw = c.chat.completions.with_raw_response.create(
        model="hat",
        messages=[{"role": "user", "content": "Invent a person."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert raw.headers["x-tandem-backend"] == "hat"
    r = raw.parse()
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
    assert r.choices[0].finish_reason == "stop"


def test_a_streamed_forced_tool_call_through_hat_and_its_result(hat_gateway):
    """A forced call through HAT (the device half masks drafts and verification with the tool-call grammar, whose
    <tool_call> tags are Qwen's own tokens), then the tool's result read by HAT in the next turn."""
    import json

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    c = openai.OpenAI(base_url=hat_gateway.v1, api_key="x", max_retries=0, timeout=180)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    chunks = list(
        c.chat.completions.create(
            model="hat",
            messages=ask,
            tools=[weather],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    pieces = [p for ch in chunks for p in (ch.choices[0].delta.tool_calls or ())]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call_id, name = pieces[0].id, pieces[0].function.name
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert name == "get_weather" and json.loads(arguments)["city"] == "Paris"
    follow = [
        *ask,
        {
            "role": "assistant",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 31}'},
    ]
    # tool_choice "none": with the lazy call grammar of "auto" the 0.5B model calls the tool again, whole (as on
    # the device, test_tools_structured); what is tested here is that the result reaches the model through HAT.
    r = c.chat.completions.create(
        model="hat", messages=follow, tools=[weather], tool_choice="none", temperature=0, max_tokens=30
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert "31" in r.choices[0].message.content


# --- privacy levels: `split` allows HAT and never a plain cloud; `device` allows neither ----------------------------


def _sessions_opened(gw: GatewayProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gw.worker_url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("tandem_worker_sessions_opened"):
                return float(sample.value)
    raise AssertionError("no sessions_opened metric at the worker")


def _ask(gw, **body) -> httpx.Response:
    body = {"model": "tandem", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=180)


def test_split_level_uses_hat_and_never_the_plain_cloud(hat_gateway, upstream):
    upstream.reset()
    r = _ask(hat_gateway, tandem={"policy": "cloud", "cloud": "plain", "privacy": "split"})
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "device" and upstream.requests == []
    before = _sessions_opened(hat_gateway)
    r = _ask(hat_gateway, model="hat", tandem={"privacy": "split"})
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "hat"
    assert _sessions_opened(hat_gateway) == before + 1
    assert trace(hat_gateway, r.headers["x-request-id"])["privacy"] == "split"
    r = _ask(hat_gateway, model="plain", tandem={"privacy": "split"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tandem.privacy"
    assert upstream.requests == []


def test_device_level_opens_no_session_at_the_worker(hat_gateway):
    before = _sessions_opened(hat_gateway)
    r = _ask(hat_gateway, tandem={"policy": "cloud", "cloud": "hat", "privacy": "device"})
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "device"
    r = _ask(hat_gateway, model="hat", tandem={"privacy": "device"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tandem.privacy"
    assert _sessions_opened(hat_gateway) == before
