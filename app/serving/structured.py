"""Tools and structured output: what a request asks of the model's text, on every endpoint.

One format for tool calls everywhere: the Hermes/Qwen2.5 one the bundled models' chat templates teach,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The gateway renders the tools into the prompt (the model's own template when it knows tools, else the same
instructions in a system message), and reads the calls back out of the generated text (app/serving/tool_calls.py),
so a call from the device, a completions cloud or HAT looks the same, and an answer can move between them.
`tool_choice` "required" or a named function, and `response_format` json_object / json_schema, become an llguidance
grammar (clients/grammar.py) that an endpoint able to constrain applies token by token, and the same constraint in
GBNF (clients/gbnf.py) for an upstream that enforces one itself (llama.cpp's servers).

`tool_choice` "auto" (or unset) becomes a lazy call grammar, as llama.cpp's server does for the same format (its
common/chat.cpp: `grammar_lazy` with trigger words): free text, until the model starts a call (its call token, or an
answer that opens with `{"name"`); from there the call must name an offered tool and give arguments valid for its
schema. An endpoint that constrains applies it; one that cannot serves the request as before, unconstrained. The tool
list in the prompt shows each tool as the models' templates were trained on (name, description, parameters): a
schema's `title`s are left out, so a model cannot take the parameters' title (`add_args` from the OpenAI Agents SDK)
for the tool's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.serving.errors import InvalidRequest
from app.serving.requests import ChatInput
from clients import gbnf
from clients.grammar import GrammarError, check_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_FALLBACK_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class Structure:
    """What a chat request asks beyond free text."""

    tools: tuple[dict, ...] = ()  # OpenAI tool definitions, when the model may call them
    tool_choice: str | dict | None = None  # as sent (chat upstreams take it as it is)
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # as sent, None for plain text
    grammar: str | None = None  # the llguidance grammar the answer must follow
    gbnf: str | None = None  # the same in GBNF (None also when it has no GBNF form: then no GBNF upstream serves it)
    # Tool calls to any offered function: what an endpoint must write when it takes over an answer whose source
    # failed inside a call (the call was not delivered, so it is written again, and written whole).
    call_grammar: str | None = None
    call_gbnf: str | None = None
    # tool_choice auto: free text, but a call once started is well-formed (lazy_call_grammar); for the endpoints
    # that can apply it.
    tool_grammar: str | None = None
    prompt_tools: tuple[dict, ...] = ()  # the tools as the prompt shows them (prompt_tool)


def _arguments(value: str):
    """A call's arguments as the templates want them (an object), from the wire's JSON string."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def message_text(message: dict) -> str:
    """A chat message's text: its content, or the texts of its content parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def template_messages(messages: Sequence[dict], knows_tools: bool) -> list[dict]:
    """Chat messages (OpenAI's shape) as the device's chat template takes them. A template that knows tools gets
    assistant `tool_calls` (arguments as objects) and `tool` messages; one that does not gets the same turns as
    text."""
    out: list[dict] = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        text = message_text(m)
        calls = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
            for c in m.get("tool_calls") or ()
        ]
        if knows_tools:
            item = {"role": role, "content": text}
            if calls:
                item["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            out.append(item)
            continue
        if role == "tool":
            response = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_turn": True})
            continue
        if calls:
            text = "\n".join([text, *(f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls)]).lstrip("\n")
        out.append({"role": role, "content": text})
    return [{k: v for k, v in item.items() if k != "_tool_turn"} for item in out]


def add_tools_prompt(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
    """For a template that does not know tools: the tool instructions in the (first) system message."""
    listing = "".join("\n" + json.dumps(t) for t in tools)
    prompt = _FALLBACK_TOOLS_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


# JSON the way the models' templates write it (`{"a": 1, "b": [2, 3]}`): free whitespace lets a small model
# spend its tokens on newlines and indentation (SmolLM2 ran out of max_tokens inside a call that way).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


def _checked(schema, param: str) -> dict:
    if not isinstance(schema, dict):
        raise InvalidRequest("A JSON schema must be an object.", param=param)
    try:
        check_grammar("start: " + _json_rule(schema))
    except GrammarError as exc:
        raise InvalidRequest(f"This JSON schema cannot be enforced: {exc}", param=param) from None
    return schema


def _call_rules(tools: Sequence[dict], names: Sequence[str], marker: Callable[[str], str]) -> list[str]:
    """`call` (one tagged call of the named functions), `body` (its JSON), and their parts."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    options = " | ".join(f"f{i}" for i in range(len(names)))
    rules = [f'call: {marker(OPEN)} "\\n" body "\\n" {marker(CLOSE)}', f"body: {options}"]
    for i, name in enumerate(names):
        schema = by_name[name].get("parameters") or {"type": "object"}
        head = _literal('{"name": ' + json.dumps(name) + ', "arguments": ')
        rules.append(f'f{i}: {head} a{i} "}}"')
        rules.append(f"a{i}: {_json_rule(schema)}")
    return rules


def tool_call_grammar(
    tools: Sequence[dict], names: Sequence[str], parallel: bool, marker: Callable[[str], str] = _literal
) -> str:
    """One call (or, with parallel calls, one or more) of the named functions, arguments valid for each one's
    `parameters` schema. `marker` writes the <tool_call> tags: a special token of the device's vocabulary
    (`<[id]>`) where it has one, so the model is not forced to spell the tag out."""
    more = ' ("\\n" call)*' if parallel else ""
    return "\n".join([f"start: call{more}", *_call_rules(tools, names, marker)])


# An answer that opens with `{"name"` (after whitespace) is a call: Qwen2.5-Coder often writes calls as bare JSON.
_BARE_START = r'[ \t\n]*\{[ \t\n]*"name"(.|\n)*'


def lazy_call_grammar(tools: Sequence[dict], parallel: bool, marker: Callable[[str], str] = _literal) -> str:
    """tool_choice auto: any text (the answer), or text and then calls of the offered tools, or one bare JSON call;
    what a call's start commits to is a whole, valid call (llama.cpp's lazy grammar, written as one grammar: the
    free text is a lexeme that cannot contain a call's start, so the call's rules take over where it begins).

    With the call token a special token of the vocabulary (`<[id]>`), free text, which cannot produce it, ends
    where the model picks it. Written out in text, the opening tag ends the text lexeme instead (OPENING: text that
    ends at its first tag), because the lexer does not go back to split a lexeme that has taken the tag's start."""
    names = [t["function"]["name"] for t in tools]
    more = ' ("\\n" call)*' if parallel else ""
    rules = _call_rules(tools, names, marker)
    text = f"TEXT: /(.|\\n)*/ & ~/{_BARE_START}/"
    opening = marker(OPEN)
    if opening.startswith("<["):
        rules += [f"start: TEXT | TEXT call{more} | call{more} | body", text]
    else:
        tag = OPEN  # no regex metacharacters in it
        rules += [
            f'start: TEXT | OPENING "\\n" body "\\n" {marker(CLOSE)}{more} | body',
            f"{text} & ~/(.|\\n)*{tag}(.|\\n)*/",
            f"OPENING: /(.|\\n)*{tag}/ & ~/(.|\\n)*{tag}(.|\\n)+/ & ~/{_BARE_START}/",
        ]
    return "\n".join(rules)


def _untitled(schema):
    """A JSON schema without its `title` annotations (names of the properties, which may be "title", are kept)."""
    if isinstance(schema, list):
        return [_untitled(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _untitled(sub) for name, sub in value.items()}
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value  # values, not schemas
        else:
            out[key] = _untitled(value)
    return out


def prompt_tool(tool: dict) -> dict:
    """A tool as the prompt lists it: the OpenAI shape the models' templates were trained on (type, and the
    function's name, description and parameters), without the schema's titles or the request's other fields
    (`strict`). The request's tools are unchanged for everything else (a chat upstream gets them as sent)."""
    function = tool["function"]
    shown = {"name": function["name"]}
    if function.get("description"):
        shown["description"] = function["description"]
    shown["parameters"] = _untitled(function.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "function", "function": shown}


def _gbnf(build: Callable[[], str]) -> str | None:
    try:
        return build()
    except gbnf.GBNFError:
        return None


def tool_call_gbnf(tools: Sequence[dict], names: Sequence[str], parallel: bool) -> str | None:
    """tool_call_grammar's language in GBNF (the tags spelled out: an upstream's vocabulary is its own)."""
    return _gbnf(lambda: gbnf.tool_calls_grammar(tools, names, parallel, OPEN, CLOSE))


def structure_of(chat: ChatInput, marker: Callable[[str], str] = _literal) -> Structure:
    """The Structure a chat request asks for; InvalidRequest naming the field for what cannot be enforced."""
    tools = chat.tools
    for i, tool in enumerate(tools):
        _checked(tool["function"].get("parameters") or {"type": "object"}, f"tools[{i}].function.parameters")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("Tool function names must be unique.", param="tools")
    choice = chat.tool_choice
    grammar = grammar_gbnf = None
    if choice is not None and not isinstance(choice, str):
        name = choice["function"]["name"]
        if name not in names:
            raise InvalidRequest(f"tool_choice names '{name}', which is not in tools.", param="tool_choice")
        called = [name]
    else:
        called = names if choice == "required" else []
    if choice is not None and not tools:
        raise InvalidRequest("tool_choice needs tools.", param="tool_choice")
    parallel = chat.parallel_tool_calls is not False
    if called:
        # Forced calls repeat on small models once one is allowed to follow another (Qwen2.5-0.5B calls the same
        # function until max_tokens): as llama.cpp's server does, a grammar allows several only when asked to.
        several = chat.parallel_tool_calls is True and len(called) == len(names) and choice == "required"
        grammar = tool_call_grammar(tools, called, several, marker)
        grammar_gbnf = tool_call_gbnf(tools, called, several)
    fmt = chat.response_format
    if fmt is not None and fmt["type"] != "text":
        if grammar is not None:
            raise InvalidRequest(
                "response_format cannot go with a forced tool call (tool_choice).", param="response_format"
            )
        schema = {"type": "object"}
        if fmt["type"] == "json_schema":
            schema = _checked(
                fmt["json_schema"].get("schema") or {"type": "object"}, "response_format.json_schema.schema"
            )
        grammar = "start: " + _json_rule(schema)
        grammar_gbnf = _gbnf(lambda: gbnf.json_grammar(schema))
    else:
        fmt = None
    offered = tools if choice != "none" else ()
    if offered and chat.logprobs is not None:
        # Logprobs line up with the content's tokens, and the tokens of a call are not content.
        raise InvalidRequest("logprobs cannot be combined with tools.", param="logprobs")
    parallel_calls = chat.parallel_tool_calls is True
    call_grammar = tool_call_grammar(tools, names, parallel_calls, marker) if offered else None
    call_gbnf = tool_call_gbnf(tools, names, parallel_calls) if offered else None
    tool_grammar = None
    if offered and grammar is None:
        # Several calls only when the client asked (as for forced calls: small models repeat a call otherwise).
        tool_grammar = lazy_call_grammar(tools, parallel_calls, marker)
    shown = tuple(prompt_tool(t) for t in offered)
    return Structure(
        offered, choice, parallel, fmt, grammar, grammar_gbnf, call_grammar, call_gbnf, tool_grammar, shown
    )
