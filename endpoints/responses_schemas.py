"""Pydantic models of the OpenAI Responses API's request (POST /v1/responses), translated onto chat by
endpoints/responses.py.

As on chat (endpoints/schemas.py, whose strict base these share), every field the pinned `openai` SDK's
`responses.create` defines is accepted: honoured, forwarded on the chat leg where an endpoint takes it, or ignored
visibly; a field it does not define is a 400 naming it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, NamedTuple

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from endpoints.schemas import (
    _MAX_COUNT,
    PromptCacheOptions,
    ReasoningEffort,
    ServiceTier,
    TandemOptions,
    _metadata_limits,
    _Request,
)

# The API's tools that are not functions of the client's own: run by OpenAI's servers (web and file search, code
# interpreter, image generation, remote MCP servers, tool search) or by a client's built-in machinery (computer use,
# local_shell, shell, apply_patch). Tandem's models call functions only: these are not offered, and reported ignored.
HOSTED_TOOLS = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "mcp",
    "tool_search",
    "programmatic_tool_calling",
    "computer",
    "computer_use",
    "computer_use_preview",
    "local_shell",
    "shell",
    "apply_patch",
)
# Input items of those tools (their calls and outputs, from a conversation another server answered), and the API's
# other items that carry nothing for a text model: dropped, reported ignored as `input.<type>`.
DROPPED_ITEMS = (
    "reasoning",  # the model's own earlier reasoning (encrypted_content: readable by OpenAI only)
    "compaction",
    "compaction_trigger",
    "configuration_update",
    "additional_tools",
    "web_search_call",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "code_interpreter_call",
    "image_generation_call",
    "tool_search_call",
    "tool_search_output",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "program",
    "program_output",
)
# A function or custom tool's keys that change nothing Tandem does with it (reported ignored as `tools.<key>`).
_TOOL_EXTRAS = ("defer_loading", "allowed_callers", "output_schema", "async_")
_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def namespaced(namespace: str | None, name: str) -> str:
    """The one function name a namespace's tool is offered under (chat has no namespaces): `<namespace>__<name>`."""
    return f"{namespace}__{name}" if namespace else name


class _Unservable(_Request):
    """Content Tandem's text models cannot read: refused, naming it (an answer that never saw it is not what was
    asked)."""

    type: Literal["input_image", "input_file", "input_audio"]

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"Tandem serves text models only: {self.type} content cannot be served")


class InputTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    # An earlier answer's output_text part, sent back as input, carries these; they say nothing about this request.
    annotations: list | None = None
    logprobs: list | None = None
    # A caching hint: the device reuses the longest prefix it evaluated by itself; a cloud that takes one gets the
    # conversation's prompt_cache_key.
    prompt_cache_breakpoint: dict | None = None


class RefusalPart(_Request):
    """An earlier answer's refusal, sent back: history, not shown to the model (as chat's assistant `refusal`)."""

    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputTextPart | RefusalPart | _Unservable, Field(discriminator="type")]
ToolOutput = str | list[Annotated[InputTextPart | _Unservable, Field(discriminator="type")]]


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, InputTextPart))


class InputMessage(_Request):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]
    # An earlier response's output message, sent back as input (the stateless way to continue a conversation).
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an assistant message's, sent back: history

    def text(self) -> str:
        return _text(self.content)


