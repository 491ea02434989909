"""The Ollama API's requests → the core's inputs (endpoints/ollama.py: chat_input, generate_input), what is named as not
applied (endpoints/ollama_schemas.py), and its NDJSON lines (Lines), read back by the real `ollama` client's types."""

from __future__ import annotations

import json

import ollama
import pytest
from pydantic import ValidationError

from app.serving.requests import ChatInput, CompletionInput
from app.serving.tool_calls import ToolCall
from clients.base import TokenLogprob, Usage
from endpoints.answer import Collected
from endpoints.ollama import Lines, _ignored, chat_input, generate_input, models
from endpoints.ollama_schemas import ChatRequest, EmbedRequest, GenerateRequest
from endpoints.schemas import ChatCompletionRequest
from endpoints.serving import KeyAccess
from endpoints.serving import chat_input as openai_chat_input

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"model": "device", **fields})


def call(name: str, **extra) -> dict:
    return {"function": {"name": name, "arguments": {"city": "Paris"}}, **extra}


def test_options_become_the_cores_sampling() -> None:
    body = chat(
        messages=[{"role": "user", "content": "hi"}],
        options={"temperature": 0.2, "top_p": 0.9, "top_k": 5, "num_predict": 7, "stop": ["a", "b"], "seed": 3},
        format="json",
        tandem={"privacy": "device"},
        logprobs=True,
        top_logprobs=2,
    )
    got = chat_input(body, "device", KeyAccess(privacy="split"))
    assert isinstance(got, ChatInput)
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens, got.stop, got.seed) == (
        0.2,
        0.9,
        5,
        7,
        ("a", "b"),
        3,
    )
    assert got.response_format == {"type": "json_object"} and got.logprobs == 2
    assert (got.privacy, got.key_privacy) == ("device", "split")
    assert got.messages == ({"role": "user", "content": "hi"},) and not got.continue_final
    assert got.streamed  # Ollama streams unless told not to
    assert not chat_input(chat(messages=[{"role": "user", "content": "hi"}], stream=False), "device", None).streamed


def test_llama_cpps_samplers_are_the_cores_sampling_extras_as_the_openai_door_passes_them() -> None:
    samplers = {"min_p": 0.05, "typical_p": 0.9, "repeat_penalty": 1.3, "mirostat_tau": 4.0, "mirostat_eta": 0.2}
    ollama_body = chat(messages=[{"role": "user", "content": "hi"}], options={**samplers, "mirostat": 2, "top_k": 9})
    got = chat_input(ollama_body, "device", None)
    openai_body = ChatCompletionRequest.model_validate(
        {"model": "device", "messages": [{"role": "user", "content": "hi"}], **samplers, "mirostat_mode": 2}
    )
    assert got.extras == {**samplers, "mirostat_mode": 2} == openai_chat_input(openai_body, None).extras
    assert got.top_k == 9
    raw = GenerateRequest(model="m", prompt="p", raw=True, options={"min_p": 0.1})
    assert generate_input(raw, "m", None).extras == {"min_p": 0.1}
    assert chat_input(chat(messages=[{"role": "user", "content": "hi"}]), "device", None).extras == {}


@pytest.mark.parametrize(
    ("options", "named"),
    [({"mirostat": 3}, "mirostat"), ({"repeat_penalty": 0}, "repeat_penalty"), ({"min_p": 1.5}, "min_p")],
)
def test_samplers_out_of_bounds_are_refused_naming_them(options, named) -> None:
    with pytest.raises(ValidationError) as refused:
        chat(messages=[], options=options)
    assert f"options.{named}" in str(refused.value)


@pytest.mark.parametrize(("num_predict", "max_tokens"), [(-1, None), (-2, None), (0, None), (5, 5)])
def test_num_predict_without_a_limit_is_the_gateways_default(num_predict, max_tokens) -> None:
    body = chat(messages=[{"role": "user", "content": "hi"}], options={"num_predict": num_predict, "seed": -1})
    got = chat_input(body, "device", None)
    assert got.max_tokens == max_tokens and got.seed is None  # a negative seed: a random one


