"""The live event feed (GET /v1/events) and the OpenTelemetry traces, on a real gateway.

Real parts: `tandem serve` in a subprocess with the real SmolLM2 device model, a scripted OpenAI-compatible cloud on
loopback (tests/integration/scripted_upstream.py) that answers first and then breaks mid-answer, the openai SDK as
client, and a real OTLP/HTTP receiver on loopback (tests/integration/otlp_receiver.py) that decodes what the
gateway's exporter sends with opentelemetry-proto. Every request races (disco-s at b = 1): the cloud wins, the
device's start is the loser, the cloud breaks after four pieces and the device continues: a race with a migration.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from unittest import mock

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.disco_helpers import evict_cache
from tests.integration.otlp_receiver import OTLPReceiver
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

SMOL = "smollm2-135m-instruct"
KEY = "feed-key"
# Long enough that the device's prefill takes longer than the scripted cloud's first piece: the cloud wins the race.
MESSAGES = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(40))}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, receiver: OTLPReceiver) -> Iterator[GatewayProcess]:
    with mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "100"}):  # the SDK's batch: every 0.1 s, not 5 s
        process = start_gateway(f"""
[gateway]
policy = "disco-s"
api_keys = ["{KEY}"]
stall_timeout = 30    # a loaded CI box must not turn a slow device into a fault
[device]
model = "{SMOL}"
n_ctx = 2048
prompt_cache_mb = 0        # evict_cache's "evaluated from position 0" holds only without stored states
prompt_cache_disk_mb = 0   # (the fast path: docs/prompt-cache.md, "Exactness")
[disco]
budget = 1.0          # disco-s at b = 1: every request races
migration = false     # only the fault moves the answer
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 3
[telemetry]
enabled = true
endpoint = "{receiver.url}/v1/traces"
service_name = "tandem-test"
""")
    yield process
    stop_gateway(process)


class Feed:
    """GET /v1/events read on a thread of its own, as a dashboard would."""

    def __init__(self, gw: GatewayProcess, last_id: int | None = None):
        self.events: list[dict] = []
        self.raw: list[str] = []
        self.connected = threading.Event()
        self.closed = False
        headers = {"Authorization": f"Bearer {KEY}"}
        if last_id is not None:
            headers["Last-Event-ID"] = str(last_id)
        self.client = httpx.Client(timeout=httpx.Timeout(30, read=None))
        self.thread = threading.Thread(target=self._read, args=(gw.v1 + "/events", headers), daemon=True)
        self.thread.start()
        assert self.connected.wait(10), "the feed did not open"

    def _read(self, url: str, headers: dict) -> None:
        try:
            with self.client.stream("GET", url, headers=headers) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                self.connected.set()
                for line in r.iter_lines():
                    self.raw.append(line)
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except httpx.HTTPError:
            if not self.closed:
                raise

    def until(self, predicate, timeout: float = 30.0) -> list[dict]:
        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            while not deadline.is_set():
                if predicate(self.events):
                    return self.events
                deadline.wait(0.02)
        finally:
            timer.cancel()
        raise AssertionError(f"the feed did not get there in {timeout} s: {[e['type'] for e in self.events]}")

    def close(self) -> None:
        self.closed = True
        self.client.close()


def _chat(gw: GatewayProcess) -> tuple[str, str]:
    client = openai.OpenAI(base_url=gw.v1, api_key=KEY, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="tandem", messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return raw.headers["x-request-id"], text


def _finished(request_id: str):
    return lambda events: any(e["type"] == "request.finished" and e.get("request_id") == request_id for e in events)


def _cloud_wins_the_race(gw: GatewayProcess) -> None:
    """The race these tests watch is the scripted cloud's to win (its first token in milliseconds): the device must
    evaluate the prompt from position 0, not answer at once from the previous test's cached prefix of it."""
    evict_cache(gw, "device", {"Authorization": f"Bearer {KEY}"})


