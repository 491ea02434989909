"""Usage priced the way providers bill it, end to end: what an upstream reports reaches the client and the ledger.

A reasoning upstream streams `reasoning_content` deltas and a usage chunk with `prompt_tokens_details.cached_tokens`
and `completion_tokens_details.reasoning_tokens`; the client (the real `openai` SDK) gets the thinking unchanged,
in order, before the answer, and the usage parts; the request is booked at the cloud's cached and reasoning prices.
An answer the device started and DiSCo moved to a cheaper cloud is booked, on the cloud's side, at what that cloud
reported for the prompt and prefix it was sent again (cached where it says so).

Real parts: `tandem serve` with the SmolLM2 device model; a scripted OpenAI-compatible upstream on loopback (real
HTTP, tests/integration/scripted_upstream.py) that sends these fields as providers do; the real embedded stand-in
cloud (llama-cpp-python's server), which reports no usage in a stream, for the fallback to the gateway's counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.disco_helpers import sdk, trace
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

M = 1e-6
THINKING = ("Two", " plus", " two", " is", " four.")
THINKER_USAGE = {
    "prompt_tokens": 30,
    "completion_tokens": 9,
    "prompt_tokens_details": {"cached_tokens": 16},
    "completion_tokens_details": {"reasoning_tokens": 8},
}
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    # As in test_migration_targets: λ so high that SmolLM2's decoding is dearer than the cheap cloud's, and a slow
    # reader, so an answer the device starts moves to "cloud" within a few tokens.
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
stall_timeout = 5
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
exchange_rate = 50
consumption_rate = 1
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
price = {{ prefill_per_million = 0.05, decode_per_million = 0.10, cached_per_million = 0.01 }}
[clouds.thinker]
base_url = "{upstream.base_url}"
model = "scripted-thinker"
continuation = "chat"
[clouds.thinker.price]
prefill_per_million = 1.0
decode_per_million = 4.0
cached_per_million = 0.25
reasoning_per_million = 6.0
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def thinker_cost() -> float:
    u = THINKER_USAGE
    cached, reasoning = 16, 8
    return ((u["prompt_tokens"] - cached) * 1.0 + cached * 0.25 + (9 - reasoning) * 4.0 + reasoning * 6.0) * M


def test_reasoning_streams_through_unchanged_and_usage_parts_are_priced(gw, upstream):
    upstream.push(Answer(reasoning=THINKING, pieces=("4",), usage=THINKER_USAGE))
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="thinker", messages=MESSAGES, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    thinking, content, usage = [], [], None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if (delta.model_extra or {}).get("reasoning_content"):
            assert not content, "thinking after the answer began"
            thinking.append(delta.model_extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
    assert thinking == list(THINKING) and content == ["4"]
    assert usage.completion_tokens == 9 and usage.completion_tokens_details.reasoning_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens == min(16, usage.prompt_tokens)
    (sent,) = upstream.requests
    assert sent.body["stream_options"] == {"include_usage": True}  # the gateway asked for the usage it books
    t = trace(gw, raw.headers["x-request-id"])
    (thinker,) = t["endpoints"]
    assert thinker["billed"] == {
        "prompt_tokens": 30,
        "cached_tokens": 16,
        "completion_tokens": 9,
        "reasoning_tokens": 8,
    }
    assert t["cost_usd"] == pytest.approx(thinker_cost())


def test_a_collected_answer_carries_its_reasoning_beside_its_content(gw, upstream):
    upstream.push(Answer(reasoning=THINKING, pieces=("4",), usage=THINKER_USAGE))
    before = httpx.get(gw.v1 + "/budget").json()["spend"]["endpoints"].get("cloud", {})
    r = sdk(gw).chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=20)
    message = r.choices[0].message
    assert message.content == "4" and message.model_extra["reasoning_content"] == "".join(THINKING)
    assert r.usage.completion_tokens_details.reasoning_tokens == 8
    after = httpx.get(gw.v1 + "/budget").json()["spend"]["endpoints"]["cloud"]
    assert after["cached_tokens"] - before.get("cached_tokens", 0) == 16
    assert after["reasoning_tokens"] - before.get("reasoning_tokens", 0) == 8
    assert after["cost_usd"] - before.get("cost_usd", 0.0) == pytest.approx(thinker_cost())


def test_the_prefix_a_migration_resends_is_booked_at_what_the_cloud_reported(gw, upstream):
    reported = {
        "prompt_tokens": 4200,
        "completion_tokens": len(PIECES),
        "prompt_tokens_details": {"cached_tokens": 4096},
    }
    upstream.push(Answer(usage=reported))
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={
            "model": "tandem",
            "messages": MESSAGES,
            "max_tokens": 40,
            "temperature": 0,
            "tandem": {"cloud": "cloud"},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    t = trace(gw, r.headers["x-request-id"])
    device, cloud = t["endpoints"]
    assert (device["outcome"], cloud["outcome"]) == ("migrated-from", "finished")
    (sent,) = upstream.completions()
    assert sent.body["stream_options"] == {"include_usage": True}
    assert cloud["billed"] == {
        "prompt_tokens": 4200,
        "cached_tokens": 4096,
        "completion_tokens": 10,
        "reasoning_tokens": 0,
    }
    cloud_cost = ((4200 - 4096) * 0.05 + 4096 * 0.01 + 10 * 0.10) * M
    device_cost = t["cost_usd"] - cloud_cost
    assert device_cost > 0  # the device's part, priced by its energy
    # Without the report, the whole re-sent context (prompt + delivered prefix, the gateway's count) at the input
    # price: what the same migration costs on the cloud's side then.
    upstream.push(Answer())
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={
            "model": "tandem",
            "messages": MESSAGES,
            "max_tokens": 40,
            "temperature": 0,
            "tandem": {"cloud": "cloud"},
        },
        timeout=120,
    )
    t = trace(gw, r.headers["x-request-id"])
    _, cloud = t["endpoints"]
    context = t["prompt_tokens"] + cloud["from_token"]
    assert cloud["billed"] == {
        "prompt_tokens": context,
        "cached_tokens": 0,
        "completion_tokens": 10,
        "reasoning_tokens": 0,
    }


def test_the_embedded_cloud_reports_no_usage_in_a_stream_so_the_gateways_counts_are_booked(gateway):
    r = httpx.post(
        gateway.v1 + "/chat/completions",
        json={"model": "cloud", "messages": MESSAGES, "max_tokens": 1, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    (cloud,) = trace(gateway, r.headers["x-request-id"])["endpoints"]
    assert cloud["billed"] == {
        "prompt_tokens": cloud["prefill_tokens"],
        "cached_tokens": 0,
        "completion_tokens": cloud["decode_tokens"],
        "reasoning_tokens": 0,
    }