def test_a_schema_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = chat_input(chat(messages=[{"role": "user", "content": "hi"}], format=schema), "device", None)
    assert got.response_format == {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
    assert chat_input(chat(messages=[{"role": "user", "content": "x"}], format=""), "d", None).response_format is None


def test_tool_results_answer_the_calls_they_name_or_their_tools_earliest() -> None:
    body = chat(
        messages=[
            {"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather"), call("get_time")]},
            {"role": "tool", "tool_name": "get_time", "content": "noon"},  # its tool's call, though second
            {"role": "tool", "content": "sunny"},  # no name: the earliest unanswered
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", id="call_mine")]},
            {"role": "tool", "tool_call_id": "call_mine", "content": "rain"},
            {"role": "tool", "tool_name": "get_weather", "content": "stray"},  # no call left: an id of its own
        ],
        tools=[WEATHER, CLOCK],
    )
    got = chat_input(body, "device", None)
    first, second = got.messages[1]["tool_calls"]
    assert (first["id"], second["id"]) == ("call_1_0", "call_1_1")
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris"}
    assert [m.get("tool_call_id") for m in got.messages[2:4]] == ["call_1_1", "call_1_0"]
    assert got.messages[4]["tool_calls"][0]["id"] == "call_mine" and got.messages[5]["tool_call_id"] == "call_mine"
    assert got.messages[6]["tool_call_id"] == "call_6"
    assert got.tools == (WEATHER, CLOCK)


def test_a_trailing_assistant_message_is_continued_unless_it_calls() -> None:
    begun = chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}])
    assert chat_input(begun, "device", None).continue_final
    calling = chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call("f")]}])
    assert not chat_input(calling, "device", None).continue_final


def test_generate_is_a_user_turn_or_the_raw_prompt() -> None:
    templated = generate_input(GenerateRequest(model="m", prompt="2+2?", system="Be brief."), "m", None)
    assert isinstance(templated, ChatInput)
    assert templated.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})
    raw = generate_input(GenerateRequest(model="m", prompt="def f(", raw=True, system="ignored"), "m", None)
    assert isinstance(raw, CompletionInput) and raw.prompt == "def f("
    # Ollama's Go client sends empty strings for what it does not set: absent values, not refusals.
    assert GenerateRequest.model_validate({"model": "m", "prompt": "x", "template": "", "suffix": "", "system": ""})


def test_what_is_not_applied_is_named() -> None:
    body = chat(
        messages=[{"role": "user", "content": "hi", "images": [], "name": "ann"}],
        options={"num_ctx": 8192, "num_gpu": 1, "temperature": 0, "mirostat": 1, "repeat_last_n": 64},
        think="high",
        keep_alive="5m",
        shift=True,
        tools=[{**WEATHER, "extra": 1}],
    )
    assert body.not_applied() == [
        "shift",
        "options.num_ctx",
        "options.num_gpu",
        "options.repeat_last_n",
        "think",
        "messages[].name",
        "tools[].extra",
    ]
    assert chat(messages=[], think=False, keep_alive=0).not_applied() == []
    raw = GenerateRequest(model="m", prompt="p", raw=True, system="s")
    assert raw.not_applied() == ["system"]
    assert EmbedRequest(model="e", input="x", truncate=False, options={"num_thread": 2}).not_applied() == [
        "truncate",
        "options.num_thread",
    ]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"messages": [{"role": "user", "tool_calls": [call("f")]}]}, "tool_calls"),
        ({"messages": [], "format": "xml"}, "format"),
        ({"messages": [], "options": {"top_p": 0}}, "top_p"),
        ({"messages": [], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [], "tandem": {"policy": "disco", "colour": "red"}}, "colour"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_it(fields, named) -> None:
    with pytest.raises(ValidationError) as refused:
        chat(**fields)
    assert named in str(refused.value)


@pytest.mark.parametrize("field", ["template", "suffix", "context", "images"])
def test_generate_refuses_what_it_cannot_honour(field) -> None:
    value = [1] if field == "context" else ["aGk="] if field == "images" else "x"
    with pytest.raises(ValidationError) as refused:
        GenerateRequest.model_validate({"model": "m", "prompt": "p", field: value})
    assert field in str(refused.value)


def lines(chat: bool = True, **kw) -> Lines:
    return Lines("device", chat, received=100.0, first_at=100.5, thinking=kw.get("thinking", True), logprobs=False)


def test_streamed_chat_lines_are_ollamas_chunks() -> None:
    out = lines()
    calls = [ToolCall(id="call_x", name="get_weather", arguments='{"city": "Paris"}')]
    raw = [out.text("Hel"), out.reasoning("hmm"), out.tool_calls(calls, 0), out.closing("lo", "tool_calls")]
    raw.append(out.end(Usage(30, 4)))
    parsed = [ollama.ChatResponse(**json.loads(line)) for line in raw]
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in raw)
    assert [p.message.content for p in parsed] == ["Hel", "", "", "lo", ""]
    assert parsed[1].message.thinking == "hmm"
    assert parsed[2].message.tool_calls[0].function.arguments == {"city": "Paris"}
    assert json.loads(raw[2])["message"]["tool_calls"][0]["id"] == "call_x"
    last = parsed[-1]
    assert [p.done for p in parsed] == [False, False, False, False, True] and out.finished
    assert (last.done_reason, last.prompt_eval_count, last.eval_count, last.load_duration) == ("stop", 30, 4, 0)
    assert last.prompt_eval_duration == 500_000_000 and last.total_duration > last.eval_duration > 0
    assert ollama.ChatResponse(**json.loads(out.keepalive())).message.content == ""


