"""Pydantic models of the Anthropic Messages API's requests (POST /v1/messages, POST /v1/messages/count_tokens).

As on the OpenAI surface (endpoints/schemas.py, whose strict base these share), an unknown field is a 400 naming it,
and text with lone surrogates or numbers past their bounds are 400s where they enter. Content Tandem cannot serve
(images, documents, extended thinking) is a 400 naming the field, never dropped: an agent that sent a screenshot
must not get an answer that silently never saw it. The conversation's shape is checked as the API checks it: the
first message is the user's, each tool_result answers a tool_use of the assistant message just before it, and a
trailing assistant message (a prefill, which the answer continues) is text.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

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
    citations: None = None


class ToolUseBlock(_Request):
    """A call the assistant made, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None
    caller: dict | None = None  # who called it (the SDK sends back what the API returned); not used


class Unservable(_Request):
    """A content block Tandem's text models cannot read or write: refused, naming it."""

    type: Literal["image", "document", "thinking", "redacted_thinking"]

    model_config = ConfigDict(extra="allow")  # whatever else the block carries: it is refused as a whole

    @model_validator(mode="after")
    def _refuse(self):
        what = "extended thinking" if "thinking" in self.type else f"{self.type} content"
        raise ValueError(f"Tandem serves text models only: {what} cannot be served")


class ToolResultBlock(_Request):
    """The result of a tool call, for the model to read."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | Unservable, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n\n".join(b.text for b in self.content or ())
        return f"Error: {body}" if self.is_error else body


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | Unservable, Field(discriminator="type")]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
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
        return separator.join(b.text for b in self.blocks if isinstance(b, TextBlock))


class ToolDefinition(_Request):
    type: Literal["custom"] | None = None  # a client tool; the API's server tools (web search, ...) are not served
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict
    cache_control: CacheControl | None = None


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
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None

    @model_validator(mode="after")
    def _disabled_only(self):
        if self.type != "disabled":
            raise ValueError("Tandem serves text models only: extended thinking cannot be served")
        return self


class Metadata(_Request):
    user_id: str | None = None  # the caller's own id for its user: accepted, not used


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
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    tandem: TandemOptions | None = None  # Tandem's own extension (the SDK's `extra_body={"tandem": {...}}`)

    @field_validator("messages")
    @classmethod
    def _conversation_order(cls, messages: list[Message]):
        if messages[0].role != "user":
            raise ValueError("the first message must be the user's")
        for i, message in enumerate(messages):
            if i and message.role == messages[i - 1].role:
                raise ValueError(f"messages[{i}] has the role of the one before it; user and assistant alternate")
            called = _previous_calls(messages, i)
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
            if any(not isinstance(b, TextBlock) for b in last.blocks):
                raise ValueError("a final assistant message (a prefill, which the answer continues) must be text")
            if last.text("") != last.text("").rstrip():
                raise ValueError("a final assistant message (a prefill) cannot end with whitespace")
        return messages

    @property
    def prefill(self) -> bool:
        """The last message is the assistant's answer begun: the answer continues it."""
        return self.messages[-1].role == "assistant"

    def cache_hint(self) -> dict | None:
        """The request's prompt-caching hint: its own `cache_control`, else the first block's or tool's that has one
        (chat's shapes carry no per-block markers: an upstream places its breakpoint itself)."""
        marked = [
            self,
            *(self.system if isinstance(self.system, list) else ()),
            *(self.tools or ()),
            *(block for message in self.messages for block in message.blocks),
        ]
        hint = next((m.cache_control for m in marked if getattr(m, "cache_control", None) is not None), None)
        return None if hint is None else hint.model_dump(exclude_none=True)

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n\n".join(block.text for block in self.system)


class MessagesRequest(Conversation):
    max_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)]  # required, as the API requires it
    stop_sequences: Annotated[list[str], Field(max_length=_MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=_MAX_COUNT)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = False

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stop(cls, value):
        if any(s == "" for s in value or ()):
            raise ValueError("stop sequences must not be empty strings")
        return value


class CountTokensRequest(Conversation):
    pass
