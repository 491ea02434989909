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


EPHEMERAL = {"type": "ephemeral"}


def test_a_system_message_inside_the_conversation_stays_where_it_stands() -> None:
    """The SDK's SystemMessageParam: Claude Code's first request is [user, system]; it takes no turn (user and
    assistant still alternate around it) and holds text only."""
    chat = messages_input(
        body(
            system="Be brief.",
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Write add.py"}]},
                {"role": "system", "content": [{"type": "text", "text": "Monday.", "cache_control": EPHEMERAL}]},
                {"role": "assistant", "content": [CALL]},
                {"role": "system", "content": "Tools may be slow."},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]},
            ],
            tools=[TOOL],
        ),
        None,
    )  # fmt: skip
    assert [(m["role"], m.get("content")) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Write add.py"),
        ("system", "Monday."),
        ("assistant", ""),
        ("system", "Tools may be slow."),
        ("tool", "Sunny"),
    ]
    for messages, why in (
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "the first message"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": [CALL]}], "text blocks only"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, {"role": "user", "content": "b"}],
         "messages\\[2\\] has the role"),
    ):  # fmt: skip
        with pytest.raises(ValidationError, match=why):
            body(messages=messages)


# -- what Claude Code sends: every field accepted, honoured, mapped or ignored visibly --------------------------------

BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    "cache_control": {"type": "ephemeral"},
}
WEB_SEARCH = {
    "type": "web_search_20250305",
    "name": "web_search",
    "max_uses": 3,
    "cache_control": {"type": "ephemeral"},
}
THOUGHT = {"type": "thinking", "thinking": "I should list the files.", "signature": "c2ln"}
BASH_CALL = {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"command": "ls"}}


def agent_body(**fields) -> MessagesRequest:
    """A request shaped like Claude Code's (fields and kinds from the API's reference, not its prompts)."""
    return body(
        max_tokens=32000,
        stream=True,
        thinking={"type": "adaptive", "display": "updates"},  # the beta surface's third display
        output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
        metadata={"user_id": '{"device_id": "d1", "session_id": "s1"}'},
        system=[
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        tools=[WEB_SEARCH, BASH, {"name": "Read", "input_schema": {"type": "object"}, "defer_loading": True}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Write add.py", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "assistant", "content": [THOUGHT, {"type": "redacted_thinking", "data": "ZW5j"}, BASH_CALL]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "main.py"}]},
        ],
        **fields,
    )


def test_claude_codes_request_maps_thinking_and_reports_what_no_endpoint_applies() -> None:
    chat = messages_input(agent_body(), None, beta="context-management-2025-06-27,interleaved-thinking-2025-05-14")
    # Only the client's own tools are offered, the server tool is not; earlier thinking never reaches the model.
    assert [t["function"]["name"] for t in chat.tools] == ["Bash", "Read"]
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assistant = chat.messages[2]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["name"] == "Bash"
    assert "I should list" not in str(chat.messages)
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False and chat.max_tokens == 32000
    assert chat.extras == {
        "user": '{"device_id": "d1", "session_id": "s1"}',  # metadata.user_id: chat's user, kept in the trace
        "reasoning_effort": "high",  # adaptive thinking at output_config.effort, for an endpoint that takes it
        "context_management": True,
        "tools.web_search_20250305": True,
        "tools.defer_loading": True,
        "messages.thinking": 1,
        "messages.redacted_thinking": 1,
        "anthropic-beta": "context-management-2025-06-27,interleaved-thinking-2025-05-14",
        "cache_control": {"type": "ephemeral", "ttl": "1h"},  # the system block's, the first marked
    }


@pytest.mark.parametrize(
    ("thinking", "effort", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, None, "low"),
        ({"type": "enabled", "budget_tokens": 2048}, None, "medium"),
        ({"type": "enabled", "budget_tokens": 31999}, None, "high"),
        ({"type": "enabled", "budget_tokens": 31999}, "low", "low"),  # the effort, when given, says it
        ({"type": "adaptive"}, None, "high"),  # Anthropic's default effort
        ({"type": "adaptive", "display": "summarized"}, "max", "max"),
        ({"type": "between_tools"}, "medium", "medium"),
    ],
)
def test_thinking_asks_a_reasoning_endpoint_for_an_effort(thinking, effort, expected) -> None:
    config = {"output_config": {"effort": effort}} if effort else {}
    request = body(messages=[{"role": "user", "content": "Hi"}], thinking=thinking, **config)
    assert messages_input(request, None).extras["reasoning_effort"] == expected


