"""Pydantic models of the Anthropic Messages API's requests (POST /v1/messages, POST /v1/messages/count_tokens).

As on the OpenAI surface (endpoints/schemas.py, whose strict base these share), an unknown field is a 400 naming it,
and text with lone surrogates or numbers past their bounds are 400s where they enter. Every field the pinned SDK
defines (its beta surface's too: Claude Code sends `/v1/messages?beta=true`) is accepted: honoured, mapped onto the
chat request (`thinking` and `output_config.effort` as `reasoning_effort`, `metadata.user_id` as `user`,
`service_tier`, `output_config.format` as a json_schema format), or ignored visibly (`ignored_extras`: the
`x-tandem-ignored-fields` header and the trace). Earlier thinking blocks and server tools' blocks in the history are
dropped, and server tools are not offered, visibly so; so is Claude Code's attribution block in `system`
(`x-anthropic-billing-header: …`, a per-request fingerprint that would end every prefix cache's match). Content
Tandem cannot read (images, documents) is a 400 naming the field, never dropped: an agent that sent a screenshot must
not get an answer that silently never saw it.
The conversation's shape is checked as the API checks it: the first message is the user's, each tool_result answers
a tool_use of the assistant message just before it, and a trailing assistant message (a prefill, which the answer
continues) is text.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from endpoints.schemas import _MAX_COUNT, TandemOptions, _Request

_MAX_STOPS = 16


class CacheControl(_Request):
    """A prompt-caching hint. The device needs none (it reuses the longest cached prefix by itself); an upstream whose
    dialect takes one gets the request's as one top-level hint, and any other reports it ignored
    (clients/dialects.py: CACHE_HINTS)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = None  # an earlier answer's, sent back: history


class ToolUseBlock(_Request):
    """A call the assistant made, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None
    caller: dict | None = None  # who called it (the SDK sends back what the API returned); not used


class Unservable(_Request):
    """A content block Tandem's text models cannot read: refused, naming it."""

    type: Literal["image", "document"]

    model_config = ConfigDict(extra="allow")  # whatever else the block carries: it is refused as a whole

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"Tandem serves text models only: {self.type} content cannot be served")


class SearchResultBlock(_Request):
    """A search result the client supplies (for citations): read as text."""

    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: dict | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        return "\n\n".join([f"{self.title} ({self.source})", *(block.text for block in self.content)])


# Blocks of an earlier answer that a text model has no use for: Claude's thinking (its signature readable by
# Anthropic only) and the server tools' calls and results. Dropped, reported ignored as `messages.<type>`.
DROPPED_BLOCKS = (
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "advisor_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "mcp_tool_listing",
    "container_upload",
    "compaction",
    "tool_addition",
    "tool_removal",
    "tool_reference",
    "fallback",
)


class DroppedBlock(_Request):
    type: Literal[DROPPED_BLOCKS]

    model_config = ConfigDict(extra="allow")


def _text_of(blocks) -> list[str]:
    return [b.text for b in blocks if isinstance(b, TextBlock | SearchResultBlock)]


class ToolResultBlock(_Request):
    """The result of a tool call, for the model to read."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: (
        str
        | list[Annotated[TextBlock | SearchResultBlock | DroppedBlock | Unservable, Field(discriminator="type")]]
        | None
    ) = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n\n".join(_text_of(self.content or ()))
        return f"Error: {body}" if self.is_error else body


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | SearchResultBlock | DroppedBlock | Unservable,
    Field(discriminator="type"),
]


class Message(_Request):
    # "system": an instruction inside the conversation (the SDK's SystemMessageParam; Claude Code sends one after the
    # user's first message), text only, kept where it stands; user and assistant alternate around it.
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        if self.role == "system" and any(not isinstance(b, TextBlock) for b in self.blocks):
            raise ValueError("a system message holds text blocks only")
        for block in self.blocks:
            if isinstance(block, ToolUseBlock) and self.role != "assistant":
                raise ValueError("tool_use blocks are the assistant's; a user message answers them with tool_result")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ValueError("tool_result blocks go in a user message")
        return self

    @property
    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    def text(self, separator: str) -> str:
        return separator.join(_text_of(self.blocks))


class ToolDefinition(_Request):
    """A client tool: offered to the model as a function."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict
    cache_control: CacheControl | None = None
    strict: bool | None = None  # the schema is enforced either way where an endpoint applies grammars
    # Tool search's, fine-grained streaming's, examples, programmatic calling's: none changes what Tandem does with
    # the tool (offered all the same, its input sent whole), so each is reported ignored as `tools.<key>`.
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict] | None = None
    allowed_callers: list[str] | None = None


