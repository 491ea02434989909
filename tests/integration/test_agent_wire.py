"""What coding agents send, on the wire, against one real gateway: Claude Code's Messages requests, Codex CLI's
Responses requests, opencode's and aider's chat completions, each answered (200), well-formed, and every field the
endpoint did not apply named in `x-tandem-ignored-fields`.

The bodies are built from the documented APIs in each CLI's shape (its fields, tool kinds, headers, `?beta=true`, a
few KB of system prompt and tool schemas; docs/api.md), not copied from the CLIs' prompts. Real parts: `tandem serve`
in a subprocess with the bundled SmolLM2-135M on llama.cpp as its device, the real `anthropic` and `openai` SDKs (the
fields they do not type go in `extra_body`), and the scripted OpenAI-compatible upstream on loopback
(tests/integration/scripted_upstream.py) as a cloud under the `openai` provider's dialect, which records what reached
it: there a reasoning endpoint gets Claude's thinking as an effort, and a chat upstream's calls come back as Codex's
own items (a namespace's function, a custom tool's input). Answers are a few tokens: a stop sequence ends the ones
that ask for 32,000, as the CLIs do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.scripted_upstream import Answer, ScriptedUpstream

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "device"
cloud = "oai"
fallback = false
default_max_tokens = 0    # Codex sends no max_output_tokens: its answer's limit is the window's, as OpenAI's ...
max_answer_tokens = 96    # ... within the gateway's cap (a forced call's room): short answers are the point here
stall_timeout = 60        # a shared test machine: the device may be slow, never a fault here
[device]
model = "{SMOL}"
n_ctx = 4096
[disco]
migration = false
profile_device = false
[clouds.oai]
provider = "openai"
base_url = "{upstream.base_url}"
model = "oai-model"
connect_timeout = 2
read_timeout = 5
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def ignored(headers) -> set[str]:
    return {name.strip() for name in headers.get("x-tandem-ignored-fields", "").split(",") if name.strip()}


def system_prompt(agent: str) -> str:
    """A few KB of an agent's standing instructions (written here, in the spirit of the documented examples)."""
    rules = [
        "Read the relevant files before you change them.",
        "Keep each change as small as the task allows.",
        "Run the project's tests after every edit and read their output.",
        "Prefer the project's existing helpers to new ones.",
        "Never print secrets or credentials.",
        "Explain what you changed in one short paragraph.",
    ]
    lines = [f"You are {agent}, a coding agent working in the user's repository."]
    lines += [f"Rule {i + 1}: {rules[i % len(rules)]} (section {i // len(rules) + 1})" for i in range(24)]
    return "\n".join(lines)


def schema(**properties: str) -> dict:
    return {
        "type": "object",
        "properties": {name: {"type": kind, "description": f"The {name}."} for name, kind in properties.items()},
        "required": list(properties),
    }


# Ten coding-agent tools: the kinds every one of these CLIs offers (shell, files, search, a plan).
TOOLS = {
    "Bash": ("Run a shell command in the repository.", schema(command="string", timeout="integer")),
    "Read": ("Read a file.", schema(file_path="string", offset="integer", limit="integer")),
    "Write": ("Write a whole file.", schema(file_path="string", content="string")),
    "Edit": ("Replace a string in a file.", schema(file_path="string", old_string="string", new_string="string")),
    "Glob": ("Find files by pattern.", schema(pattern="string", path="string")),
    "Grep": ("Search file contents.", schema(pattern="string", path="string", glob="string")),
    "WebFetch": ("Fetch a URL and read it.", schema(url="string", prompt="string")),
    "TodoWrite": ("Keep the task list.", {"type": "object", "properties": {"todos": {"type": "array"}}}),
    "Task": ("Hand a sub-task to a helper.", schema(description="string", prompt="string")),
    "ListDir": ("List a directory.", schema(path="string")),
}
USER_ID = json.dumps({"device_id": "0f1e", "account_uuid": "", "session_id": "5a2b"})
BETAS = ["context-management-2025-06-27", "interleaved-thinking-2025-05-14"]


# -- Claude Code: /v1/messages?beta=true ------------------------------------------------------------------------------