def test_thinking_off_asks_for_no_reasoning_and_reports_an_effort_ignored() -> None:
    ask = [{"role": "user", "content": "Hi"}]
    off = messages_input(body(messages=ask, thinking={"type": "disabled"}, output_config={"effort": "low"}), None)
    assert off.extras == {"output_config.effort": "low"}
    assert messages_input(body(messages=ask), None).extras == {}


def test_the_apis_other_fields_are_mapped_or_reported() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    request = body(
        messages=[{"role": "user", "content": "Pick a number."}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "task_budget": {"total": 9}},
        service_tier="standard_only",
        speed="fast",
        inference_geo="eu",
        container="container_1",
        mcp_servers=[{"type": "url", "url": "https://example.com/mcp", "name": "x"}],
        thinking={"type": "enabled", "budget_tokens": 2000, "future_key": 1},
    )
    chat = messages_input(request, None)
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert chat.extras == {
        "service_tier": "default",  # standard_only: OpenAI's standard tier, forwarded where taken
        "reasoning_effort": "medium",
        "speed": True,
        "inference_geo": True,
        "container": True,
        "mcp_servers": True,
        "output_config.task_budget": True,
        "thinking.future_key": True,
    }


def test_server_blocks_and_search_results_in_the_history() -> None:
    chat = messages_input(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "search_result",
                            "source": "https://docs.example/add",
                            "title": "add",
                            "content": [{"type": "text", "text": "add(a, b) returns a + b"}],
                        },
                        {"type": "text", "text": "Summarise."},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
                        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                        {"type": "text", "text": "It adds."},
                    ],
                },
                {"role": "user", "content": "Thanks"},
            ]
        ),
        None,
    )
    assert chat.messages[0]["content"] == "add (https://docs.example/add)\n\nadd(a, b) returns a + b\n\nSummarise."
    assert chat.messages[1] == {"role": "assistant", "content": "It adds."}
    assert chat.extras == {"messages.server_tool_use": 1, "messages.web_search_tool_result": 1}


def test_a_final_assistant_turn_of_thinking_alone_begins_no_answer() -> None:
    ask = [{"role": "user", "content": "Hi"}]
    chat = messages_input(body(messages=[*ask, {"role": "assistant", "content": [THOUGHT]}]), None)
    assert not chat.continue_final and [m["role"] for m in chat.messages] == ["user"]
    prefill = messages_input(
        body(messages=[*ask, {"role": "assistant", "content": [THOUGHT, {"type": "text", "text": "So"}]}]), None
    )
    assert prefill.continue_final and prefill.messages[-1] == {"role": "assistant", "content": "So"}


@pytest.mark.parametrize(
    ("tool", "why"),
    [
        ({"type": "cusotm", "name": "x", "input_schema": {}}, "no tool type"),
        ({"name": "bad name", "input_schema": {}}, "pattern"),
    ],
)
def test_tools_the_api_refuses(tool, why) -> None:
    with pytest.raises(ValidationError, match=why):
        body(messages=[{"role": "user", "content": "Hi"}], tools=[tool])


def test_images_stay_refused_in_tool_results_too() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    history = [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": [BASH_CALL]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": [image]}]},
    ]
    with pytest.raises(ValidationError, match="image content cannot be served"):
        body(messages=history)
