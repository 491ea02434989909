"""Tools and structured output through the real `openai` SDK against real gateways: forced tool calls and
json_schema answers from the real device model under its grammar, a tool result round trip, pass-through to a
chat upstream, and what happens when an endpoint cannot enforce a request's structure, races, and faults in the
middle of a tool call or of a JSON answer (the scripted upstream fails as told; the device takes over).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.disco_helpers import trace
from tests.integration.scripted_upstream import Answer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CITY = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "strict": True,
        # Bounded, so every answer fits the tests' max_tokens whatever the model writes (at most 16 + 16 + 8
        # characters of values, each at least one token): an unbounded number can run on until max_tokens cuts it.
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                "country": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
            },
            "required": ["name", "country", "population"],
            "additionalProperties": False,
        },
    },
}


def sdk(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=300)


def valid_weather_arguments(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    return args


def valid_city(content: str) -> dict:
    city = json.loads(content)
    assert set(city) == {"name", "country", "population"}
    assert isinstance(city["name"], str) and isinstance(city["country"], str) and isinstance(city["population"], int)
    return city


def streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index with their argument pieces joined, finish reason) of a streamed answer."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["name"] = piece.function.name or call["name"]
                    call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), calls, finish


# --- the device: Qwen2.5-Coder-0.5B under llguidance grammars (conftest's embedded default) ----------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_has_valid_arguments(gateway, choice):
    r = sdk(gateway).chat.completions.create(
        model="device", messages=ASK, tools=[TIME, WEATHER], tool_choice=choice, temperature=0, max_tokens=120
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        assert valid_weather_arguments(call.function.arguments)["city"] == "Paris"
    else:
        assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["zone"], str)


def test_a_streamed_forced_call_comes_whole_in_the_openai_shape(gateway):
    stream = sdk(gateway).chat.completions.create(
        model="device",
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish = streamed(stream)
    assert content == "" and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert valid_weather_arguments(calls[0]["arguments"])["city"] == "Paris"


@pytest.mark.parametrize("model", ["device", "cloud"])  # the embedded cloud reads the same rendered prompt
def test_a_tool_result_round_trip(gateway, model):
    client = sdk(gateway)
    first = client.chat.completions.create(
        model="device", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=120
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # the assistant turn with its tool_calls
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 31, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=60
    )
    answer = second.choices[0]
    # The result reached the prompt: the same question without it is a shorter prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20
    # Both bundled models call the tool again rather than answer. Unconstrained, the 0.5B model wrote a bare call
    # and then echoed the result (`{"name": ...}\n{"temperature": 31, ...}`), which read as text; under the lazy
    # call grammar (tool_choice auto) the call it starts is whole and ends the turn. Either way a well-formed turn:
    # a whole call, or an answer that read the result.
    if answer.finish_reason == "tool_calls":
        assert answer.message.tool_calls and not answer.message.content
        for again in answer.message.tool_calls:
            assert again.function.name == "get_weather" and valid_weather_arguments(again.function.arguments)
    else:
        assert not answer.message.tool_calls and "31" in answer.message.content, answer


@pytest.mark.parametrize("model", ["device", "cloud"])
def test_auto_reads_the_bare_json_calls_qwen_coder_writes(gateway, model):
    # Unconstrained, both bundled models answer this with a bare {"name": ..., "arguments": ...} (no tags).
    r = sdk(gateway).chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=60
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments)["city"] == "Paris"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(gateway, stream):
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Describe the city of Lyon as JSON."}]
    if stream:
        content, calls, finish = streamed(
            client.chat.completions.create(
                model="device", messages=ask, response_format=CITY, temperature=0, max_tokens=120, stream=True
            )
        )
        assert not calls
    else:
        r = client.chat.completions.create(
            model="device", messages=ask, response_format=CITY, temperature=0, max_tokens=120
        )
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    assert valid_city(content)["name"] == "Lyon"


def test_json_object_output_parses(gateway):
    r = sdk(gateway).chat.completions.create(
        model="device",
        messages=[{"role": "user", "content": "Give me a JSON object with a greeting."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_an_endpoint_that_cannot_enforce_the_structure_is_not_used(scripted_gw, upstream):
    # A completions upstream that takes no grammar (structured_output = "none") cannot serve a forced call pinned
    # to it (the embedded cloud takes GBNF: tests/integration/test_upstream_grammars.py).
    upstream.reset()
    pinned = httpx.post(
        scripted_gw.v1 + "/chat/completions",
        json={"model": "raw", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"},
        timeout=60,
    )
    assert pinned.status_code == 400 and "cannot serve" in pinned.json()["error"]["message"]
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_tools_and_formats_are_named(gateway, patch, param):
    r = httpx.post(gateway.v1 + "/chat/completions", json={"model": "device", "messages": ASK, **patch}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# --- a chat upstream (scripted) and a completions upstream in front of the SmolLM2 device -------------------------


@pytest.fixture(scope="module")
def scripted_gw(upstream) -> Iterator[GatewayProcess]:
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
cloud = "chat"
fallback = true
stall_timeout = 20
[disco]
migration = false
profile_device = false
side = "server"   # with a budget of 1, DiSCo-S races every prompt (tandem.policy = "disco-s")
budget = 1.0
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "smollm2-135m-instruct"
n_ctx = 2048
[clouds.chat]
base_url = "{upstream.base_url}"
model = "scripted-chat"
continuation = "chat"
[clouds.plain]
base_url = "{upstream.base_url}"
model = "scripted-plain"
continuation = "chat"
structured_output = "none"
[clouds.raw]
base_url = "{upstream.base_url}"
model = "scripted-raw"
continuation = "completions"
tokenizer = "device"
structured_output = "none"
""",
        wait_for=("device",),
    )
    yield gw
    stop_gateway(gw)


