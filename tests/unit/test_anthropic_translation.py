"""The Messages API's request → the core's ChatInput (endpoints/anthropic.py: messages_input), and the
conversation's shape checked where it enters (endpoints/anthropic_schemas.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from endpoints.anthropic import messages_input
from endpoints.anthropic_schemas import CountTokensRequest, MessagesRequest
from endpoints.serving import KeyAccess

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def body(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "tandem", "max_tokens": 8, **fields})


def test_system_blocks_tool_use_and_tool_result_become_chat_turns() -> None:
    chat = messages_input(
        body(
            system=[
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be kind."},
            ],
            messages=[
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, CALL]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "Sunny"}],
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            tools=[TOOL],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            stop_sequences=["a", "b", "c", "d", "e"],
            top_k=5,
            temperature=0.3,
            metadata={"user_id": "u"},
        ),
        KeyAccess(privacy="device"),
    )
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0]["content"] == "Be brief.\n\nBe kind."
    (call,) = chat.messages[2]["tool_calls"]
    assert call["id"] == "toolu_1" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chat.messages[3] == {"role": "tool", "content": "Sunny", "tool_call_id": "toolu_1"}
    assert chat.tools[0]["function"]["parameters"] == TOOL["input_schema"]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    assert chat.stop == ("a", "b", "c", "d", "e") and chat.top_k == 5 and chat.temperature == 0.3
    assert chat.max_tokens == 8 and chat.key_privacy == "device" and not chat.continue_final


def test_tool_choice_any_and_tool_are_forced_calls_and_a_trailing_assistant_is_a_prefill() -> None:
    ask = [{"role": "user", "content": "Hi"}]
    assert messages_input(body(messages=ask, tools=[TOOL], tool_choice={"type": "any"}), None).tool_choice == "required"
    named = messages_input(body(messages=ask, tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}), None)
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    prefill = messages_input(body(messages=[*ask, {"role": "assistant", "content": "Hello"}]), None)
    assert prefill.continue_final and prefill.messages[-1] == {"role": "assistant", "content": "Hello"}
    counted = messages_input(CountTokensRequest(model="tandem", messages=ask), None)
    assert counted.max_tokens is None and counted.stop == ()


@pytest.mark.parametrize(
    ("messages", "why"),
    [
        ([{"role": "assistant", "content": "Hi"}], "first message"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": "b"},
            ],
            "answer the tool_use",
        ),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}], "answers no tool_use"),
        ([{"role": "user", "content": [CALL]}], "assistant's"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [CALL]}], "must be text"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "}], "whitespace"),
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "document content cannot be served"),
        ([{"role": "user", "content": "\ud800"}], "surrogate"),
    ],
)
def test_conversations_the_api_refuses(messages, why) -> None:
    with pytest.raises(ValidationError, match=why):
        body(messages=messages)
