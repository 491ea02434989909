"""Context windows per endpoint, on real models and a real gateway: each model reports its own window, a prompt longer
than the device's is answered by a cloud that holds it, refused where the request may use the device only, refused
naming the largest window where nothing holds it, and max_tokens above what the window leaves is clamped and said.

Real parts: one `tandem serve` on loopback for the module, its device SmolLM2-135M with a 1,024-token window and its
embedded stand-in cloud (llama-cpp-python's server) on SmolLM2-135M with 8,192; the OpenAI SDK, Ollama's /api/show
and the Anthropic Messages API over plain HTTP; traces from GET /v1/requests/{id}. The wire is the point here, not
the text (the small model; the migration rule itself: tests/unit/test_context_windows_logic.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway

DEVICE_WINDOW, CLOUD_WINDOW = 1024, 8192
SMOL = "smollm2-135m-instruct"
SHORT = [{"role": "user", "content": "Say hello."}]
ENDS_SOON = {"stop": [" ", "\n"], "temperature": 0}  # the answer ends at its first blank: a few tokens at most


def long_prompt(words: int) -> list[dict]:
    return [{"role": "user", "content": "Count the words: " + "apple " * words}]


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco"           # the default policy
[device]
model = "{SMOL}"
n_ctx = {DEVICE_WINDOW}
[disco]
profile_device = false
[clouds.cloud]
model = "{SMOL}"
tokenizer = "device"
continuation = "completions"
[clouds.cloud.embedded]
model = "{SMOL}"
port = 0
n_ctx = {CLOUD_WINDOW}
""")
    yield process
    stop_gateway(process)


def post(gw: GatewayProcess, body: dict, path: str = "/chat/completions") -> httpx.Response:
    return httpx.post(gw.v1 + path, json=body, timeout=120)


def trace(gw: GatewayProcess, response: httpx.Response) -> dict:
    return httpx.get(f"{gw.v1}/requests/{response.headers['x-request-id']}", timeout=10).json()


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_each_model_reports_its_own_window(gw):
    models = {m.id: m.model_dump() for m in openai.OpenAI(base_url=gw.v1, api_key="x").models.list().data}
    assert models["device"]["context_length"] == models["device"]["max_model_len"] == DEVICE_WINDOW
    assert models["cloud"]["context_length"] == models["cloud"]["max_model_len"] == CLOUD_WINDOW  # its embedded n_ctx
    assert models[SMOL]["context_length"] == DEVICE_WINDOW  # the model id both serve names the device
    assert models["tandem"]["context_length"] == CLOUD_WINDOW  # routed: the largest it may start on
    # The Anthropic Models API's fields on the same list: what a Messages client reads of a model.
    listed = httpx.get(gw.v1 + "/models", headers={"anthropic-version": "2023-06-01"}, timeout=10).json()
    assert listed["has_more"] is False and listed["first_id"] == "tandem"
    cloud = next(m for m in listed["data"] if m["id"] == "cloud")
    assert cloud["type"] == "model" and cloud["max_input_tokens"] == CLOUD_WINDOW - 1
    # Ollama's clients read `<architecture>.context_length`.
    for name, window in (("device", DEVICE_WINDOW), ("cloud", CLOUD_WINDOW), ("tandem", CLOUD_WINDOW)):
        shown = httpx.post(gw.url + "/api/show", json={"model": name}, timeout=10).json()
        assert shown["model_info"]["tandem.context_length"] == window, name


def test_a_prompt_longer_than_the_devices_window_is_answered_by_the_cloud(gw):
    r = post(gw, {"model": "tandem", "messages": long_prompt(1500), "max_tokens": 4, **ENDS_SOON})
    assert r.status_code == 200, r.text
    assert r.headers["x-tandem-backend"] == "cloud"
    prompt = r.json()["usage"]["prompt_tokens"]
    assert DEVICE_WINDOW < prompt < CLOUD_WINDOW
    t = trace(gw, r)
    assert [e["backend"] for e in t["endpoints"]] == ["cloud"]  # the device was never started on it
    assert t["plan"]["reason"] == f"the prompt's {prompt} tokens leave no room in device's {DEVICE_WINDOW}-token window"


@pytest.mark.parametrize(
    "route", [{"model": "device"}, {"model": "tandem", "tandem": {"policy": "device-only"}}], ids=["pinned", "policy"]
)
def test_a_prompt_the_device_cannot_hold_is_refused_where_only_the_device_may_answer(gw, route):
    error = refusal(post(gw, {**route, "messages": long_prompt(1500), "max_tokens": 4}))
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"more than the context window of {DEVICE_WINDOW} tokens of device" in error["message"]


def test_a_prompt_no_endpoint_holds_is_refused_naming_the_largest_window(gw):
    error = refusal(post(gw, {"model": "tandem", "messages": long_prompt(9000), "max_tokens": 4}))
    assert error["code"] == "context_length_exceeded"
    assert f"more than the context window of {CLOUD_WINDOW} tokens of cloud, the largest" in error["message"]
    # The Messages API refuses it in its own envelope, as Claude Code reads it.
    r = post(gw, {"model": "tandem", "max_tokens": 4, "messages": long_prompt(9000)}, "/messages")
    assert r.status_code == 400 and str(CLOUD_WINDOW) in r.json()["error"]["message"]


@pytest.mark.parametrize("model", ["device", "cloud"])
def test_max_tokens_above_the_window_left_is_clamped_and_said(gw, model):
    window = DEVICE_WINDOW if model == "device" else CLOUD_WINDOW
    r = post(gw, {"model": model, "messages": SHORT, "max_tokens": 32_000, **ENDS_SOON})
    assert r.status_code == 200, r.text
    given = window - r.json()["usage"]["prompt_tokens"]
    assert r.headers["x-tandem-max-tokens-clamped"] == f"32000->{given}"
    assert trace(gw, r)["max_tokens_clamped"] == {"asked": 32_000, "given": given, "endpoint": model}
    # As Claude Code and opencode ask it, streamed: the header comes with the first token.
    with httpx.stream(
        "POST",
        gw.v1 + "/messages",
        json={"model": model, "max_tokens": 32_000, "stream": True, "messages": SHORT, "stop_sequences": [" "]},
        timeout=120,
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-tandem-max-tokens-clamped"].startswith("32000->")
        assert "event: message_stop" in streamed.read().decode()


def test_a_request_within_the_window_is_not_clamped(gw):
    r = post(gw, {"model": "device", "messages": SHORT, "max_tokens": 8, **ENDS_SOON})
    assert r.status_code == 200 and "x-tandem-max-tokens-clamped" not in r.headers
    assert "max_tokens_clamped" not in trace(gw, r)
