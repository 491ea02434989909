"""The seam between HTTP and the serving core: bodies become plain inputs (endpoints/serving.py), the core's refusals
become the OpenAI envelope (endpoints/errors.py), and what the core builds from the plain inputs (the structure a
chat asks for, the template's messages, outline decoding's sub-requests) is what it built from the bodies."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from app.serving.errors import InvalidRequest, NotFound, NotReady
from app.serving.job import Job
from app.serving.outline import OutlineDecoding, OutlineRequest
from app.serving.requests import ChatInput, CompletionInput
from app.serving.structured import structure_of, template_messages
from clients.base import GenerationRequest
from endpoints.errors import refusal
from endpoints.schemas import ChatCompletionRequest, CompletionRequest
from endpoints.serving import KeyAccess, chat_input, completion_input

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "tandem", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_chat_body_becomes_the_plain_input_the_core_prepares():
    body = chat(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        max_tokens=9,
        max_completion_tokens=5,
        temperature=0.5,
        stop="END",
        seed=7,
        logprobs=True,
        top_logprobs=2,
        logit_bias={"17": -3},
        n=2,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        tandem={"policy": "cloud", "privacy": "split", "decoding": "auto"},
    )
    got = chat_input(body, KeyAccess("device"), id_prefix="resp_")
    assert got.messages == (
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    )
    assert (got.model, got.key_privacy, got.id_prefix) == ("tandem", "device", "resp_")
    assert (got.policy, got.cloud, got.privacy, got.decoding) == ("cloud", None, "split", "auto")
    assert (got.max_tokens, got.temperature, got.top_p, got.stop, got.seed) == (5, 0.5, None, ("END",), 7)
    assert (got.logprobs, got.logit_bias, got.choices) == (2, ((17, -3.0),), 2)
    assert got.tools == (WEATHER,)
    assert got.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert got.response_format == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


def test_a_completion_body_keeps_its_token_ids_and_the_endpoint_default_limit():
    got = completion_input(CompletionRequest(model="m", prompt=[1, 2, 3]), None)
    assert got == CompletionInput(model="m", prompt=(1, 2, 3), max_tokens=16, streamed=False)  # OpenAI's default
    assert completion_input(CompletionRequest(model="m", prompt="hi", logprobs=3), None).logprobs == 3
    assert completion_input(CompletionRequest(model="m", prompt="hi", stream=True), None).streamed


@pytest.mark.parametrize(
    ("refused", "status", "kind", "headers"),
    [
        (InvalidRequest("bad", param="tools", code="invalid_value"), 400, "invalid_request_error", {}),
        (NotFound("no such model", param="model", code="model_not_found"), 404, "not_found_error", {}),
        (NotReady("loading"), 503, "server_error", {"retry-after": "2"}),
    ],
)
def test_a_refusal_is_the_openai_envelope_with_its_status(refused, status, kind, headers):
    response = refusal(refused).response()
    assert response.status_code == status
    assert json.loads(response.body) == {
        "error": {"message": refused.message, "type": kind, "param": refused.param, "code": refused.code}
    }
    assert {k: v for k, v in response.headers.items() if k == "retry-after"} == headers


def test_the_structure_is_read_from_the_plain_input():
    named = structure_of(
        chat_input(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}), None)
    )
    assert named.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert '\\"weather\\"' in named.grammar and named.call_grammar is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    structured = structure_of(chat_input(chat(response_format=fmt), None))
    assert structured.response_format == fmt and '"integer"' in structured.grammar
    assert structure_of(chat_input(chat(response_format={"type": "text"}), None)).response_format is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as refused:
        structure_of(chat_input(chat(**fields), None))
    assert refused.value.param == param


def test_template_messages_from_the_wire_shapes():
    messages = chat_input(
        chat(
            messages=[
                {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "42"}]},
            ]
        ),
        None,
    ).messages
    assert template_messages(messages, knows_tools=False) == [
        {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
    ]
    assert template_messages(messages, knows_tools=True) == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "42"},
    ]


class _Core:
    """Records what outline decoding asks the core to prepare."""

    def __init__(self):
        self.orchestrator = SimpleNamespace(device="device")
        self.prepared: list[ChatInput] = []

    async def prepare(self, request):
        self.prepared.append(request)
        return Job(id="sub", gen=GenerationRequest(prompt_text=""), prompt_tokens=1, policy="disco")


async def test_outline_sub_requests_keep_model_key_and_sampling_and_are_routed_as_told():
    parent = ChatInput(
        model="tandem",
        key_privacy="split",
        policy="disco",
        cloud="cloud",
        privacy="any",
        decoding="outline",
        max_tokens=400,
        temperature=0.3,
        top_p=0.9,
        seed=5,
        stop=("END",),
        presence_penalty=1.0,
        logit_bias=((3, 1.0),),
        messages=({"role": "user", "content": "tips?"},),
    )
    job = Job(id="chatcmpl-x", gen=GenerationRequest(prompt_text=""), prompt_tokens=3, policy="disco", cloud="cloud")
    job.privacy = "split"
    job.outline = OutlineRequest(parent, "tips?")
    core = _Core()
    decoding = OutlineDecoding(core)
    asked = ({"role": "user", "content": "point"},)
    part = await decoding._sub_job(job, "p0", asked, 64)
    await decoding._sub_job(job, "p1", asked, 64, endpoint="cloud2")
    await decoding._sub_job(job, "p2", asked, 64, endpoint="device")
    assert part.id == "chatcmpl-x-p0"
    kept = dict(model="tandem", key_privacy="split", privacy="split", decoding="sequential", messages=asked)
    sampling = dict(max_tokens=64, temperature=0.3, top_p=0.9, seed=5)
    assert core.prepared == [
        ChatInput(**kept, **sampling, policy="disco", cloud="cloud"),
        ChatInput(**kept, **sampling, policy="cloud", cloud="cloud2"),
        ChatInput(**kept, **sampling, policy="device", cloud="cloud"),
    ]