def test_feed_shows_a_race_with_a_migration_live_and_resumes_after_last_event_id(gw, upstream):
    feed = Feed(gw)
    _cloud_wins_the_race(gw)
    upstream.push(Answer(pieces=PIECES[:4], then="close"))
    request_id, text = _chat(gw)
    assert text.startswith("".join(PIECES[:4]))
    events = [e for e in feed.until(_finished(request_id)) if e.get("request_id") == request_id]
    feed.close()
    kinds = [(e["type"], e.get("backend")) for e in events]
    assert kinds[0] == ("request.planned", None) and events[0]["plan"] == "race"
    assert ("endpoint.won", "cloud") in kinds and ("endpoint.lost", "device") in kinds
    assert ("endpoint.failed", "cloud") in kinds
    assert kinds.index(("migration.started", None)) < kinds.index(("migration.completed", None))
    assert ("endpoint.finished", "device") in kinds and kinds[-1] == ("request.finished", None)
    migration = next(e for e in events if e["type"] == "migration.completed")
    assert (migration["from"], migration["to"], migration["reason"]) == ("cloud", "device", "error")
    assert migration["at_token"] == 4
    trace = events[-1]["trace"]
    assert trace["id"] == request_id and [m["reason"] for m in trace["migrations"]] == ["error"]
    ids = [e["id"] for e in feed.events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # No event carries the prompt or the answer.
    assert "item 39" not in "\n".join(feed.raw) and PIECES[3] not in "\n".join(feed.raw)

    # A viewer that reconnects with Last-Event-ID gets exactly what followed that event, then goes on live.
    planned = events[0]["id"]
    resumed = Feed(gw, last_id=planned)
    after = resumed.until(lambda evs: any(e["id"] == ids[-1] for e in evs))
    assert [e["id"] for e in after][: len(ids) - ids.index(planned) - 1] == ids[ids.index(planned) + 1 :]
    assert all(e["type"] != "dropped" for e in after)
    resumed.close()


def test_the_feed_needs_the_api_key_and_a_numeric_last_event_id(gw):
    assert httpx.get(gw.v1 + "/events", timeout=5).status_code == 401
    r = httpx.get(gw.v1 + "/events", headers={"Authorization": f"Bearer {KEY}", "Last-Event-ID": "x"}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_spans_of_a_race_with_a_migration_reach_a_real_otlp_receiver(gw, upstream, receiver):
    _cloud_wins_the_race(gw)
    upstream.push(Answer(pieces=PIECES[:4], then="close"))
    request_id, _ = _chat(gw)

    def complete(spans):
        roots = [s for s in spans if s["attributes"].get("tandem.request_id") == request_id]
        return roots and len([s for s in spans if s["parent"] == roots[0]["span_id"]]) >= 3

    spans = receiver.wait_for(complete)
    root = next(s for s in spans if s["attributes"].get("tandem.request_id") == request_id)
    legs = sorted((s for s in spans if s["parent"] == root["span_id"]), key=lambda s: s["start"])
    a = root["attributes"]
    assert root["name"] == "chat tandem" and root["kind"] == "SERVER" and root["parent"] is None
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tandem"
    assert a["gen_ai.response.id"] == request_id and a["tandem.plan"] == "race"
    assert a["gen_ai.response.finish_reasons"][0] in ("length", "stop")
    assert a["gen_ai.usage.input_tokens"] > 100 and a["gen_ai.response.time_to_first_chunk"] > 0
    assert a["tandem.cost_usd"] > 0 and a["tandem.migrations"] == 1
    assert [name for name, _ in root["events"]] == ["tandem.migration.started", "tandem.migration.completed"]
    assert root["events"][1][1]["tandem.migration.reason"] == "error"

    by_outcome = {(s["attributes"]["tandem.backend"], s["attributes"]["tandem.outcome"]): s for s in legs}
    assert set(by_outcome) == {("cloud", "failed"), ("device", "lost"), ("device", "finished")}
    cloud, lost, moved = by_outcome["cloud", "failed"], by_outcome["device", "lost"], by_outcome["device", "finished"]
    assert cloud["kind"] == "CLIENT" and lost["kind"] == moved["kind"] == "INTERNAL"
    assert cloud["name"] == "chat scripted" and cloud["attributes"]["gen_ai.provider.name"] == "openai"
    assert moved["attributes"]["gen_ai.provider.name"] == "tandem.device"
    assert moved["name"] == f"chat {SMOL}" and moved["attributes"]["gen_ai.request.model"] == SMOL
    assert cloud["status"] == 2 and cloud["attributes"]["error.type"] == "502"  # STATUS_CODE_ERROR
    assert [name for name, _ in cloud["events"]] == ["gen_ai.first_token"]
    assert moved["attributes"]["tandem.migration"] is True and moved["attributes"]["tandem.from_token"] == 4
    assert moved["links"] == [(cloud["span_id"], {"tandem.link": "continues"})]
    assert cloud["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert 4 + moved["attributes"]["gen_ai.usage.output_tokens"] == a["gen_ai.usage.output_tokens"] <= 8
    assert {s["trace_id"] for s in [root, *legs]} == {root["trace_id"]}
    assert {"service.name": "tandem-test"}.items() <= receiver.resources[0].items()