class _Call(_Request):
    call_id: str
    name: str
    namespace: str | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: dict | None = None  # the execution context that produced it (programmatic tool calling): not used
    async_: bool | None = Field(None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def function_name(self) -> str:
        """The name the call goes by on the chat leg."""
        return namespaced(self.namespace, self.name)


class FunctionCallItem(_Call):
    """A function call the model made, sent back as input."""

    type: Literal["function_call"]
    arguments: str


class CustomToolCallItem(_Call):
    """A custom tool's call the model made, sent back as input (its `input` is the function's one argument)."""

    type: Literal["custom_tool_call"]
    input: str


class _Output(_Request):
    call_id: str
    output: ToolOutput
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    caller: dict | None = None

    def text(self) -> str:
        return _text(self.output)


class FunctionCallOutputItem(_Output):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    name: str | None = None
    namespace: str | None = None


class CustomToolCallOutputItem(_Output):
    """The result of a custom tool's call, for the model to read."""

    type: Literal["custom_tool_call_output"]


class DroppedItem(_Request):
    """An input item a text model has no use for (DROPPED_ITEMS): dropped, reported ignored."""

    type: Literal[DROPPED_ITEMS]

    model_config = ConfigDict(extra="allow")


class ItemReference(_Request):
    """A stored item, by its id: Tandem stores none."""

    type: Literal["item_reference"] | None = None
    id: str

    @model_validator(mode="after")
    def _stateless(self):
        raise ValueError("Tandem is stateless and stores no items; send the item itself instead of a reference")


def _kind(value) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# The union members below are tagged as pydantic names a union's member (`item[function_call]`), which an error's
# field path leaves out (endpoints/errors.py: _union_member): a bad item is `input[3].arguments`, a bad tool
# `tools[0].name`, as the API names them.
def _item_kind(item) -> str:
    kind = _kind(item)
    if kind is None:  # both an easy message and an item reference may leave their type out
        has_role = ("role" in item) if isinstance(item, dict) else hasattr(item, "role")
        kind = "message" if has_role else "item_reference"
    return f"item[{'dropped' if kind in DROPPED_ITEMS else kind}]"


InputItem = Annotated[
    Annotated[InputMessage, Tag("item[message]")]
    | Annotated[FunctionCallItem, Tag("item[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("item[function_call_output]")]
    | Annotated[CustomToolCallItem, Tag("item[custom_tool_call]")]
    | Annotated[CustomToolCallOutputItem, Tag("item[custom_tool_call_output]")]
    | Annotated[DroppedItem, Tag("item[dropped]")]
    | Annotated[ItemReference, Tag("item[item_reference]")],
    Discriminator(_item_kind),
]


class ResponsesFunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    defer_loading: bool | None = None  # tool search's: offered here all the same
    allowed_callers: list[str] | None = None
    output_schema: dict | None = None
    async_: bool | None = Field(None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextToolFormat(_Request):
    type: Literal["text"]


class GrammarToolFormat(_Request):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str


class CustomTool(_Request):
    """A freeform tool: the model writes its input as plain text, in a grammar where one is given. Offered as a
    function of one string argument, `input` (a regex as that string's `pattern`, which grammar-constrained
    endpoints enforce; a Lark grammar described to the model and reported ignored, since a string inside a call's
    JSON cannot be constrained by it)."""

    type: Literal["custom"]
    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    format: Annotated[TextToolFormat | GrammarToolFormat, Field(discriminator="type")] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    async_: bool | None = Field(None, alias="async")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def grammar(self) -> GrammarToolFormat | None:
        return self.format if isinstance(self.format, GrammarToolFormat) else None


class UnknownTool(_Request):
    """A tool of no type this API defines (or none a namespace may hold): refused, naming those it may be."""

    type: object = None

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"{self.type!r} is no tool type of this API here ({', '.join(map(repr, _TOOL_TYPES))})")


_TOOL_TYPES = ("function", "custom", "namespace", *HOSTED_TOOLS)


def _tool_kind(tool, kinds=("function", "custom", "namespace")) -> str:
    kind = _kind(tool)
    if kind in HOSTED_TOOLS and "namespace" in kinds:
        return "tool[hosted]"
    return f"tool[{kind}]" if kind in kinds else "tool[unknown]"


NamespacedTool = Annotated[
    Annotated[ResponsesFunctionTool, Tag("tool[function]")]
    | Annotated[CustomTool, Tag("tool[custom]")]
    | Annotated[UnknownTool, Tag("tool[unknown]")],
    Discriminator(lambda tool: _tool_kind(tool, kinds=("function", "custom"))),  # a namespace holds these only
]


class NamespaceTool(_Request):
    """A group of function and custom tools under one name: each offered as its own function, `<namespace>__<name>`,
    and its calls come back with `name` and `namespace` apart, as the API returns them."""

    type: Literal["namespace"]
    name: str
    description: str
    tools: Annotated[list[NamespacedTool], Field(min_length=1, max_length=128)]

    @model_validator(mode="after")
    def _names_fit_a_function_name(self):
        for i, tool in enumerate(self.tools):
            name = namespaced(self.name, tool.name)
            if len(name) > 64 or not re.match(_NAME, name):
                raise ValueError(
                    f"tools[{i}] is offered as the function {name!r}, which is not a function name of 1 to 64 "
                    "letters, digits, '_' or '-'"
                )
        return self


class HostedTool(_Request):
    """One of the API's built-in tools (HOSTED_TOOLS): not offered, reported ignored."""

    type: Literal[HOSTED_TOOLS]

    model_config = ConfigDict(extra="allow")


ResponsesTool = Annotated[
    Annotated[ResponsesFunctionTool, Tag("tool[function]")]
    | Annotated[CustomTool, Tag("tool[custom]")]
    | Annotated[NamespaceTool, Tag("tool[namespace]")]
    | Annotated[HostedTool, Tag("tool[hosted]")]
    | Annotated[UnknownTool, Tag("tool[unknown]")],
    Discriminator(_tool_kind),
]


class ResponsesNamedTool(_Request):
    type: Literal["function", "custom"]
    name: str


class AllowedTools(_Request):
    """The tools the model may use this turn, out of `tools` (the rest stay in the request for the prompt cache):
    only they are offered."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict]

    def allows(self, offered: Offered) -> bool:
        """Whether an entry names the tool (a namespace's entry: each of its tools)."""
        tool = offered.tool
        for entry in self.tools:
            kind, name = entry.get("type"), entry.get("name")
            if kind == "namespace" and name == offered.namespace:
                return True
            if kind == tool.type and name == tool.name and entry.get("namespace") in (None, offered.namespace):
                return True
        return False


class HostedToolChoice(_Request):
    """A built-in tool forced: none is offered, so the model chooses as under `auto` (reported ignored)."""

    type: Literal[
        "file_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "computer",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "code_interpreter",
        "mcp",
        "programmatic_tool_calling",
        "apply_patch",
        "shell",
    ]

    model_config = ConfigDict(extra="allow")


ToolChoice = Annotated[ResponsesNamedTool | AllowedTools | HostedToolChoice, Field(discriminator="type")]


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    # json_schema only:
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("name and schema are given exactly when type is 'json_schema'")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesReasoning(_Request):
    effort: ReasoningEffort | None = None  # chat's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None  # no reasoning items here: ignored visibly
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None  # which turns' reasoning it keeps: none here
    mode: str | None = None  # "standard" or "pro"


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # accepted either way: Tandem is stateless and stores nothing
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Chat's platform fields, forwarded on the chat leg where taken (text.verbosity and reasoning.effort too).
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: Annotated[str, Field(max_length=128)] | None = None
    service_tier: ServiceTier | None = None
    reasoning: ResponsesReasoning | None = None
    stream_options: ResponsesStreamOptions | None = None
    # This API's own, none of which changes the answer here: ignored visibly.
    truncation: Literal["auto", "disabled"] | None = None  # "disabled" is what Tandem does (a 400 past the window)
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = None
    context_management: list[dict] | None = None
    access_programs: dict | None = None
    image: dict | None = None
    background_options: dict | None = None
    client_metadata: dict | None = None  # Codex CLI's own (not in the SDK): what the client is, for the server
    # Stateful or built on what Tandem has not: a 400 saying why.
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    moderation: dict | None = None
    tandem: TandemOptions | None = None

    _metadata = field_validator("metadata")(_metadata_limits)

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _stateless(cls, value, info):
        if value is not None:
            what = {"prompt": "stored prompts", "conversation": "conversations"}.get(info.field_name, "responses")
            raise ValueError(f"Tandem is stateless and stores no {what}; send the whole conversation as input")
        return value

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value):
        if value:
            raise ValueError("background responses need a stored response to fetch later; Tandem stores none")
        return value

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, value):
        if value is not None:
            raise ValueError("moderation is not available: Tandem runs no moderation model")
        return value

    @field_validator("include")
    @classmethod
    def _no_output_logprobs(cls, value):
        if value and "message.output_text.logprobs" in value:
            raise ValueError("message.output_text.logprobs is not available: this API's answers carry no logprobs here")
        return value

    def offered(self) -> dict[str, Offered]:
        """The tools the model is offered, by the function name each goes by on the chat leg: function and custom
        tools, a namespace's flattened, those `allowed_tools` leaves when it is the choice; the built-in ones are not
        (they are reported ignored)."""
        out: dict[str, Offered] = {}
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, NamespaceTool):
                for j, inner in enumerate(tool.tools):
                    out[namespaced(tool.name, inner.name)] = Offered(
                        inner, f"tools[{i}].tools[{j}]", tool.name, tool.description
                    )
            elif not isinstance(tool, HostedTool):
                out[tool.name] = Offered(tool, f"tools[{i}]")
        if isinstance(self.tool_choice, AllowedTools):
            out = {name: o for name, o in out.items() if self.tool_choice.allows(o)}
        return out

    def ignored_extras(self) -> dict[str, object]:
        """This API's own fields that no endpoint applies (each reported as ignored with the answer), the built-in
        tools not offered and the input items dropped among them."""
        out = {
            name: getattr(self, name)
            for name in (
                "include",
                "top_logprobs",
                "max_tool_calls",
                "context_management",
                "access_programs",
                "image",
                "background_options",
                "client_metadata",
            )
            if getattr(self, name) is not None
        }
        if self.truncation == "auto":
            out["truncation"] = "auto"
        reasoning = self.reasoning
        if reasoning is not None:
            if reasoning.summary or reasoning.generate_summary:
                out["reasoning.summary"] = reasoning.summary or reasoning.generate_summary
            out |= {f"reasoning.{k}": v for k in ("context", "mode") if (v := getattr(reasoning, k)) is not None}
        for tool in self.tools or ():
            if isinstance(tool, HostedTool):
                out[f"tools.{tool.type}"] = True
            for inner in tool.tools if isinstance(tool, NamespaceTool) else (tool,):
                out |= {f"tools.{k.rstrip('_')}": True for k in _TOOL_EXTRAS if getattr(inner, k, None) is not None}
                if isinstance(inner, CustomTool) and inner.grammar is not None and inner.grammar.syntax == "lark":
                    out[f"tools.{inner.name}.format"] = "lark"  # described to the model, not enforced
        if isinstance(self.tool_choice, HostedToolChoice):
            out["tool_choice"] = self.tool_choice.type  # no such tool offered: the model chooses as under auto
        for item in self.input if isinstance(self.input, list) else ():
            if isinstance(item, DroppedItem):
                out[f"input.{item.type}"] = out.get(f"input.{item.type}", 0) + 1
        return out


class Offered(NamedTuple):
    """A tool the model is offered (a function, or a custom tool as a function of one string), and its namespace's
    name and description when it has one."""

    tool: ResponsesFunctionTool | CustomTool
    path: str  # where the request defines it (`tools[i]`, or `tools[i].tools[j]` in a namespace)
    namespace: str | None = None
    namespace_description: str | None = None