def claude_code_request(**fields) -> dict:
    """A turn after a tool round trip, as Claude Code sends it: thinking, effort, context editing, the user's id,
    cached system blocks, its tools and a server tool, its own earlier thinking in the history."""
    tools = [{"name": n, "description": d, "input_schema": s} for n, (d, s) in TOOLS.items()]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    tools.append({"type": "web_search_20250305", "name": "web_search", "max_uses": 5})
    return {
        "model": "tandem",
        "max_tokens": 32000,
        "stop_sequences": ["\n"],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": USER_ID},
        "system": [
            {"type": "text", "text": "You are a command-line coding agent."},
            {"type": "text", "text": system_prompt("the agent"), "cache_control": {"type": "ephemeral"}},
        ],
        "tools": tools,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Create add.py with add(a, b)."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "First see what is there.", "signature": "RXVnZW5l"},
                    {"type": "tool_use", "id": "toolu_01", "name": "ListDir", "input": {"path": "."}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "README.md\ntests/"},
                    {"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        **fields,
    }


CLAUDE_IGNORED_ON_THE_DEVICE = {
    "reasoning_effort",  # thinking, for an endpoint that reasons: the device does not
    "context_management",
    "tools.web_search_20250305",
    "messages.thinking",
    "anthropic-beta",
}


def anthropic_client(gw: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_claude_codes_request_is_answered_with_what_was_ignored_named(gw, stream):
    body = claude_code_request(stream=stream)
    raw = anthropic_client(gw).beta.messages.with_raw_response.create(**body, betas=BETAS, extra_query={"beta": "true"})
    assert raw.http_response.status_code == 200
    assert raw.http_response.url.params["beta"] == "true"
    names = ignored(raw.headers)
    assert names >= CLAUDE_IGNORED_ON_THE_DEVICE, names
    # The user's id is kept in the trace (chat's `user`); the device reuses its cached prefix by itself.
    assert not names & {"user", "metadata", "cache_control", "thinking", "output_config.effort"}
    if stream:
        events = list(raw.parse())
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        opened = [e.index for e in events if e.type == "content_block_start"]
        assert opened == [e.index for e in events if e.type == "content_block_stop"] == list(range(len(opened)))
        assert events[-2].delta.stop_reason in ("end_turn", "stop_sequence", "tool_use", "max_tokens")
        assert events[-2].usage.output_tokens >= 1
    else:
        message = raw.parse()
        assert message.type == "message" and message.role == "assistant"
        assert message.stop_reason in ("end_turn", "stop_sequence", "tool_use", "max_tokens")
        assert all(block.type in ("text", "tool_use") for block in message.content)
    trace = httpx.get(f"{gw.url}/v1/requests/{raw.headers['x-request-id']}", timeout=10).json()
    assert trace["user"] == USER_ID
    assert set(trace["ignored_fields"]) == names


def test_claude_codes_token_count_takes_the_same_fields(gw):
    body = claude_code_request()
    for name in ("max_tokens", "stop_sequences", "metadata"):
        body.pop(name)
    counted = anthropic_client(gw).beta.messages.count_tokens(**body, betas=BETAS, extra_query={"beta": "true"})
    assert counted.input_tokens > 800  # the system prompt and ten tools' schemas


def test_a_reasoning_cloud_gets_claudes_thinking_as_an_effort_and_only_the_clients_tools(gw, upstream):
    upstream.push(Answer(pieces=("Done",)))
    raw = anthropic_client(gw).beta.messages.with_raw_response.create(
        **claude_code_request(model="oai"), betas=BETAS, extra_query={"beta": "true"}
    )
    assert raw.parse().content[0].text == "Done"
    (sent,) = upstream.requests
    assert sent.body["reasoning_effort"] == "high" and sent.body["user"] == USER_ID
    assert [t["function"]["name"] for t in sent.body["tools"]] == list(TOOLS)
    assert "First see what is there" not in json.dumps(sent.body["messages"])
    names = ignored(raw.headers)
    assert "reasoning_effort" not in names and names >= CLAUDE_IGNORED_ON_THE_DEVICE - {"reasoning_effort"}


# -- Codex CLI: /v1/responses -----------------------------------------------------------------------------------------

VERSION_TOOL = {
    "type": "custom",
    "name": "set_version",
    "description": "Set the package's version number.",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{1,3}"},
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: "*** Begin Patch" LF hunk+ "*** End Patch"\nhunk: /[^\\n]*/ LF\nLF: "\\n"',
    },
}
FILES = {
    "type": "namespace",
    "name": "files",
    "description": "The workspace's files.",
    "tools": [
        {
            "type": "function",
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "enum": ["add.py", "README.md"]}},
                "required": ["path"],
                "additionalProperties": False,
            },
            "strict": True,
        }
    ],
}


