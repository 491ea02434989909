"""Outline-based parallel decoding through a real gateway and the real `openai` SDK (SmolLM2 on the device): the
outline's points are expanded by sub-requests and streamed in order with usage equal to their sum; a code question
falls back with its reason; a client that leaves stops every sub-request."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.disco_helpers import trace

LIST = [{"role": "user", "content": "List some ways to save money."}]


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    process = start_gateway(
        """
[gateway]
policy = "device"
decoding = "auto"
[disco]
profile_device = false
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
""",
        wait_for=("device",),
    )
    yield process
    stop_gateway(process)


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=300)


def test_points_stream_in_order_and_usage_is_the_sum(gw):
    stream = sdk(gw).chat.completions.create(
        model="tandem",
        messages=LIST,
        max_tokens=200,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    t = trace(gw, chunks[0].id)
    decoding = t["decoding"]
    assert decoding["mode"] == "auto" and decoding["outline"] is True, decoding
    points = decoding["points"]
    assert 2 <= len(points) <= 10
    heads = [int(n) for n in re.findall(r"^(\d+)\. \*\*", text, re.MULTILINE)]
    assert heads == list(range(1, len(points) + 1))  # every point, in order
    for point in points:
        assert f"**{point['title']}**" in text
    parts = [trace(gw, rid) for rid in decoding["parts"]]
    assert decoding["parts"][0].endswith("-outline") and len(parts) == len(points) + 1
    assert usage.completion_tokens == sum(p["completion_tokens"] for p in parts)
    assert usage.prompt_tokens == sum(p["prompt_tokens"] for p in parts)
    assert t["finish_reason"] in ("stop", "length")
    # Every point continues the outline's conversation: its endpoint (here the device, one llama.cpp) finds at least
    # the outline's whole prompt in its KV cache and prefills only the point's own turn.
    outline_prompt = parts[0]["prompt_tokens"]
    for part in parts[1:]:
        (attempt,) = part["endpoints"]
        assert attempt["cached_tokens"] >= outline_prompt, (attempt, outline_prompt)
        assert attempt["prefill_tokens"] < part["prompt_tokens"] - outline_prompt


def test_a_code_question_is_answered_sequentially_with_the_reason(gw):
    question = [{"role": "user", "content": "List the steps to write a Python function that sorts a list."}]
    body = {"model": "tandem", "messages": question, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():  # the answer's first words are enough: the gate decided before them
            if '"content":"' in line and '"content":""' not in line:
                break
    t = trace(gw, r.headers["x-request-id"], patience=30)  # kept once the gateway has seen the client leave
    assert t["decoding"]["outline"] is False and "code" in t["decoding"]["reason"]
    assert "points" not in t["decoding"] and [e["backend"] for e in t["endpoints"]] == ["device"]
    # The same with decoding asked off: no gate at all.
    r = sdk(gw).chat.completions.with_raw_response.create(
        model="tandem", messages=LIST, max_tokens=8, extra_body={"tandem": {"decoding": "sequential"}}
    )
    assert "decoding" not in trace(gw, r.headers["x-request-id"])


def test_a_client_that_leaves_stops_every_sub_request(gw):
    body = {"model": "tandem", "messages": LIST, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first words of point 1: the outline is written and the points are running
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and gw.metric("tandem_backend_active_streams", backend="device") != 0:
        time.sleep(0.2)
    assert gw.metric("tandem_backend_active_streams", backend="device") == 0
    assert gw.metric("tandem_in_flight_requests") == 0
