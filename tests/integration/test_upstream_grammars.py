"""Grammars sent to upstreams that take them (clients/gbnf.py), through the real `openai` SDK against real gateways:
forced tool calls (streamed and not), json_schema and json_object answers pinned to the embedded cloud
(llama-cpp-python's server, conftest's `gateway`) follow them; llama.cpp's own llama-server
(conftest's `llama_server_smollm`) follows one too, and takes a JSON answer over mid-way from the device under the
schema's residual grammar (a cost migration: DiSCo moves the answer to the cheaper cloud after a few tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.disco_helpers import trace
from tests.integration.test_tools_structured import (
    ASK,
    CITY,
    WEATHER,
    sdk,
    streamed,
    valid_city,
    valid_weather_arguments,
)

LYON = [{"role": "user", "content": "Describe the city of Lyon as JSON."}]


def test_a_forced_tool_call_pinned_to_the_embedded_cloud_follows_the_call_grammar(gateway):
    r = sdk(gateway).chat.completions.with_raw_response.create(
        model="cloud",
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    assert r.headers["x-tandem-backend"] == "cloud"
    c = r.parse().choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather" and valid_weather_arguments(call.function.arguments)["city"] == "Paris"


def test_a_streamed_forced_call_from_the_embedded_cloud_comes_whole(gateway):
    content, calls, finish = streamed(
        sdk(gateway).chat.completions.create(
            model="cloud",
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and valid_weather_arguments(calls[0]["arguments"])


def test_json_schema_pinned_to_the_embedded_cloud_validates(gateway):
    content, calls, finish = streamed(
        sdk(gateway).chat.completions.create(
            model="cloud", messages=LYON, response_format=CITY, temperature=0, max_tokens=60, stream=True
        )
    )
    assert not calls and finish == "stop"
    valid_city(content)


def test_json_object_pinned_to_the_embedded_cloud_parses(gateway):
    r = sdk(gateway).chat.completions.with_raw_response.create(
        model="cloud",
        messages=[{"role": "user", "content": "Give me a JSON object with a short greeting."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    assert r.headers["x-tandem-backend"] == "cloud"
    c = r.parse().choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


# --- llama.cpp's llama-server as the cloud ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_gw(llama_server_smollm) -> Iterator[GatewayProcess]:
    # SmolLM2 on both sides (one tokenizer: raw-completions continuation); a cheap cloud and a dear device decoder,
    # and a slow reader, so DiSCo moves an answer that starts on the device to llama-server within a few tokens.
    gw = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
cloud = "llama"
stall_timeout = 10
[device]
reproducible = true
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
exchange_rate = 50
consumption_rate = 1
[clouds.llama]
base_url = "{llama_server_smollm.v1}"
model = "smollm2-135m-instruct"
tokenizer = "device"
continuation = "completions"
structured_output = "gbnf"
price = {{ prefill_per_million = 0.05, decode_per_million = 0.10 }}
""")
    yield gw
    stop_gateway(gw)


def test_json_schema_pinned_to_llama_server_validates(llama_gw):
    r = sdk(llama_gw).chat.completions.with_raw_response.create(
        model="llama", messages=LYON, response_format=CITY, temperature=0, max_tokens=60
    )
    assert r.headers["x-tandem-backend"] == "llama"
    c = r.parse().choices[0]
    assert c.finish_reason == "stop"
    valid_city(c.message.content)


def test_llama_server_takes_a_json_answer_over_under_the_schema(llama_gw):
    r = sdk(llama_gw).chat.completions.with_raw_response.create(
        model="tandem", messages=LYON, response_format=CITY, temperature=0, max_tokens=60
    )
    t = trace(llama_gw, r.headers["x-request-id"])
    (migration,) = t["migrations"]
    assert "error" not in migration and migration["to"] == "llama" and migration["at_token"] > 0
    outcomes = [(e["backend"], e["outcome"]) for e in t["endpoints"]]
    assert outcomes == [("device", "migrated-from"), ("llama", "finished")]
    c = r.parse().choices[0]
    assert c.finish_reason == "stop"
    valid_city(c.message.content)  # the device's part and llama-server's, joined, are one valid answer