def codex_request(**fields) -> dict:
    """A later turn of Codex CLI's: its function tools, a namespace, a web search and the local shell, a freeform
    patch tool, reasoning it cannot read back, and the earlier turn's items."""
    functions = [
        {"type": "function", "name": n.lower(), "description": d, "parameters": s, "strict": False}
        for n, (d, s) in list(TOOLS.items())[:6]
    ]
    return {
        "model": "tandem",
        "instructions": system_prompt("Codex"),
        "tools": [*functions, FILES, {"type": "web_search"}, {"type": "local_shell"}, APPLY_PATCH, VERSION_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "prompt_cache_key": "6f1c-session",
        "text": {"verbosity": "low"},
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Create add.py."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAABo"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "read_file",
                "namespace": "files",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "No such file."},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done."},
            {
                "type": "message",
                "role": "assistant",
                "phase": "final_answer",
                "content": [{"type": "output_text", "text": "Created add.py.", "annotations": []}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Anything else?"}]},
        ],
        **fields,
    }


CODEX_IGNORED_ON_THE_DEVICE = {
    "include",
    "client_metadata",
    "reasoning_effort",
    "reasoning.summary",
    "verbosity",
    "prompt_cache_key",
    "store",
    "tools.web_search",
    "tools.local_shell",
    "tools.apply_patch.format",  # a Lark grammar: the model reads it, no endpoint enforces it
    "input.reasoning",
}


def openai_client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=120)


def responses(gw: GatewayProcess, body: dict):
    """The raw response of a Responses request the SDK sends (Codex's own fields in `extra_body`)."""
    return openai_client(gw).responses.with_raw_response.create(
        **body, extra_body={"client_metadata": {"originator": "codex_exec"}}
    )


def test_codexs_streamed_request_has_every_event_the_cli_parses(gw):
    raw = responses(gw, codex_request(stream=True))
    assert raw.http_response.status_code == 200
    assert ignored(raw.headers) >= CODEX_IGNORED_ON_THE_DEVICE, ignored(raw.headers)
    events = list(raw.parse())
    kinds = [e.type for e in events]
    # Codex asks no max_output_tokens: the gateway's cap (a few tokens here) may end the answer, unsaid (nothing asked)
    assert "x-tandem-max-tokens-clamped" not in raw.headers
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [e.output_index for e in events if e.type == "response.output_item.done"] == list(range(len(added)))
    final = events[-1].response
    assert final.status == kinds[-1].removeprefix("response.") and final.id == raw.headers["x-request-id"]
    usage = final.usage
    assert usage.input_tokens > 800 and usage.output_tokens >= 1
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert [t.type for t in final.tools].count("namespace") == 1


# A forced call: one (parallel_tool_calls false), and room for its tags and JSON in SmolLM2's tokens.
FORCED = {"parallel_tool_calls": False, "max_output_tokens": 96}


def test_a_forced_custom_tool_writes_its_input_in_the_regex_grammar(gw):
    choice = {"type": "custom", "name": "set_version"}
    raw = responses(gw, codex_request(stream=True, tool_choice=choice, **FORCED))
    events = list(raw.parse())
    delta, done = (e for e in events if e.type.startswith("response.custom_tool_call_input."))
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert item.type == "custom_tool_call" and item.name == "set_version" and item.call_id.startswith("call_")
    assert item.input == delta.delta == done.input and item.input.isdigit() and len(item.input) <= 3


