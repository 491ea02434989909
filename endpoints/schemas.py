"""Pydantic models of the OpenAI surface Tandem serves.

Requests forbid unknown fields: a parameter Tandem would silently ignore (tools,
echo, best_of, ...) is answered with a 400 that names it, because a client
that asked for it would otherwise get an answer that looks right and is not.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Integers are bounded where they enter: Python's are unbounded, and a max_tokens of 10**400 would only fail
# deep inside (float conversion in the estimators, ctypes in llama.cpp) as a server error.
_MAX_COUNT = 2**31 - 1
_INT64 = 2**63
MAX_CHOICES = 8  # n: each choice is an answer of its own on some endpoint
MAX_LOGIT_BIAS = 300


def _check_text(value) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start]
            raise ValueError(
                f"contains a lone UTF-16 surrogate ({bad!a}) at character {exc.start}, which is not valid Unicode text"
            ) from None
    elif isinstance(value, list | tuple):
        for item in value:
            _check_text(item)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer or upstream request can encode.
        _check_text(value)
        return value


class StreamOptions(_Request):
    include_usage: bool = False


class TandemOptions(_Request):
    """Tandem's own extension (send it with the SDK's `extra_body={"tandem": {...}}`)."""

    policy: str | None = Field(None, description="routing policy for this request, e.g. 'disco', 'device', 'cloud'")
    cloud: str | None = Field(None, description="which configured cloud endpoint DiSCo plays against the device")
    privacy: Literal["device", "split", "any"] | None = Field(
        None, description="where the request may go: the device only, the device or HAT, or anywhere"
    )
    decoding: Literal["outline", "auto", "sequential"] | None = Field(
        None, description="outline: expand an outline's points in parallel; auto: when the question suits it"
    )
    quality_threshold: Annotated[float, Field(ge=0, le=1, strict=True)] | None = Field(
        None,
        description="the quality policy's τ: the device's mean top-token probability below which its answer goes on "
        "on the cloud (0: never; 1: at once)",
    )


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # Mistral's and DeepSeek's prefix completion: this final assistant message is the start of the answer.
    prefix: bool | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.prefix and self.role != "assistant":
            raise ValueError("only an assistant message can be a prefix")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; an object with no properties when absent
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


def _stop_list(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class _Sampling(_Request):
    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # Token ids of the device model's vocabulary (checked against it when the request is prepared).
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = None
    tandem: TandemOptions | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or int(key) > _MAX_COUNT:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stop(cls, value):
        if any(s == "" for s in _stop_list(value)):
            raise ValueError("stop sequences must not be empty strings")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's and SGLang's way to continue the final assistant message (transformers' chat-template flags).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @model_validator(mode="after")
    def _continued_message_is_the_last(self):
        if any(m.prefix for m in self.messages[:-1]):
            raise ValueError('only the last message can be a prefix ("prefix": true)')
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.add_generation_prompt is False and not self.continue_final_message:
            raise ValueError("add_generation_prompt = false is only taken with continue_final_message = true")
        if self.continues_final:
            final = self.messages[-1]
            if final.role != "assistant" or final.tool_calls:
                raise ValueError("the message to continue must be a final assistant message with text, no tool_calls")
            if len(self.messages) < 2:
                raise ValueError("a continued assistant message needs the conversation before it")
        return self

    @property
    def continues_final(self) -> bool:
        """Whether the final (assistant) message is the start of the answer, to be continued."""
        return bool(self.continue_final_message or self.messages[-1].prefix)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_top(self) -> int | None:
        """None when logprobs are not asked, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0, le=_MAX_COUNT)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = 16  # the OpenAI default for this endpoint
    echo: Literal[False] | None = None
    suffix: None = None
    best_of: Literal[1] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs


class EmbeddingRequest(_Request):
    model: str
    # Text only: token-id arrays would be ids of some other tokenizer (OpenAI's), meaningless to this model.
    input: str | Annotated[list[str], Field(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _no_empty_text(cls, value):
        if any(text == "" for text in ([value] if isinstance(value, str) else value)):
            raise ValueError("input must not contain empty strings")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


# -- the Responses API (POST /v1/responses), translated onto chat by endpoints/responses.py -----------------------


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
    tandem: TandemOptions | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None):
        if value is not None:
            if len(value) > 16:
                raise ValueError(f"at most 16 key-value pairs are allowed, got {len(value)}")
            for key, item in value.items():
                if len(key) > 64 or len(item) > 512:
                    raise ValueError(f"key {key[:64]!r}: keys are at most 64 characters and values at most 512")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value: str | None):
        if value is not None:
            raise ValueError("Tandem is stateless and stores no responses; send the whole conversation as input")
        return value
