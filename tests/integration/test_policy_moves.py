"""Policies that mean what they say, on the real backends: the paper's baselines (server-only, device-only, Stoch-S,
Stoch-D) keep an answer where they started it even when moving it would pay, while DiSCo, under the same prices,
moves it; a cloud that computes on the device's own hardware never races it; the quality policy escalates a streamed
device answer onto the cloud at an exact seam and starts an unstreamed one over there, and its knob's bad values are
400s naming the field.

Real parts: one gateway started with `tandem serve`: Qwen2.5-Coder-0.5B on llama.cpp as the device (reproducible
path), the 1.5B behind llama-cpp-python's OpenAI-compatible server on loopback as the embedded cloud "cloud" (so
co-located by construction), and the same server again as "remote", declared not co-located.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, free_port, start_gateway, stop_gateway
from tests.integration.disco_helpers import endpoints, evict_cache, independent_continuation, sdk, stream_chunks, trace

MESSAGES = [{"role": "user", "content": "Write a short Python function that reverses a string."}]
# Dear cloud decoding, free device: an answer on the cloud pays to move to the device.
DEAR_CLOUD = {"exchange_rate": 0.0, "prices": {"cloud": {"prefill": 0.0, "decode": 1000.0}}}
# Dear device energy, free cloud: an answer on the device pays to move to the cloud.
DEAR_DEVICE = {"exchange_rate": 1e6, "prices": {"cloud": {"prefill": 0.0, "decode": 0.0}}}
FREE_CLOUD = {"cloud": {"prefill": 0.0, "decode": 0.0}}


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    port = free_port()
    process = start_gateway(f"""