def call_pieces(arguments: str, parts: int = 3) -> tuple[dict, ...]:
    """A tool call as a chat upstream streams it: id and name, then the arguments in pieces."""
    step = -(-len(arguments) // parts)
    head = {"index": 0, "id": "call_up", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    rest = [{"index": 0, "function": {"arguments": arguments[i : i + step]}} for i in range(0, len(arguments), step)]
    return (head, *rest)


def test_tools_and_formats_pass_through_to_a_chat_upstream(scripted_gw, upstream):
    upstream.push(Answer(pieces=(), calls=call_pieces('{"city": "Paris", "unit": "celsius"}')))
    r = sdk(scripted_gw).chat.completions.create(
        model="tandem",
        messages=[*ASK, {"role": "developer", "content": "Be brief."}],
        tools=[WEATHER],
        tool_choice="auto",
        extra_body={"tandem": {"cloud": "chat"}},
    )
    sent = upstream.requests[-1].body
    assert upstream.requests[-1].path.endswith("/chat/completions")
    assert sent["tools"] == [WEATHER] and sent["tool_choice"] == "auto" and sent["messages"][-1]["role"] == "system"
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert valid_weather_arguments(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}

    upstream.push(Answer(pieces=('{"name": "Lyon", ', '"country": "France", ', '"population": 520000}')))
    r = sdk(scripted_gw).chat.completions.create(
        model="tandem", messages=ASK, response_format=CITY, extra_body={"tandem": {"cloud": "chat"}}
    )
    assert upstream.requests[-1].body["response_format"] == CITY
    assert valid_city(r.choices[0].message.content)["population"] == 520000


def test_a_chat_upstream_that_takes_no_tools_gets_no_tool_request(scripted_gw, upstream):
    upstream.reset()
    r = sdk(scripted_gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="auto",
        temperature=0,
        max_tokens=8,
        extra_body={"tandem": {"cloud": "plain"}},
    )
    assert r.headers["x-tandem-backend"] == "device" and upstream.requests == []
    # A plain request still goes there.
    r = sdk(scripted_gw).chat.completions.with_raw_response.create(
        model="tandem", messages=ASK, max_tokens=8, extra_body={"tandem": {"cloud": "plain"}}
    )
    assert r.headers["x-tandem-backend"] == "plain" and "tools" not in upstream.requests[-1].body


def test_a_race_with_a_json_schema_is_won_by_an_endpoint_that_enforces_it(scripted_gw, upstream):
    # The raw (completions) upstream cannot apply the grammar: it is left out, the device answers alone.
    upstream.reset()
    r = sdk(scripted_gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=[{"role": "user", "content": "Describe Lyon as JSON."}],
        response_format=CITY,
        temperature=0,
        max_tokens=120,
        extra_body={"tandem": {"cloud": "raw"}},
    )
    assert r.headers["x-tandem-backend"] == "device" and upstream.requests == []
    c = r.parse().choices[0]
    assert c.finish_reason == "stop", c.message.content  # the grammar ended it, not max_tokens
    valid_city(c.message.content)
    # The chat upstream enforces it itself: it may race (here, the policy sends it there first).
    upstream.push(Answer(pieces=('{"name": "Lyon", "country": "France", "population": 1}',), gap=0.01))
    r = sdk(scripted_gw).chat.completions.with_raw_response.create(
        model="tandem", messages=ASK, response_format=CITY, max_tokens=120, extra_body={"tandem": {"cloud": "chat"}}
    )
    assert r.headers["x-tandem-backend"] == "chat"
    c = r.parse().choices[0]
    assert c.finish_reason == "stop", c.message.content
    valid_city(c.message.content)


def test_a_race_on_a_forced_tool_call_between_two_endpoints_that_enforce_it(scripted_gw, upstream):
    # The chat upstream takes its time; the device, under the tool-call grammar, wins the race with a whole call.
    upstream.reset()
    upstream.push(Answer(pieces=("",), gap=3.0, calls=call_pieces('{"city": "Rome", "unit": "celsius"}')))
    r = sdk(scripted_gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        extra_body={"tandem": {"policy": "disco-s", "cloud": "chat"}},
    )
    c = r.parse().choices[0]
    assert r.headers["x-tandem-backend"] == "device" and c.finish_reason == "tool_calls"
    valid_weather_arguments(c.message.tool_calls[0].function.arguments)
    t = trace(scripted_gw, r.headers["x-request-id"])
    assert t["plan"]["kind"] == "race"
    assert sorted((e["backend"], e["outcome"]) for e in t["endpoints"]) == [("chat", "lost"), ("device", "finished")]
    assert upstream.requests[-1].body["tool_choice"] == "required"  # the upstream raced under the same rule


def test_a_fault_inside_json_output_continues_under_the_schema(scripted_gw, upstream):
    upstream.reset()
    upstream.push(Answer(pieces=('{"name": "Ly',), then="close"))
    r = sdk(scripted_gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=[{"role": "user", "content": "Describe Lyon as JSON."}],
        response_format=CITY,
        temperature=0,
        max_tokens=120,
        extra_body={"tandem": {"cloud": "chat"}},
    )
    c = r.parse().choices[0]
    content = c.message.content
    assert content.startswith('{"name": "Ly')  # what was delivered stays, once
    assert c.finish_reason == "stop", content  # the device finished the JSON under the grammar
    valid_city(content)
    t = trace(scripted_gw, r.headers["x-request-id"])
    [move] = t["migrations"]
    assert (move["from"], move["to"], move["reason"]) == ("chat", "device", "error") and "error" not in move


def test_a_fault_inside_a_tool_call_regenerates_the_whole_call(scripted_gw, upstream):
    # A completions upstream writes the call as text; it dies inside the arguments. The client got the text
    # before the call, never a piece of the call: the device writes the call again, whole, under its grammar.
    upstream.reset()
    upstream.push(
        Answer(
            pieces=("Let me check.", "\n", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"ci'),
            then="close",
        )
    )
    stream = sdk(scripted_gw).chat.completions.create(
        model="tandem",
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=120,
        stream=True,
        extra_body={"tandem": {"cloud": "raw"}},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _, calls, finish = streamed(iter(chunks))
    assert content == "Let me check.\n" and "<tool_call>" not in content
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    valid_weather_arguments(calls[0]["arguments"])
    t = trace(scripted_gw, chunks[0].id)
    [move] = t["migrations"]
    assert (move["from"], move["to"], move["reason"], move["at_token"]) == ("raw", "device", "error", 2)