def test_a_forced_namespaced_function_comes_back_with_its_namespace(gw):
    answer = responses(gw, codex_request(tool_choice={"type": "function", "name": "read_file"}, **FORCED)).parse()
    (call,) = answer.output
    assert (call.type, call.name, call.namespace) == ("function_call", "read_file", "files")
    assert json.loads(call.arguments)["path"] in ("add.py", "README.md")


def test_a_chat_clouds_calls_come_back_as_codexs_own_items(gw, upstream):
    def call(index: int, name: str, arguments: str) -> dict:
        return {"index": index, "id": f"call_up{index}", "function": {"name": name, "arguments": arguments}}

    read_call = call(0, "files__read_file", '{"path": "add.py"}')
    upstream.push(Answer(pieces=(), calls=(read_call, call(1, "apply_patch", '{"input": "*** Begin Patch"}'))))
    raw = responses(gw, codex_request(model="oai"))
    answer = raw.parse()
    read, patch = answer.output
    assert (read.type, read.name, read.namespace) == ("function_call", "read_file", "files")
    assert json.loads(read.arguments) == {"path": "add.py"}
    assert (patch.type, patch.name, patch.input) == ("custom_tool_call", "apply_patch", "*** Begin Patch")
    (sent,) = upstream.requests
    offered = [t["function"]["name"] for t in sent.body["tools"]]
    assert offered == [
        "bash",
        "read",
        "write",
        "edit",
        "glob",
        "grep",
        "files__read_file",
        "apply_patch",
        "set_version",
    ]
    assert sent.body["reasoning_effort"] == "medium" and sent.body["prompt_cache_key"] == "6f1c-session"
    history = sent.body["messages"]
    assert "gAAAAABo" not in json.dumps(history)  # the encrypted reasoning never leaves
    assert [c["function"]["name"] for m in history for c in m.get("tool_calls") or ()] == [
        "files__read_file",
        "apply_patch",
    ]
    names = ignored(raw.headers)
    assert not names & {"reasoning_effort", "prompt_cache_key", "store", "verbosity"}  # the openai dialect takes them
    assert names >= {"include", "client_metadata", "tools.web_search", "input.reasoning"}


# -- opencode and aider: /v1/chat/completions --------------------------------------------------------------------------


def test_opencodes_streamed_request_with_32000_max_tokens_and_its_tools(gw):
    """@ai-sdk/openai-compatible's body: max_tokens 32,000, include_usage, tool_choice auto, ten tools, and an
    earlier answer's reasoning sent back as `reasoning_content`."""
    tools = [
        {"type": "function", "function": {"name": n.lower(), "description": d, "parameters": s}}
        for n, (d, s) in TOOLS.items()
    ]
    messages = [
        {"role": "system", "content": system_prompt("opencode")},
        {"role": "user", "content": "Create add.py."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Look first.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "listdir", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "README.md"},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ]
    raw = openai_client(gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=messages,
        tools=tools,
        tool_choice="auto",
        max_tokens=32000,
        stop=["\n"],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["x-tandem-max-tokens-clamped"] == "32000->96"  # the gateway's cap, said
    assert "messages.reasoning_content" in ignored(raw.headers)
    chunks = list(raw.parse())
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "tool_calls", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 800
    clamped = httpx.get(f"{gw.v1}/requests/{raw.headers['x-request-id']}").json()["max_tokens_clamped"]
    assert clamped == {"asked": 32000, "given": 96, "endpoint": "gateway"}


@pytest.mark.parametrize("stream", [False, True])
def test_aiders_plain_chat_request(gw, stream):
    """LiteLLM's body for aider: messages only, temperature 0, a file in the prompt."""
    source = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(20))
    answer = openai_client(gw).chat.completions.create(
        model="tandem",
        messages=[
            {"role": "system", "content": "Act as an expert software developer. Reply with SEARCH/REPLACE blocks."},
            {"role": "user", "content": f"mod.py\n```\n{source}```\nAdd a docstring to f0."},
        ],
        temperature=0,
        stream=stream,
    )
    if stream:
        chunks = list(answer)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
