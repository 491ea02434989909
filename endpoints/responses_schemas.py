"""Pydantic models of the OpenAI Responses API's request (POST /v1/responses), translated onto chat by
endpoints/responses.py.

As on chat (endpoints/schemas.py, whose strict base these share), every field the pinned `openai` SDK's
`responses.create` defines is accepted: honoured, forwarded on the chat leg where an endpoint takes it, or ignored
visibly; a field it does not define is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from endpoints.schemas import (
    _MAX_COUNT,
    PromptCacheOptions,
    ReasoningEffort,
    ServiceTier,
    TandemOptions,
    _metadata_limits,
    _Request,
)


class InputTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    # An earlier answer's output_text part, sent back as input, carries these; they say nothing about this request.
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(_Request):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputTextPart]
    # An earlier response's output message, sent back as input (the stateless way to continue a conversation).
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    """A function call the model made, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesFunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesNamedTool(_Request):
    type: Literal["function"]
    name: str


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
    context: Literal["auto", "current_turn", "all_turns"] | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    model: str
    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
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
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
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

    def ignored_extras(self) -> dict[str, object]:
        """This API's own fields that no endpoint applies (each reported as ignored with the answer)."""
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
            )
            if getattr(self, name) is not None
        }
        if self.truncation == "auto":
            out["truncation"] = "auto"
        if self.reasoning is not None and (self.reasoning.summary or self.reasoning.generate_summary):
            out["reasoning.summary"] = self.reasoning.summary or self.reasoning.generate_summary
        return out
