"""POST /v1/responses through the real `openai` SDK against a real gateway (cloud down, failover on: the device's
SmolLM2 answers), translated onto the chat path; bad requests through raw httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import API_KEY

QUESTION = "Name three colours."
INSTRUCTIONS = "Answer in one short sentence."


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120)


def test_non_streamed_response(fallback_gateway):
    raw = client(fallback_gateway).responses.with_raw_response.create(
        model="tandem",
        input=QUESTION,
        instructions=INSTRUCTIONS,
        max_output_tokens=48,
        temperature=0,
        metadata={"case": "plain"},
        store=False,
    )
    r = raw.parse()
    assert raw.headers["x-request-id"] == r.id and r.id.startswith("resp_")
    assert raw.headers["x-tandem-backend"] == "device"  # the cloud is down: DiSCo fell back
    assert r.object == "response" and r.model == "tandem"
    assert r.status in ("completed", "incomplete")
    assert r.output_text.strip()
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [part.type for part in item.content] == ["output_text"]
    assert r.metadata == {"case": "plain"} and r.instructions == INSTRUCTIONS
    u = r.usage
    assert u.input_tokens > 10 and 0 < u.output_tokens <= 48
    assert u.total_tokens == u.input_tokens + u.output_tokens


def test_small_max_output_tokens_is_incomplete(fallback_gateway):
    r = client(fallback_gateway).responses.create(model="tandem", input=QUESTION, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 3 and r.output_text


def test_instructions_are_a_system_message_in_front(fallback_gateway):
    c = client(fallback_gateway)
    user = {"role": "user", "content": QUESTION}
    plain = c.responses.create(model="device", input=QUESTION, max_output_tokens=1)
    instructed = c.responses.create(model="device", input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=1)
    system = {"role": "system", "content": INSTRUCTIONS}
    chat_plain = c.chat.completions.create(model="device", messages=[user], max_tokens=1)
    chat_instructed = c.chat.completions.create(model="device", messages=[system, user], max_tokens=1)
    # (SmolLM2's template puts a default system prompt of its own where there is none: not simply fewer tokens.)
    assert plain.usage.input_tokens == chat_plain.usage.prompt_tokens
    assert instructed.usage.input_tokens == chat_instructed.usage.prompt_tokens != plain.usage.input_tokens


def test_streamed_events_match_the_non_streamed_answer(fallback_gateway):
    c = client(fallback_gateway)
    args = dict(model="tandem", input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24, temperature=0)
    whole = c.responses.create(**args)
    events = list(c.responses.create(**args, stream=True))

    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    deltas = events[4:-4]
    assert deltas and all(e.type == "response.output_text.delta" for e in deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []

    text = "".join(e.delta for e in deltas)
    done, part_done, item_done, last = events[-4:]
    assert text == done.text == part_done.part.text == item_done.item.content[0].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in [*deltas, done, part_done]) and item_done.item.id == item_id

    final = last.response
    assert final.id == events[0].response.id and final.id.startswith("resp_")
    assert final.output_text == text == whole.output_text  # greedy: one answer, whichever way it is delivered
    assert final.status == whole.status and final.incomplete_details == whole.incomplete_details
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_message_list_with_an_assistant_turn_answers_like_chat(fallback_gateway):
    c = client(fallback_gateway)
    first = c.responses.create(model="device", input="My name is Ada. Say hello.", max_output_tokens=8, temperature=0)
    # The stateless way to continue: send the earlier output back as input (the item's id, status and
    # annotations included).
    turns = [
        {"role": "user", "content": "My name is Ada. Say hello."},
        first.output[0].model_dump(exclude_none=True),
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    r = c.responses.create(model="device", input=turns, max_output_tokens=12, temperature=0)
    assert r.output_text.strip()
    chat = c.chat.completions.create(
        model="device",
        messages=[
            {"role": "user", "content": "My name is Ada. Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_the_trace_of_a_response_is_at_its_id(fallback_gateway):
    r = client(fallback_gateway).responses.create(model="tandem", input=QUESTION, max_output_tokens=2)
    t = httpx.get(f"{fallback_gateway.v1}/requests/{r.id}", timeout=10)
    assert t.status_code == 200
    trace = t.json()
    assert trace["id"] == r.id and trace["finish_reason"] == "length"
    assert [e["backend"] for e in trace["endpoints"]][-1] == "device"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temprature": 0.5}, "temprature"),
        ({"previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}},
            "text.format.schema",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(fallback_gateway, extra, param):
    body = {"model": "tandem", "input": QUESTION, **extra}
    r = httpx.post(fallback_gateway.v1 + "/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error"


def test_previous_response_id_says_tandem_is_stateless(fallback_gateway):
    with pytest.raises(openai.BadRequestError) as info:
        client(fallback_gateway).responses.create(model="tandem", input=QUESTION, previous_response_id="resp_x")
    assert "stateless" in str(info.value)


def test_responses_need_the_api_key_like_every_v1_route(faulty_gateway):
    body = {"model": "device", "input": QUESTION, "max_output_tokens": 2}
    for headers in ({}, {"authorization": "Bearer nope"}):
        r = httpx.post(faulty_gateway.v1 + "/responses", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(faulty_gateway.v1 + "/responses", json=body, headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["status"] == "incomplete"


def test_the_sdk_stream_helper_assembles_the_response(fallback_gateway):
    c = client(fallback_gateway)
    # A short answer that ends on its own: the helper's final response needs `response.completed`.
    args = dict(model="tandem", input="Say hello.", max_output_tokens=48, temperature=0)
    with c.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == c.responses.create(**args).output_text


def test_raw_sse_wire(fallback_gateway):
    body = {"model": "tandem", "input": QUESTION, "max_output_tokens": 6, "stream": True}
    with httpx.stream("POST", fallback_gateway.v1 + "/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("resp_")
        raw = r.read().decode()
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    blocks = [b for b in raw.split("\n\n") if b and not b.startswith(":")]  # `: ping` comments aside
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert json.loads(blocks[-1].split("\n")[1][6:])["response"]["id"] == r.headers["x-request-id"]


# --- tools and structured output (mapped onto chat's tools and response_format; the device applies the grammar) --

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris?"


def test_a_forced_function_call_and_its_result_round_trip(fallback_gateway):
    c = client(fallback_gateway)
    first = c.responses.create(model="tandem", input=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 31}'},
    ]
    second = c.responses.create(model="tandem", input=follow, tools=[WEATHER], temperature=0, max_output_tokens=30)
    assert [item.type for item in second.output] == ["message"] and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + 10  # the call and its result reached the prompt


def test_a_streamed_function_call_has_its_events(fallback_gateway):
    stream = client(fallback_gateway).responses.create(
        model="tandem",
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds
    assert kinds[2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    [call] = done.output
    assert call.type == "function_call" and json.loads(call.arguments) == json.loads(events[4].arguments)


def test_text_format_json_schema(fallback_gateway):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    r = client(fallback_gateway).responses.create(
        model="tandem",
        input=ASK,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    answer = json.loads(r.output_text)
    assert set(answer) == {"city", "sunny"} and isinstance(answer["sunny"], bool)
    assert r.text.format.type == "json_schema"