def test_generate_lines_failures_and_hidden_thinking() -> None:
    out = lines(chat=False, thinking=False)
    piece = json.loads(out.text("x"))
    assert list(piece) == ["model", "created_at", "response", "done"] and piece["response"] == "x" and not piece["done"]
    assert out.reasoning("hidden") == b""  # think: false
    out.closing("", "length")
    assert ollama.GenerateResponse(**json.loads(out.end(Usage(5, 9)))).done_reason == "length"
    failed = lines()
    error = json.loads(failed.failure(RuntimeError("upstream died")))
    assert error == {"error": "the answer failed midway: upstream died"} and failed.finished


def test_a_whole_answer_with_logprobs_and_calls() -> None:
    out = Lines("cloud", True, received=1.0, first_at=1.2, thinking=True, logprobs=True)
    entries = [TokenLogprob(-0.1, b"Hi", (("Hi", -0.1, b"Hi"),), token="Hi")]
    calls = [ToolCall(id="call_y", name="get_time", arguments="{}")]
    whole = out.whole(Collected("Hi", "tool_calls", entries, calls, "thought"), Usage(3, 2))
    parsed = ollama.ChatResponse(**whole)
    assert parsed.message.content == "Hi" and parsed.message.thinking == "thought" and parsed.done
    assert parsed.message.tool_calls[0].function.name == "get_time" and parsed.done_reason == "stop"
    assert parsed.logprobs[0].token == "Hi" and parsed.logprobs[0].top_logprobs[0].logprob == -0.1


def test_the_door_adds_its_fields_to_those_the_endpoint_did_not_apply() -> None:
    header = "x-tandem-ignored-fields"
    assert _ignored(["think", "options.top_k"], {header: "top_k", "x-request-id": "r"}) == {
        header: "options.top_k, think",
        "x-request-id": "r",
    }
    assert _ignored([], {"x-request-id": "r"}) == {"x-request-id": "r"}
    # The endpoint names the core's sampling extras; the client reads them as it sent them.
    assert _ignored(["think"], {header: "min_p, mirostat_mode, top_k"})[header] == (
        "options.min_p, options.mirostat, options.top_k, think"
    )


class Cards:
    """A serving core's model descriptions (Serving.models()), the only part of it that models() reads."""

    def __init__(self, *cards: dict):
        self.cards = list(cards)

    def models(self) -> list[dict]:
        return self.cards


def card(model_id: str, **capabilities: bool) -> dict:
    core = {"chat": True, "completions": True, "tools": False, "structured_output": True, "embeddings": False}
    return {
        "id": model_id,
        "context_length": 4096,
        "locality": "cloud",
        "endpoints": ["c"],
        "capabilities": {**core, **capabilities},
    }


def test_models_are_the_cores_with_ollamas_capabilities() -> None:
    serving = Cards(
        card("tandem", tools=True),
        card("c"),
        card("emb", chat=False, completions=False, structured_output=False, embeddings=True),
    )
    got = models(serving)
    assert list(got) == ["tandem", "c", "emb"]
    assert [got[m]["capabilities"] for m in got] == [["completion", "tools"], ["completion"], ["embedding"]]
    assert got["c"]["locality"] == "cloud" and got["c"]["endpoints"] == ["c"] and got["c"]["context_length"] == 4096