_ATTRIBUTION = "x-anthropic-billing-header:"  # Claude Code's attribution block in `system` (Conversation._attribution)
_TOOL_EXTRAS = ("defer_loading", "eager_input_streaming", "input_examples", "allowed_callers")
# Server tools (web search, web fetch, code execution, tool search, ...) and Anthropic-defined client tools (bash,
# text_editor, computer, memory) are versioned types; MCP toolsets name the servers Anthropic would call.
_SERVER_TOOL = re.compile(r"^[a-z_]+_\d{8}$")


class ServerTool(_Request):
    """A tool the Anthropic API defines itself: not offered to the model (Tandem's models call the client's own
    tools), reported ignored as `tools.<type>`."""

    type: str
    name: str | None = None

    model_config = ConfigDict(extra="allow")

    @field_validator("type")
    @classmethod
    def _a_server_tools_type(cls, value: str) -> str:
        if not _SERVER_TOOL.match(value) and value != "mcp_toolset":
            raise ValueError(f"{value!r} is no tool type of this API (a client tool's is 'custom', or none)")
        return value


def _tool_kind(tool) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "custom" if kind in (None, "custom") else "server"


Tool = Annotated[
    Annotated[ToolDefinition, Tag("custom")] | Annotated[ServerTool, Tag("server")], Discriminator(_tool_kind)
]


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given exactly when type is 'tool'")
        return self


