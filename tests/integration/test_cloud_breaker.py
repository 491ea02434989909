"""Clouds that fail are remembered (issue 39, item 4): a cloud answering 429 with `Retry-After` is retried after the
delay, or, when the delay is longer than the retry budget, the device answers at once and the cloud cools; while it
cools DiSCo's planner races it no more (the trace and GET /v1/endpoints say why); once the cool-down is over it is
used again.

Real parts: the gateway (`tandem serve` in a subprocess) with the small Qwen device model, and a scripted
OpenAI-compatible upstream on loopback (tests/integration/scripted_upstream.py) sending real 429s with the header.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.scripted_upstream import Answer, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "Name one prime number."}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    """DiSCo-S at b = 1: every request races the cloud and the device (unless the cloud cools)."""
    process = start_gateway(f"""
[gateway]
policy = "disco-s"
stall_timeout = 30    # a loaded CI box must not turn a slow device into a fault
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
budget = 1.0
migration = false
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 10
retry_budget_seconds = 2
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def ask(gw: GatewayProcess, model: str = "tandem") -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def trace(gw: GatewayProcess, r: httpx.Response) -> dict:
    t = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}", timeout=10)
    t.raise_for_status()
    return t.json()


def cloud_row(gw: GatewayProcess) -> dict:
    rows = httpx.get(gw.v1 + "/endpoints", timeout=10).json()["data"]
    (row,) = [e for e in rows if e["name"] == "cloud"]
    return row


def test_a_retry_after_within_the_budget_is_waited_for_and_the_retry_served(gw, upstream):
    retries = gw.metric("tandem_cloud_retries_total", backend="cloud")
    upstream.push(Answer(status=429, retry_after="1"), Answer())
    r = ask(gw, model="cloud")  # pinned: only the cloud can answer, so it is the retry that does
    first, second = upstream.completions()
    assert second.at - first.at >= 0.95  # it waited what the upstream asked, not a backoff of its own
    t = trace(gw, r)
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "finished")]
    assert r.json()["choices"][0]["message"]["content"]
    assert gw.metric("tandem_cloud_retries_total", backend="cloud") == retries + 1
    breaker = cloud_row(gw)["breaker"]
    assert breaker["state"] == "closed" and breaker["failures"] == 0  # the retry's success closed it


def test_a_long_retry_after_cools_the_cloud_and_the_device_answers_until_it_recovers(gw, upstream):
    openings = gw.metric("tandem_breaker_openings_total", backend="cloud")
    # Longer than the 2 s retry budget: no waiting, the device answers now and the cloud cools for 4 s.
    upstream.push(Answer(status=429, retry_after="4"))
    r = ask(gw)
    t = trace(gw, r)
    assert t["plan"]["kind"] == "race"
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("cloud", "failed"), ("device", "finished")]
    assert "answered 429" in t["endpoints"][0]["error"] and "cooling until" in t["endpoints"][0]["error"]
    assert len(upstream.completions()) == 1  # not retried: the wait was longer than the budget
    assert gw.metric("tandem_breaker_openings_total", backend="cloud") == openings + 1

    breaker = cloud_row(gw)["breaker"]
    assert breaker["state"] == "open" and 0 < breaker["cooling_seconds"] <= 4
    assert breaker["reason"].startswith("cooling until") and "429" in breaker["last_error"]

    # While it cools, the planner does not race it: the device alone answers, and the trace says why.
    r = ask(gw)
    t = trace(gw, r)
    if cloud_row(gw)["breaker"]["state"] == "open":  # (a very slow machine may have outlived the cool-down)
        assert t["plan"]["kind"] == "device" and "cloud cooling until" in t["plan"]["reason"]
        assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("device", "finished")]
        assert len(upstream.completions()) == 1

    # After the cool-down the cloud is raced again, and its answer closes the breaker.
    deadline = time.monotonic() + 30
    while cloud_row(gw)["breaker"]["state"] == "open":
        assert time.monotonic() < deadline, cloud_row(gw)
        time.sleep(0.2)
    sent = len(upstream.completions())
    r = ask(gw)
    t = trace(gw, r)
    assert t["plan"]["kind"] == "race" and "cooling" not in t["plan"]["reason"]
    assert len(upstream.completions()) == sent + 1
    (cloud,) = [e for e in t["endpoints"] if e["backend"] == "cloud"]
    assert cloud["outcome"] != "failed"


def test_5xx_in_a_row_are_retried_with_backoff_and_open_the_breaker(gw, upstream):
    ask(gw, model="cloud")  # an answer from the cloud closes its breaker: this test counts from zero
    assert cloud_row(gw)["breaker"]["failures"] == 0
    upstream.reset()
    retries = gw.metric("tandem_cloud_retries_total", backend="cloud")
    openings = gw.metric("tandem_breaker_openings_total", backend="cloud")
    upstream.push(Answer(status=503), Answer(status=502), Answer(status=500))
    body = {"model": "cloud", "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 502  # pinned: no other endpoint may answer
    sent = upstream.completions()
    assert len(sent) == 3  # the first try and the two retries
    assert sent[1].at - sent[0].at > 0 and sent[2].at - sent[1].at > 0
    assert gw.metric("tandem_cloud_retries_total", backend="cloud") == retries + 2
    # Three failures in a row (the default failures_to_open) opened it for the default 1 s cool-down.
    assert gw.metric("tandem_breaker_openings_total", backend="cloud") == openings + 1
    t = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}", timeout=10).json()
    assert "answered 500" in t["error"] and "cooling until" in t["error"]
    breaker = cloud_row(gw)["breaker"]
    assert breaker["failures"] == 3 and breaker["openings"] == 1 and "answered 500" in breaker["last_error"]
