"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through the real `anthropic` SDK.

Real parts: one `tandem serve` on loopback for the module, its device model Qwen2.5-Coder-0.5B (reproducible path)
and its embedded stand-in cloud (llama-cpp-python's server with Qwen2.5-Coder-1.5B), priced so that DiSCo moves an
answer that starts on the device to the cheaper cloud (as in test_migration_targets.py). The SDK is the client,
with its own stream accumulator; traces come from GET /v1/requests/{id}. The last test kills the cloud.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration import disco_helpers
from tests.integration.disco_helpers import (
    embedded_server_pid,
    endpoints,
    evict_cache,
    independent_continuation,
    signal_at,
)

KEY = "anthropic-test-key"
DEVICE_KEY = "device-only-key"
CHEAP_CLOUD = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"
ASK = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
WEATHER = {  # test_tools_structured.py's, in this API's shape
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
AUTH = {"authorization": f"Bearer {KEY}"}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
stall_timeout = 30     # the patience for a token (a migration target's first included) on busy shared cores
api_keys = ["{KEY}", {{ key = "{DEVICE_KEY}", privacy = "device" }}]
[device]
reproducible = true
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
consumption_rate = 0.1   # a slow reader: a routed answer's move to the cheap cloud comes within a few tokens
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
price = {CHEAP_CLOUD}
[clouds.cloud.embedded]
port = 0
n_ctx = 2048
""")
    yield process
    stop_gateway(process)


def client(gw: GatewayProcess, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=180)


def trace(gw: GatewayProcess, request_id: str) -> dict:
    return disco_helpers.trace(gw, request_id, key=KEY)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def greedy(extra_body: dict | None) -> dict:
    """The SDK has no sampling arguments of its own any more: temperature goes in its `extra_body`."""
    return {"temperature": 0, **(extra_body or {})}


def create(gw, model="device", messages=ASK, max_tokens=12, extra_body=None, **kw):
    return client(gw).messages.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, extra_body=greedy(extra_body), **kw
    )


def stream(gw, model="device", messages=ASK, max_tokens=12, on_text=None, pieces=None, extra_body=None, **kw):
    """A streamed message through the SDK's accumulator: (its final message, the event types in order). `pieces`
    collects the text deltas; `on_text` is called with their count after each."""
    kinds, pieces = [], [] if pieces is None else pieces
    with client(gw).messages.stream(
        model=model, messages=messages, max_tokens=max_tokens, extra_body=greedy(extra_body), **kw
    ) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "text":
                pieces.append(event.text)
                if on_text is not None:
                    on_text(len(pieces))
        return events.get_final_message(), kinds


# -- plain and streamed, on each route ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "extra", "served_by"),
    [("device", None, {"device"}), ("cloud", None, {"cloud"}), ("tandem", {"tandem": {"policy": "disco"}}, None)],
    ids=["device", "cloud", "routed"],
)
def test_plain_and_streamed_messages(gw, model, extra, served_by):
    raw = create(gw, model=model, extra_body=extra)
    message = raw.parse()
    assert raw.headers["x-request-id"] == message.id and message.id.startswith("msg_")
    assert message.type == "message" and message.role == "assistant" and message.model == model
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    assert text_of(message)
    t = trace(gw, message.id)
    assert message.usage.input_tokens == t["prompt_tokens"]
    assert served_by is None or {b for b, _ in endpoints(t)} == served_by

    final, kinds = stream(gw, model=model, extra_body=extra)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == message.usage.input_tokens
    if model == "device":  # the same path (reproducible device): the same greedy text, streamed or not
        assert text_of(final) == text_of(message)
    assert trace(gw, final.id)["completion_tokens"] == 12


def test_streamed_events_are_the_documented_sequence(gw):
    with httpx.stream(
        "POST",
        gw.v1 + "/messages",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        json={"model": "device", "messages": ASK, "max_tokens": 4, "temperature": 0, "stream": True},
        timeout=120,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert data[2]["content_block"] == {"type": "text", "text": ""}
    assert all(d["delta"]["type"] == "text_delta" for d in data[3:-3])
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 4


# -- prefill, stop sequences, count_tokens -------------------------------------------------------------------------


def test_a_prefill_is_continued(gw):
    begun = "Sure! Here is the function, named `plus`:"
    continued = create(gw, messages=[*ASK, {"role": "assistant", "content": begun}], max_tokens=8).parse()
    # The answer goes on right after the prefill (not after a closed assistant turn), without repeating it: exactly
    # what the device says after the prompt and those words (the reproducible device: one computation path).
    assert text_of(continued) == independent_continuation(gw, "device", ASK, begun, 8, AUTH)
    assert not text_of(continued).lstrip().startswith("Sure")
    final, _ = stream(gw, messages=[*ASK, {"role": "assistant", "content": begun}], max_tokens=8)
    assert text_of(final) == text_of(continued)


def test_a_stop_sequence_ends_the_answer_and_is_named(gw):
    plain = text_of(create(gw, max_tokens=10).parse())
    stop = plain.split()[1]
    message = create(gw, max_tokens=10, stop_sequences=["\u2603", stop]).parse()
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in text_of(message) and plain.startswith(text_of(message))
    final, _ = stream(gw, max_tokens=10, stop_sequences=[stop])
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_top_k_one_is_greedy_at_any_temperature(gw):
    sampled = create(gw, max_tokens=8, extra_body={"temperature": 1.0, "top_k": 1}).parse()
    assert text_of(sampled) == text_of(create(gw, max_tokens=8).parse())


def test_count_tokens_is_what_the_device_prefills(gw):
    system = "You are a terse assistant."
    counted = client(gw).messages.count_tokens(model="device", system=system, messages=ASK, tools=[WEATHER])
    message = create(gw, system=system, tools=[WEATHER], max_tokens=2).parse()
    (device,) = trace(gw, message.id)["endpoints"]
    assert counted.input_tokens == device["prefill_tokens"] + device["cached_tokens"] == message.usage.input_tokens
    shorter = client(gw).messages.count_tokens(model="device", messages=ASK)
    assert 0 < shorter.input_tokens < counted.input_tokens


# -- tools --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_a_tool_loop(gw, streamed):
    def ask(messages, **kw):
        if streamed:
            return stream(gw, messages=messages, max_tokens=40, tools=[WEATHER], **kw)[0]
        return create(gw, messages=messages, max_tokens=40, tools=[WEATHER], **kw).parse()

    first = ask(WEATHER_ASK, tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] == "Paris" and call.id.startswith("toolu_")
    answer = ask(
        [
            *WEATHER_ASK,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 31, "sky": "sunny"}'}
                ],
            },
        ]
    )
    # The result reached the model (the prompt grew by it), and the model either answered with it in words or, as the
    # 0.5B model does under `auto`'s lazy call grammar, called the tool again: then the call is whole and valid
    # (as in test_tools_structured's round trip on the device).
    if answer.stop_reason == "tool_use":
        (again,) = [b for b in answer.content if b.type == "tool_use"]
        assert again.name == "get_weather" and isinstance(again.input.get("city"), str)
    else:
        assert answer.stop_reason in ("end_turn", "max_tokens") and "31" in text_of(answer)
    assert answer.usage.input_tokens > first.usage.input_tokens + 20


def test_tool_choice_any_forces_a_call_even_when_the_question_needs_none(gw):
    message = create(
        gw,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[WEATHER],
        tool_choice={"type": "any"},
        max_tokens=30,
    ).parse()
    assert message.stop_reason == "tool_use"
    (call,) = message.content  # nothing but the call: the grammar starts it at the first token
    assert call.type == "tool_use" and call.name == "get_weather" and set(call.input) == {"city", "unit"}


# -- keys and privacy ---------------------------------------------------------------------------------------------


def test_keys_by_x_api_key_or_bearer_and_their_privacy_floor(gw):
    body = {"model": "device", "messages": ASK, "max_tokens": 1}
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        assert httpx.post(gw.v1 + "/messages", headers=headers, json=body, timeout=60).status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        client(gw, key="wrong").messages.create(model="device", messages=ASK, max_tokens=1)
    assert wrong.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as floor:
        client(gw, key=DEVICE_KEY).messages.create(model="cloud", messages=ASK, max_tokens=1)
    assert "privacy level 'device'" in floor.value.body["error"]["message"]


# -- bad input ----------------------------------------------------------------------------------------------------


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [IMAGE]}], "max_tokens": 4}, "messages[0].content[0].image"),
        ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking"),  # no such type
        ({"messages": [{"role": "assistant", "content": "Hi"}, *ASK], "max_tokens": 4}, "first message"),
        ({"messages": [*ASK, *ASK], "max_tokens": 4}, "alternate"),
        ({"messages": [*ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, "role"),
        ({"messages": ASK, "max_tokens": 10**30}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 4, "top_k": 2**64}, "top_k"),
        ({"messages": ASK, "max_tokens": 4, "temperature": 1.5}, "temperature"),
        ({"messages": ASK, "max_tokens": 4, "stream_options": {}}, "stream_options"),
        (
            {"messages": ASK, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
            "tool_choice",
        ),
    ],
    ids=[
        "no-max_tokens",
        "image",
        "thinking",
        "assistant-first",
        "same-role-twice",
        "stray-tool_result",
        "huge-max_tokens",
        "huge-top_k",
        "temperature",
        "unknown-field",
        "unknown-tool",
    ],
)
def test_bad_input_is_a_400_in_anthropics_envelope(gw, body, named):
    r = httpx.post(gw.v1 + "/messages", headers={"x-api-key": KEY}, json={"model": "device", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    assert r.headers["x-request-id"]


def test_surrogates_and_unknown_models_through_the_sdk(gw):
    raw = '{"model": "device", "max_tokens": 4, "messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    r = httpx.post(
        gw.v1 + "/messages", headers={"x-api-key": KEY, "content-type": "application/json"}, content=raw, timeout=30
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(gw).messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client(gw).messages.count_tokens(model="device", messages=[{"role": "user", "content": [IMAGE]}])
    # The gateway keeps serving.
    assert text_of(create(gw, max_tokens=2).parse())


# -- an answer that moves, and one whose endpoint dies, arrive whole -------------------------------------------------


def test_a_streamed_answer_that_migrates_arrives_whole(gw):
    evict_cache(gw, "cloud", AUTH)  # the cloud's path is then the one independent_continuation takes
    final, kinds = stream(gw, model="tandem", max_tokens=24)
    t = trace(gw, final.id)
    (migration,) = t["migrations"]
    assert endpoints(t) == [("device", "migrated-from"), ("cloud", "finished")]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24 == t["completion_tokens"]
    assert kinds.count("content_block_start") == 1  # one text block across the move
    # Nothing lost or repeated at the seam: the device's own start, then what the cloud says after exactly that.
    k, text = migration["at_token"], text_of(final)
    device_part = text_of(create(gw, max_tokens=k).parse())
    assert text.startswith(device_part)
    assert text[len(device_part) :] == independent_continuation(gw, "cloud", ASK, device_part, 24 - k, AUTH)


def test_a_streamed_answer_whose_endpoint_dies_arrives_whole(gw):
    """Last: the cloud is killed."""
    kill_after_three, killed = signal_at(embedded_server_pid(gw), signal.SIGKILL, 3)
    pieces: list[str] = []
    final, kinds = stream(
        gw,
        model="tandem",
        max_tokens=16,
        on_text=kill_after_three,
        pieces=pieces,
        extra_body={"tandem": {"policy": "cloud"}},
    )
    assert killed.is_set()
    t = trace(gw, final.id)
    assert [m["reason"] for m in t["migrations"]] == ["error"]
    assert endpoints(t) == [("cloud", "failed"), ("device", "finished")]
    assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens == t["completion_tokens"]
    assert "error" not in kinds and kinds[-1] == "message_stop"
    k = t["migrations"][0]["at_token"]
    assert 0 < k < len(pieces) and text_of(final) == "".join(pieces)
    # The device's part is exactly what it says after the prompt and the cloud's delivered part: no token
    # repeated, skipped or lost at the seam.
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    assert independent_continuation(gw, "device", ASK, prefix, len(pieces) - k, AUTH) == rest


# -- count_tokens under a key's limits -------------------------------------------------------------------------------

LIMITED_KEY, ADMIN_KEY = "limited-key", "admin-key"


@pytest.fixture(scope="module")
def limited_gw() -> Iterator[GatewayProcess]:
    """A device-only gateway whose one API key allows 2 requests a minute, one at a time."""
    process = start_gateway(f"""
[gateway]
policy = "device"
api_keys = [{{ key = "{LIMITED_KEY}", name = "limited", rpm = 2, max_streams = 1 }}]
admin_keys = ["{ADMIN_KEY}"]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
""")
    yield process
    stop_gateway(process)


def key_line(gw: GatewayProcess) -> dict:
    budget = httpx.get(gw.v1 + "/budget", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
    (line,) = [k for k in budget["keys"] if k["name"] == "limited"]
    return line


def test_count_tokens_leaves_a_limited_keys_counters_unchanged(limited_gw):
    """A count renders and counts, admits nothing: more counts than the key's rate allows all answer, its counters
    stay at zero, and its two requests of the minute are still there to be made."""
    if time.time() % 60 > 45:  # the limit is per calendar minute: start inside one
        time.sleep(61 - time.time() % 60)
    c = client(limited_gw, LIMITED_KEY)
    before = key_line(limited_gw)
    counts = [c.messages.count_tokens(model="device", messages=ASK).input_tokens for _ in range(5)]
    assert len(set(counts)) == 1 and counts[0] > 0
    after = key_line(limited_gw)
    assert (after["requests_this_minute"], after["streams"], after["reserved_usd"]) == (0, 0, 0.0)
    assert after == before
    made = c.messages.with_raw_response.create(model="device", messages=ASK, max_tokens=2)
    assert made.headers["x-ratelimit-remaining-requests"] == "1"
