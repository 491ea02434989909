"""The Responses API's request → the chat request that answers it (endpoints/responses.py: chat_request), and the
answer's calls → this API's output items and stream events (`_Response`, read back with the openai SDK's types)."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from app.serving.job import Job
from app.serving.tool_calls import ToolCall
from clients.base import GenerationRequest, Usage
from endpoints.responses import _param, _Response, chat_request, custom_input, responses_input
from endpoints.responses_schemas import ResponsesRequest


def test_a_string_input_with_instructions_is_a_system_then_a_user_message() -> None:
    body = ResponsesRequest(
        model="tandem",
        input="Hi",
        instructions="Be brief.",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        user="u1",
        stream=True,
        tandem={"policy": "device"},
    )
    chat = chat_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert chat.token_limit == 7 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.user == "u1" and chat.stream and chat.tandem.policy == "device"


def test_message_items_keep_their_roles_and_join_their_parts() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": "tandem",
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "b", "annotations": []},
                        {"type": "output_text", "text": "c"},
                    ],
                },
                {"role": "user", "content": "d"},
            ],
        }
    )
    chat = chat_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("developer", "Rules."),
        ("user", "a"),
        ("assistant", "bc"),
        ("user", "d"),
    ]
    assert chat.token_limit is None and not chat.stream


# -- what Codex CLI sends: every tool kind and input item accepted, offered, mapped or ignored visibly -----------------

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    "strict": False,
}
READ = {
    "type": "function",
    "name": "read",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
}
PATCH_GRAMMAR = 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
FILES = {"type": "namespace", "name": "files", "description": "The workspace's files.", "tools": [READ]}


def codex_body(**fields) -> ResponsesRequest:
    """A request shaped like Codex CLI's (fields and kinds from the API's reference, not its prompts)."""
    return ResponsesRequest.model_validate(
        {
            "model": "tandem",
            "instructions": "You are a coding agent.",
            "stream": True,
            "store": False,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0b7c",
            "client_metadata": {"originator": "cli"},
            "tools": [EXEC, FILES, {"type": "web_search", "external_web_access": False}, APPLY_PATCH],
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write add.py"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "phase": "commentary",
                    "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "files", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "empty"},
                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
            ],
            **fields,
        }
    )


def test_codexs_tools_are_offered_as_functions_and_the_history_as_chat_turns() -> None:
    body = codex_body()
    chat = chat_request(body)
    assert [t.function.name for t in chat.tools] == ["exec_command", "files__read", "apply_patch"]
    read, patch = chat.tools[1].function, chat.tools[2].function
    assert read.description == "The workspace's files." and read.parameters == READ["parameters"]
    assert patch.parameters["properties"]["input"]["type"] == "string" and patch.parameters["required"] == ["input"]
    assert PATCH_GRAMMAR in patch.description  # a Lark grammar: described to the model, not enforced
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "You are a coding agent."),
        ("developer", "Be careful."),
        ("user", "Write add.py"),
        ("assistant", "Looking."),
        ("tool", "empty"),
        ("assistant", None),
        ("tool", "ok"),
    ]
    (call,) = chat.messages[3].tool_calls  # the calls join the assistant's text of the same turn
    assert call.function.name == "files__read"
    (custom,) = chat.messages[5].tool_calls
    assert custom.function.arguments == '{"input": "*** Begin Patch"}'
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is True
    assert responses_input(body, None).extras == {
        "reasoning_effort": "medium",
        "prompt_cache_key": "0b7c",
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "client_metadata": {"originator": "cli"},
        "reasoning.summary": "auto",
        "tools.web_search": True,
        "tools.apply_patch.format": "lark",
        "input.reasoning": 1,
    }


def test_a_regex_grammar_is_the_inputs_pattern_and_allowed_tools_narrow_the_offer() -> None:
    version = {
        "type": "custom",
        "name": "version",
        "format": {"type": "grammar", "syntax": "regex", "definition": r"\d+"},
    }
    body = codex_body(
        tools=[EXEC, FILES, version, {"type": "local_shell"}],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "custom", "name": "version"}, {"type": "namespace", "name": "files"}],
        },
    )
    chat = chat_request(body)
    assert [t.function.name for t in chat.tools] == ["files__read", "version"]
    assert chat.tools[1].function.parameters["properties"]["input"]["pattern"] == r"^(?:\d+)$"
    assert chat.tool_choice == "required"
    assert "tools.local_shell" in responses_input(body, None).extras


def test_named_and_built_in_tool_choices() -> None:
    named = chat_request(codex_body(tool_choice={"type": "custom", "name": "apply_patch"}))
    assert named.tool_choice.function.name == "apply_patch"
    in_namespace = chat_request(codex_body(tool_choice={"type": "function", "name": "read"}))
    assert in_namespace.tool_choice.function.name == "files__read"
    hosted = codex_body(tool_choice={"type": "web_search_preview"})
    assert chat_request(hosted).tool_choice is None  # none is offered: the model chooses as under auto
    assert responses_input(hosted, None).extras["tool_choice"] == "web_search_preview"


def events(payload: bytes) -> list:
    from openai.types.responses import ResponseStreamEvent

    adapter = TypeAdapter(ResponseStreamEvent)
    blocks = payload.decode().strip().split("\n\n")
    return [adapter.validate_python(json.loads(b.split("\n")[1].removeprefix("data: "))) for b in blocks]


def test_calls_come_back_as_their_tools_items_with_every_stream_event_the_sdk_defines() -> None:
    job = Job(id="resp_0123", gen=GenerationRequest(prompt_text="x"), prompt_tokens=5, policy="device")
    job.usage = Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=2)
    response = _Response(job, codex_body())
    calls = [
        ToolCall("call_a", "files__read", '{"path": "add.py"}'),
        ToolCall("call_b", "apply_patch", '{"input": "*** Begin Patch\\n*** End Patch"}'),
        ToolCall("call_c", "exec_command", '{"cmd": "pytest"}'),
    ]
    wire = (
        response.opening()
        + response.text("On it.")
        + response.tool_calls(calls, 0)
        + response.closing("", "tool_calls")
    )
    parsed = events(wire)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.function_call_arguments.delta") == 2
    custom_delta, custom_done = (e for e in parsed if e.type.startswith("response.custom_tool_call_input"))
    assert custom_delta.delta == custom_done.input == "*** Begin Patch\n*** End Patch"
    done = [e.item for e in parsed if e.type == "response.output_item.done"]
    assert [(i.type, i.name, getattr(i, "namespace", None)) for i in done[1:]] == [
        ("function_call", "read", "files"),
        ("custom_tool_call", "apply_patch", None),
        ("function_call", "exec_command", None),
    ]
    final = parsed[-1].response
    assert [o.type for o in final.output] == ["message", "function_call", "custom_tool_call", "function_call"]
    assert [t.type for t in final.tools] == ["function", "namespace", "web_search", "custom"]
    usage = final.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 7, 12)
    assert usage.input_tokens_details.cached_tokens == 2 and usage.output_tokens_details.reasoning_tokens == 0


def test_a_custom_calls_input_is_the_functions_one_argument() -> None:
    assert custom_input('{"input": "a\\nb"}') == "a\nb"
    assert custom_input('{"patch": "p"}') == "p"  # one string, whatever the model named it
    assert custom_input("not json") == "not json"


def test_a_schema_error_names_the_tool_where_the_request_defines_it() -> None:
    body = codex_body()
    assert _param("tools[1].function.parameters", body) == "tools[1].tools[0].parameters"
    assert _param("tools[2].function.parameters", body) == "tools[3].format"
    assert _param("messages", body) == "input"


@pytest.mark.parametrize(
    ("fields", "where", "why"),
    [
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "stores no items"),
        ({"input": [{"id": "msg_1"}]}, "input", "stores no items"),
        ({"tools": [{"type": "browser"}]}, "tools", "no tool type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools", "pattern"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
            "input",
            "input_image content cannot be served",
        ),
        (
            {"tools": [{"type": "namespace", "name": "n" * 60, "description": "d", "tools": [READ]}]},
            "tools",
            "function name",
        ),
    ],
)
def test_what_the_api_does_not_define_or_tandem_cannot_read_is_refused(fields, where, why) -> None:
    with pytest.raises(ValidationError, match=why) as refused:
        codex_body(**fields)
    assert refused.value.errors()[0]["loc"][0] == where
