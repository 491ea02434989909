"""Absurd budget values refused at PUT, on a real gateway (a real `tandem serve`, a scripted OpenAI-compatible cloud on
loopback, the `openai` SDK): a price or exchange rate of 1e308 is finite, and was accepted; every cloud answer then
ended mid-stream with server_error "cannot convert float infinity to integer" (the micro-dollar booking overflowed).
Now it is a 400 naming the field, and the gateway keeps answering, at the bounds too (docs/disco.md, "The budget's
knobs")."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from app.serving.budget import MAX_EXCHANGE_RATE, MAX_PRICE
from tests.integration.scripted_upstream import PIECES, ScriptedUpstream

ADMIN, KEY = "absurd-admin", "absurd-key"


@pytest.fixture(scope="module")
def gateway(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
cloud = "cloud"
state_file = ""
admin_keys = ["{ADMIN}"]
api_keys = [{{ key = "{KEY}", name = "capped", cap_usd = 1000000 }}]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
n_threads = 1
[disco]
profile_device = false
migration = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
price = {{ prefill_per_million = 150.0, decode_per_million = 600.0 }}
""",
        wait_for=("device", "cloud"),
    )
    yield gw
    stop_gateway(gw)


def put(gw: GatewayProcess, patch: dict) -> httpx.Response:
    return httpx.put(gw.v1 + "/budget", json=patch, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)


def budget(gw: GatewayProcess) -> dict:
    r = httpx.get(gw.v1 + "/budget", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_answer(gw: GatewayProcess) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=gw.v1, api_key=KEY, max_retries=0)
    text, finish = [], None
    for chunk in client.chat.completions.create(
        model="tandem", messages=[{"role": "user", "content": "What is the answer?"}], max_tokens=50, stream=True
    ):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"prices": {"cloud": {"prefill": 1e308, "decode": 1e308}}}, "prices.cloud.prefill"),
        ({"prices": {"cloud": {"decode": 1e308}}}, "prices.cloud.decode"),
        ({"exchange_rate": 1e308}, "exchange_rate"),
        ({"consumption_rate": 1e308}, "consumption_rate"),
    ],
)
def test_an_absurd_value_is_a_400_naming_the_field_and_the_gateway_keeps_answering(gateway, patch, field):
    before = budget(gateway)
    r = put(gateway, patch)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_value" and "at most" in error["message"]
    after = budget(gateway)
    assert {k: after[k] for k in ("prices", "exchange_rate", "consumption_rate", "version")} == {
        k: before[k] for k in ("prices", "exchange_rate", "consumption_rate", "version")
    }
    assert streamed_answer(gateway) == ("".join(PIECES), "stop")


def test_at_the_bounds_answers_stream_to_their_end_and_the_books_stay_finite(gateway):
    dearest = {"prices": {"cloud": {"prefill": MAX_PRICE, "decode": MAX_PRICE}}, "exchange_rate": MAX_EXCHANGE_RATE}
    assert put(gateway, dearest).status_code == 200
    try:
        before = budget(gateway)["spend"]["cost_micro"]
        assert streamed_answer(gateway) == ("".join(PIECES), "stop")
        spend = budget(gateway)["spend"]
        assert math.isfinite(spend["cost_usd"]) and spend["cost_micro"] > before
    finally:
        assert put(gateway, {"prices": {"cloud": {"prefill": 150.0, "decode": 600.0}}, "exchange_rate": 0.3}).is_success
