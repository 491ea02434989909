"""A request is booked under the constrained side it was dispatched under: its own policy's.

The case: prices make the server the constrained side ("auto", a cloud dearer than the device's energy), and a
request asks for `disco-d` (device-constrained) with a device budget of 0, so DiSCo-D sends it to the cloud
alone. The device processed none of its input, so the realised budget ratio (the constrained endpoint's share
of input tokens) must be 0 — booking it with the configured side instead would count the cloud as the
constrained endpoint and report 1.

Real parts: `tandem serve` with the SmolLM2 device model and a scripted OpenAI-compatible upstream on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.scripted_upstream import ScriptedUpstream


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco"
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
""")
    yield process
    stop_gateway(process)


def test_a_disco_d_request_is_booked_device_constrained(gw):
    budget = httpx.get(gw.v1 + "/budget").json()
    assert budget["effective_side"] == "server"  # the configured policy, by prices
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={
            "model": "tandem",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "tandem": {"policy": "disco-d"},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    t = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}").json()
    assert t["plan"]["policy"] == "disco-d" and [e["endpoint"] for e in t["endpoints"]] == ["cloud"]
    window = httpx.get(gw.v1 + "/budget").json()["spend"]["window"]
    assert window["input_tokens"] == t["prompt_tokens"] > 0
    assert window["constrained_input_tokens"] == 0 and window["realised_budget"] == 0.0
