"""Pydantic models of the Ollama API's requests (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show).

Ollama itself ignores fields it does not know (its server decodes JSON into Go structs, and its `options` warns and
goes on), and clients of every Ollama version send fields of their own: so here too a field this API defines and
Tandem cannot apply, or one it does not define, is accepted and named in the answer's `x-tandem-ignored-fields`
header (`not_applied`), never a 400. What would change what the client gets back is refused naming the field, as on
the other front doors: images (Tandem serves text models), a Go `template` of its own, fill-in-the-middle `suffix`,
and generate's old `context` token memory. Values are checked where they enter (numbers within their bounds, no lone
surrogates), as on the OpenAI surface, whose strict base these share. Empty strings are absent values: Ollama's Go
client sends `"template": ""`, `"system": ""` and `"format": ""` with every request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from endpoints.schemas import _INT64, _MAX_COUNT, LlamaSampling, MirostatMode, TandemOptions, _Request

_MAX_STOPS = 16
TEXT_ONLY = "Tandem serves text models only: images cannot be served"


class _Lenient(_Request):
    """A body (or a part of one) that takes fields it does not define, named back to the client as not applied."""

    model_config = ConfigDict(extra="allow")

    def unknown(self, prefix: str = "") -> list[str]:
        return [prefix + name for name in self.model_extra or {}]


def _unknown_in(items, prefix: str) -> list[str]:
    """The undefined fields of a list's items, each named once (`messages[].name`)."""
    return list(dict.fromkeys(name for item in items or () for name in item.unknown(prefix)))


class Options(LlamaSampling, _Lenient):
    """`options`: the sampling options Tandem applies on every endpoint, and llama.cpp's sampling extras as the OpenAI
    surface takes them (LlamaSampling: applied on the device, forwarded to upstreams that take them); the rest
    (num_ctx, the runner's load-time options, samplers such as repeat_last_n or tfs_z) are accepted and named as not
    applied."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    mirostat_mode: MirostatMode | None = Field(None, alias="mirostat")  # Ollama's name for it, as llama-server's
    # -1 (no limit) and -2 (fill the context) take the gateway's default_max_tokens, as an absent num_predict does.
    num_predict: Annotated[int, Field(ge=-2, le=_MAX_COUNT)] | None = None
    stop: str | Annotated[list[str], Field(max_length=_MAX_STOPS)] | None = None
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64)] | None = None  # negative: a random seed, as in Ollama
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # The context is each endpoint's own (the device's n_ctx, a cloud's window): a request cannot resize it.
    num_ctx: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = None

    @field_validator("stop")
    @classmethod
    def _non_empty_stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return value

    def not_applied(self) -> list[str]:
        return (["options.num_ctx"] if self.num_ctx is not None else []) + self.unknown("options.")

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def max_tokens(self) -> int | None:
        return self.num_predict if self.num_predict is not None and self.num_predict > 0 else None


# The sampling extras by the core's names (what an endpoint names as not applied), as this API's clients send them.
SAMPLING_OPTIONS = {name: f"options.{Options.model_fields[name].alias or name}" for name in LlamaSampling.model_fields}


class ToolCallFunction(_Lenient):
    index: int | None = None
    name: str
    arguments: dict[str, Any] | str  # an object, as Ollama writes it; JSON text from OpenAI-minded clients


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool message: the tool whose result it is
    tool_call_id: str | None = None  # ... or the call it answers, where the client kept the call's id
    thinking: str | None = None  # an earlier answer's thinking, sent back: not part of the prompt

    @field_validator("images")
    @classmethod
    def _text_only(cls, value):
        if value:
            raise ValueError(TEXT_ONLY)
        return value

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value  # as Ollama reads roles

    @model_validator(mode="after")
    def _calls_are_the_assistants(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDefinition(_Lenient):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


Format = Literal["", "json"] | dict


class _Generating(_Lenient):
    """What /api/chat and /api/generate share."""

    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = True  # Ollama streams unless told not to
    format: Format | None = None
    options: Options | None = None
    keep_alive: float | str | None = None  # accepted: Tandem's models stay loaded for the gateway's life
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tandem: TandemOptions | None = None  # Tandem's own extension, as on the other front doors

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def response_format(self) -> dict | None:
        """`format` as the core's response_format: "json" any JSON object, a schema that schema."""
        if not self.format:
            return None
        if self.format == "json":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}

    @property
    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def not_applied(self) -> list[str]:
        # `think` cannot turn thinking on or off: an endpoint's model thinks or not by itself (what it thinks is
        # `thinking`, unless think is false).
        think = ["think"] if self.think not in (None, False) else []
        return self.unknown() + (self.options.not_applied() if self.options else []) + think


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)  # none: Ollama's way to load a model, answered at once
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None

    def not_applied(self) -> list[str]:
        calls = [c for m in self.messages for c in m.tool_calls or ()]
        return [
            *super().not_applied(),
            *_unknown_in(self.messages, "messages[]."),
            *_unknown_in(calls, "messages[].tool_calls[]."),
            *_unknown_in([c.function for c in calls], "messages[].tool_calls[].function."),
            *_unknown_in(self.tools, "tools[]."),
            *_unknown_in([t.function for t in self.tools or ()], "tools[].function."),
        ]


class GenerateRequest(_Generating):
    prompt: str = ""  # empty: Ollama's way to load a model, answered at once
    system: str | None = None
    raw: bool | None = None  # the prompt as it is: no chat template (then `system` does not apply)
    images: list[str] | None = None
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, value):
        if value:
            raise ValueError(TEXT_ONLY)
        return value

    @field_validator("template")
    @classmethod
    def _own_template(cls, value):
        if value:
            raise ValueError(
                "Tandem renders each model's own chat template; send the formatted prompt with raw: true instead"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _no_fill_in_the_middle(cls, value):
        if value:
            raise ValueError("fill-in-the-middle (a suffix) is not served")
        return value

    @field_validator("context")
    @classmethod
    def _no_token_memory(cls, value):
        if value:
            raise ValueError("Tandem keeps no token context between requests; send the conversation to /api/chat")
        return value

    @model_validator(mode="after")
    def _raw_is_plain_text(self):
        if self.raw and self.response_format is not None:
            raise ValueError("format needs the chat template: it cannot go with raw: true")
        return self

    def not_applied(self) -> list[str]:
        return super().not_applied() + (["system"] if self.raw and self.system else [])


class EmbedRequest(_Lenient):
    model: Annotated[str, Field(min_length=1)]
    input: str | Annotated[list[str], Field(min_length=1, max_length=2048)]
    truncate: bool | None = None  # the embedding model always truncates at its window: false is not applied
    options: Options | None = None
    keep_alive: float | str | None = None
    dimensions: None = None  # the model's own dimensions only

    @field_validator("input")
    @classmethod
    def _no_empty_text(cls, value):
        if any(text == "" for text in ([value] if isinstance(value, str) else value)):
            raise ValueError("input must not contain empty strings")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    def not_applied(self) -> list[str]:
        truncate = ["truncate"] if self.truncate is False else []
        return self.unknown() + truncate + (self.options.unknown("options.") if self.options else [])


class EmbeddingsRequest(_Lenient):
    """The older /api/embeddings: one text, one vector."""

    model: Annotated[str, Field(min_length=1)]
    prompt: Annotated[str, Field(min_length=1)]
    options: Options | None = None
    keep_alive: float | str | None = None

    def not_applied(self) -> list[str]:
        return self.unknown() + (self.options.unknown("options.") if self.options else [])


class ShowRequest(_Lenient):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""