[gateway]
policy = "disco"
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
price = {{ prefill_per_million = 0.15, decode_per_million = 0.60 }}
[clouds.cloud.embedded]
port = {port}
n_ctx = 2048
[clouds.remote]
base_url = "http://127.0.0.1:{port}/v1"
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
co_located = false    # the same server, declared as if it were elsewhere: a race is worth it
price = {{ prefill_per_million = 0.15, decode_per_million = 0.60 }}
""")
    yield process
    stop_gateway(process)


def knobs(gw: GatewayProcess, **patch) -> dict:
    r = httpx.put(gw.v1 + "/budget", json=patch, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def answer(gw: GatewayProcess, policy: str, max_tokens: int = 24) -> dict:
    rid, pieces, finish = stream_chunks(gw, MESSAGES, policy=policy, max_tokens=max_tokens)
    assert pieces and finish in ("stop", "length")
    return trace(gw, rid)


# --- item 4: a baseline moves an answer only on a fault --------------------------------------------------------------


@pytest.mark.parametrize(
    ("baseline", "budget", "prices", "start", "disco", "disco_budget"),
    [
        # The cloud's decoding is dear: DiSCo-D with no device budget starts on the cloud, as server-only and
        # Stoch-S (every request drawn for the server at b = 1) do; only DiSCo moves the answer to the device.
        ("cloud", 0.5, DEAR_CLOUD, "cloud", "disco-d", 0.0),
        ("stoch-s", 1.0, DEAR_CLOUD, "cloud", "disco-d", 0.0),
        # The device's energy is dear: DiSCo-S with no server budget starts on the device, as device-only and
        # Stoch-D (every request drawn for the device at b = 1) do; only DiSCo moves the answer to the cloud.
        ("device", 0.5, DEAR_DEVICE, "device", "disco-s", 0.0),
        ("stoch-d", 1.0, DEAR_DEVICE, "device", "disco-s", 0.0),
    ],
)
def test_a_baseline_keeps_its_answer_where_disco_moves_it(gw, baseline, budget, prices, start, disco, disco_budget):
    # A slow reader: the buffer B = r_c * t_m fills within a few tokens, so a move that pays starts early.
    knobs(gw, policy="disco", constrained_side="auto", migration=True, consumption_rate=0.5, budget=budget, **prices)
    t = answer(gw, baseline)
    assert t["plan"]["kind"] == start, t["plan"]
    assert t["migrations"] == [], t["migrations"]
    assert endpoints(t) == [(start, "finished")]

    knobs(gw, budget=disco_budget)
    t = answer(gw, disco)
    assert t["plan"]["kind"] == start, t["plan"]
    other = "device" if start == "cloud" else "cloud"
    assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [(start, other, "cost")]


# --- item 4: a co-located cloud does not race the device -------------------------------------------------------------


def test_a_co_located_cloud_never_races_the_device(gw):
    # DiSCo-S with the whole server budget races every prompt, with a cloud that is elsewhere.
    knobs(gw, policy="disco-s", constrained_side="auto", budget=1.0, migration=False, exchange_rate=0.3)
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "tandem", "messages": MESSAGES, "max_tokens": 8, "tandem": {"cloud": "remote"}},
        timeout=180,
    )
    assert r.status_code == 200, r.text
    raced = trace(gw, r.headers["x-request-id"])
    assert raced["plan"]["kind"] == "race"
    assert sorted(e["backend"] for e in raced["endpoints"]) == ["device", "remote"]

    # The embedded cloud computes on the device's cores: the same plan keeps one endpoint, the device (the cloud's
    # TTFT is not measured yet), and only it starts.
    before = gw.metric("tandem_race_outcomes_total", winner="device") + gw.metric(
        "tandem_race_outcomes_total", winner="cloud"
    )
    for _ in range(3):
        t = answer(gw, "disco-s", max_tokens=8)
        assert t["plan"]["kind"] == "device" and "co-located" in t["plan"]["reason"], t["plan"]
        assert endpoints(t) == [("device", "finished")]
    after = gw.metric("tandem_race_outcomes_total", winner="device") + gw.metric(
        "tandem_race_outcomes_total", winner="cloud"
    )
    assert after == before


# --- item 5: a quality escalation joins at an exact seam -----------------------------------------------------------


def test_a_quality_escalation_continues_byte_for_byte(gw):
    # Moving for cost never pays here (equal decode prices): any move is the quality policy's. τ = 1: the device's
    # confidence is always below it, so the answer escalates at the first check, after the warm-up tokens.
    knobs(
        gw, policy="disco", migration=True, budget=0.0, constrained_side="server", exchange_rate=0.0, prices=FREE_CLOUD
    )
    evict_cache(gw, "cloud")  # the cloud's path must be the one independent_continuation takes: from an evicted cache
    rid, pieces, finish = _quality_stream(gw, 1.0)
    t = trace(gw, rid)
    assert finish in ("stop", "length")
    (move,) = t["migrations"]
    assert (move["from"], move["to"], move["reason"], move["restart"]) == ("device", "cloud", "quality", False)
    k = move["at_token"]
    assert 0 < k < len(pieces)
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    assert independent_continuation(gw, "cloud", MESSAGES, prefix, len(pieces) - k) == rest
    assert endpoints(t) == [("device", "migrated-from"), ("cloud", "finished")]
    assert gw.metric("tandem_migrations_total", source="device", target="cloud", reason="quality") >= 1


def test_a_quality_escalation_of_an_unstreamed_answer_starts_it_over_on_the_cloud(gw):
    """Not streamed, the client has seen nothing when the device's confidence falls: the cloud writes its own answer
    from the start (what it answers alone), the device's tokens dropped from the answer but booked."""
    knobs(
        gw, policy="disco", migration=True, budget=0.0, constrained_side="server", exchange_rate=0.0, prices=FREE_CLOUD
    )
    evict_cache(gw, "cloud")  # from position 0, as the pinned answer below
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        extra_body={"tandem": {"policy": "quality", "quality_threshold": 1.0}},
    )
    answer, t = raw.parse(), trace(gw, raw.headers["x-request-id"])
    (move,) = t["migrations"]
    assert (move["from"], move["to"], move["reason"], move["restart"]) == ("device", "cloud", "quality", True)
    assert endpoints(t) == [("device", "migrated-from"), ("cloud", "finished")]
    dropped = t["endpoints"][0]["decode_tokens"]
    assert dropped == move["at_token"] > 0
    evict_cache(gw, "cloud")
    alone = sdk(gw).chat.completions.create(model="cloud", messages=MESSAGES, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == alone.choices[0].message.content
    assert answer.usage.completion_tokens == alone.usage.completion_tokens == t["endpoints"][1]["decode_tokens"]
    # Without an escalation (τ = 0) the held answer comes out whole: the device's own, as streamed.
    kept = sdk(gw).chat.completions.create(
        model="tandem",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        extra_body={"tandem": {"policy": "quality", "quality_threshold": 0.0}},
    )
    _, pieces, _ = _quality_stream(gw, 0.0)
    assert kept.choices[0].message.content == "".join(pieces)


def _quality_stream(gw: GatewayProcess, threshold: float):
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"tandem": {"policy": "quality", "quality_threshold": threshold}},
    )
    pieces, finish = [], None
    for chunk in raw.parse():
        if chunk.choices:
            if chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
    return raw.headers["x-request-id"], pieces, finish


def test_a_threshold_of_zero_never_escalates(gw):
    knobs(
        gw, policy="disco", migration=True, budget=0.0, constrained_side="server", exchange_rate=0.0, prices=FREE_CLOUD
    )
    rid, pieces, _ = _quality_stream(gw, 0.0)
    t = trace(gw, rid)
    assert pieces and t["migrations"] == [] and endpoints(t) == [("device", "finished")]


@pytest.mark.parametrize("bad", [1.5, -0.1, "0.5", True, [0.5]])
def test_bad_quality_thresholds_are_400s_naming_the_field(gw, bad):
    body = {"model": "tandem", "messages": MESSAGES, "max_tokens": 2, "tandem": {"quality_threshold": bad}}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tandem.quality_threshold"
    r = httpx.put(gw.v1 + "/budget", json={"quality_threshold": bad}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "quality_threshold"
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200  # still serving
