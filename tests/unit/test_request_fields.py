"""The OpenAI request schema's own translations (endpoints/schemas.py, endpoints/serving.py): the deprecated functions
API onto tools, the fields beyond the core handed to the core as extras, the refusals that say why."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from endpoints.schemas import ChatCompletionRequest
from endpoints.serving import chat_input

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
ASK = [{"role": "user", "content": "2 + 3?"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tandem", messages=fields.pop("messages", ASK), **fields)


def test_functions_and_a_named_function_call_are_tools_and_a_forced_choice_with_one_call():
    request = chat(functions=[ADD], function_call={"name": "add"})
    core = chat_input(request, None)
    assert core.tools == ({"type": "function", "function": ADD},)
    assert core.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert core.parallel_tool_calls is False and request.functions_api


def test_a_function_call_turn_and_its_result_are_a_tool_call_and_the_tool_message_answering_it():
    history = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": '{"a": 2}'}},
        {"role": "function", "name": "add", "content": "5"},
    ]
    _, call, result = chat_input(chat(messages=history, functions=[ADD]), None).messages
    (tool_call,) = call["tool_calls"]
    assert tool_call["function"] == {"name": "add", "arguments": '{"a": 2}'} and "function_call" not in call
    assert result == {"role": "tool", "content": "5", "tool_call_id": tool_call["id"]}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"functions": [ADD], "tools": [{"type": "function", "function": ADD}]}, "functions", "not both"),
        ({"function_call": "auto"}, "function_call", "needs functions"),
        ({"functions": [ADD], "function_call": {"name": "sub"}}, "function_call", "not among functions"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"web_search_options": {}}, "web_search_options", "web search"),
        ({"messages": [{"role": "function", "name": "add", "content": "5"}]}, None, "must follow"),
    ],
)
def test_what_cannot_be_honoured_is_refused_saying_why(fields, param, says):
    with pytest.raises(ValidationError) as refused:
        chat(**fields)
    (error,) = refused.value.errors()
    assert (error["loc"][0] if error["loc"] else None) == param and says in error["msg"]


def test_the_fields_beyond_the_core_reach_the_core_as_sent_and_only_when_set():
    request = chat(
        reasoning_effort="low",
        prompt_cache_options={"mode": "implicit"},
        metadata={"team": "qa"},
        min_p=0.1,
        top_k=5,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": True},
    )
    core = chat_input(request, None)
    assert core.extras == {
        "reasoning_effort": "low",
        "prompt_cache_options": {"mode": "implicit"},
        "metadata": {"team": "qa"},
        "min_p": 0.1,
        "stream_options.include_obfuscation": True,
    }
    assert core.top_k == 5  # the core's own field: it adds it to the extras it forwards
    assert chat_input(chat(), None).extras == {}


def test_what_opencode_and_aider_send_is_taken_and_earlier_reasoning_is_dropped_visibly():
    """opencode's @ai-sdk/openai-compatible body (max_tokens 32,000, include_usage, tool_choice auto, a reasoning
    endpoint's earlier thinking sent back as `reasoning_content`) and LiteLLM's (aider)."""
    bash = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
    history = [
        {"role": "system", "content": "You are a coding agent."},
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants a sum.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5", "reasoning": "Done."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    request = chat(
        messages=history,
        max_tokens=32000,
        stream=True,
        stream_options={"include_usage": True},
        tools=[bash],
        tool_choice="auto",
        parallel_tool_calls=True,
        user="opencode-session",
        temperature=0,
    )
    core = chat_input(request, None)
    assert core.max_tokens == 32000 and core.tool_choice == "auto" and request.include_usage
    assert all("reasoning" not in m and "reasoning_content" not in m for m in core.messages)
    assert core.messages[2]["tool_calls"][0]["id"] == "c1"
    assert core.extras == {"user": "opencode-session", "messages.reasoning_content": 1, "messages.reasoning": 1}
    with pytest.raises(ValidationError, match="only an assistant message carries its reasoning"):
        chat(messages=[{"role": "user", "content": "x", "reasoning_content": "y"}])