class Thinking(_Request):
    """Claude's thinking: a text model has none; a reasoning endpoint gets an effort for it (`reasoning_effort`)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=0, le=_MAX_COUNT)] | None = None
    display: Literal["summarized", "omitted", "updates"] | None = None

    model_config = ConfigDict(extra="allow")  # a newer key: reported ignored as `thinking.<key>`


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(_Request):
    effort: Effort | None = None  # `reasoning_effort` where thinking is on; else reported ignored
    format: JsonOutputFormat | None = None  # structured output: chat's json_schema format, enforced as there
    task_budget: dict | None = None

    model_config = ConfigDict(extra="allow")


class Metadata(_Request):
    user_id: str | None = None  # the caller's id for its user: chat's `user` (the trace keeps it)


def _previous_calls(messages: list[Message], i: int) -> set[str]:
    before = messages[i - 1] if i else None
    if before is None or before.role != "assistant":
        return set()
    return {b.id for b in before.blocks if isinstance(b, ToolUseBlock)}


class Conversation(_Request):
    """What both routes read: the model, the conversation, its system prompt and tools."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # The API's own that change nothing Tandem does (context editing, MCP servers Anthropic would call, its
    # compaction, billing, speed, who asks on whose behalf): reported ignored.
    context_management: dict | None = None
    mcp_servers: list[dict] | None = None
    compaction: dict | None = None
    billing_policy: dict | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    tandem: TandemOptions | None = None  # Tandem's own extension (the SDK's `extra_body={"tandem": {...}}`)

    _IGNORED: ClassVar[tuple[str, ...]] = (
        "context_management",
        "mcp_servers",
        "compaction",
        "billing_policy",
        "speed",
        "user_profile_id",
        "workspace_id",
    )

    @field_validator("messages")
    @classmethod
    def _conversation_order(cls, messages: list[Message]):
        turns = [(i, m) for i, m in enumerate(messages) if m.role != "system"]  # a system message takes no turn
        if not turns or turns[0][1].role != "user":
            raise ValueError("the first message must be the user's")
        for k, (i, message) in enumerate(turns):
            if k and message.role == turns[k - 1][1].role:
                raise ValueError(f"messages[{i}] has the role of the one before it; user and assistant alternate")
            called = _previous_calls([m for _, m in turns], k)
            for block in message.blocks:
                if isinstance(block, ToolResultBlock) and block.tool_use_id not in called:
                    raise ValueError(
                        f"messages[{i}]: the tool_result for '{block.tool_use_id}' answers no tool_use of the "
                        "assistant message just before it"
                    )
            answered = {b.tool_use_id for b in message.blocks if isinstance(b, ToolResultBlock)}
            if message.role == "user" and called - answered:
                raise ValueError(f"messages[{i}] must answer the tool_use ids {sorted(called - answered)}")
        last = messages[-1]
        if last.role == "assistant":
            if any(not isinstance(b, TextBlock | DroppedBlock) for b in last.blocks):
                raise ValueError("a final assistant message (a prefill, which the answer continues) must be text")
            if last.text("") != last.text("").rstrip():
                raise ValueError("a final assistant message (a prefill) cannot end with whitespace")
        return messages

    @property
    def prefill(self) -> bool:
        """The last message is the assistant's answer begun (its text: a thinking block alone begins nothing): the
        answer continues it."""
        return self.messages[-1].role == "assistant" and self.messages[-1].text("") != ""

    @property
    def custom_tools(self) -> list[ToolDefinition]:
        return [t for t in self.tools or () if isinstance(t, ToolDefinition)]

    def reasoning_effort(self) -> str | None:
        """The effort a reasoning endpoint is asked for (chat's `reasoning_effort`), when thinking is on:
        `output_config.effort`, else an enabled thinking's budget on LiteLLM's scale (≤ 1,024 tokens low, ≤ 2,048
        medium, more high), else Anthropic's default, high."""
        thinking = self.thinking
        if thinking is None or thinking.type == "disabled":
            return None
        if self.output_config is not None and self.output_config.effort is not None:
            return self.output_config.effort
        budget = thinking.budget_tokens
        if thinking.type == "enabled" and budget is not None:
            return "low" if budget <= 1024 else "medium" if budget <= 2048 else "high"
        return "high"

    def ignored_extras(self, beta: str | None = None) -> dict[str, object]:
        """What no endpoint applies (each reported ignored with the answer): this API's own fields, the keys of
        `thinking` and `output_config` beyond those mapped, the server tools not offered, the blocks dropped from the
        history, and the `anthropic-beta` header's features (`beta`)."""
        out: dict[str, object] = {name: True for name in self._IGNORED if getattr(self, name) is not None}
        config = self.output_config
        if config is not None:
            if config.effort is not None and self.reasoning_effort() is None:
                out["output_config.effort"] = config.effort  # thinking off: no reasoning asked for
            if config.task_budget is not None:
                out["output_config.task_budget"] = True
            out |= {f"output_config.{key}": True for key in config.model_extra or {}}
        if self.thinking is not None:
            out |= {f"thinking.{key}": True for key in self.thinking.model_extra or {}}
        for tool in self.tools or ():
            if isinstance(tool, ServerTool):
                out[f"tools.{tool.type}"] = True
            else:
                out |= {f"tools.{key}": True for key in _TOOL_EXTRAS if getattr(tool, key) is not None}
        for message in self.messages:
            for block in message.blocks:
                inner = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else ()
                for dropped in (b for b in (block, *inner) if isinstance(b, DroppedBlock)):
                    out[f"messages.{dropped.type}"] = out.get(f"messages.{dropped.type}", 0) + 1
        if self._attribution():
            out["system.x-anthropic-billing-header"] = True
        if beta:
            out["anthropic-beta"] = beta
        return out

    def cache_hint(self) -> dict | None:
        """The request's prompt-caching hint: its own `cache_control`, else the first block's or tool's that has one
        (chat's shapes carry no per-block markers: an upstream places its breakpoint itself)."""
        marked = [
            self,
            *(self.system if isinstance(self.system, list) else ()),
            *(self.tools or ()),
            *(block for message in self.messages for block in message.blocks),
        ]
        # (a dropped block's or a server tool's hint is among its extra keys: a plain dict, and not one of these)
        hint = next((h for m in marked if isinstance(h := getattr(m, "cache_control", None), CacheControl)), None)
        return None if hint is None else hint.model_dump(exclude_none=True)

    def _attribution(self) -> list[TextBlock]:
        """Claude Code's attribution blocks in `system` (`x-anthropic-billing-header: cc_version=…; cch=…;`): the
        Anthropic API reads them for billing, not as prompt, and their fingerprint changes with every request, so as
        prompt text they would be the first thing to differ between two turns of one conversation and no prefix cache
        (the device's, an upstream's) would ever match past them. Dropped, and reported ignored."""
        if not isinstance(self.system, list):
            return []
        return [block for block in self.system if block.text.startswith(_ATTRIBUTION)]

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        kept = [block.text for block in self.system if not block.text.startswith(_ATTRIBUTION)]
        return "\n\n".join(kept) if kept or not self.system else None


class MessagesRequest(Conversation):
    max_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)]  # required, as the API requires it
    stop_sequences: Annotated[list[str], Field(max_length=_MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=_MAX_COUNT)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # chat's service_tier ("auto", "default")
    stream: bool | None = False
    # The API's own, which change nothing Tandem does (a code-execution container, cache diagnostics, fallback models
    # and their credit, the region, a thread): reported ignored.
    container: str | dict | None = None
    diagnostics: dict | None = None
    fallback_credit_token: str | dict | None = None
    fallbacks: Any = None
    inference_geo: str | None = None
    thread: dict | None = None

    _IGNORED: ClassVar[tuple[str, ...]] = (
        *Conversation._IGNORED,
        "container",
        "diagnostics",
        "fallback_credit_token",
        "fallbacks",
        "inference_geo",
        "thread",
    )

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stop(cls, value):
        if any(s == "" for s in value or ()):
            raise ValueError("stop sequences must not be empty strings")
        return value


class CountTokensRequest(Conversation):
    pass
