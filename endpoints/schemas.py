"""Pydantic models of the OpenAI surface Tandem serves.

Every field the pinned `openai` SDK's request types define is accepted (tests/integration/test_request_schema.py
walks them), as OpenAI accepts them. Each is honoured, forwarded to an upstream whose dialect takes it
(clients/dialects.py), or ignored visibly (the `x-tandem-ignored-fields` header and the trace say which and why):
`extras()` hands the core those it does not apply itself. A field whose ignoring would hand back something other
than what was asked (audio output, web search, moderation, echo, suffix, best_of > 1) is a 400 that says why. Fields
OpenAI does not define are a 400 naming them, as OpenAI answers, except llama.cpp's sampling extras (LlamaSampling:
top_k, min_p, typical_p, repeat_penalty, mirostat_*), which the device applies.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clients import dialects

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
    include_obfuscation: bool | None = None  # Tandem pads no chunks: false is what it does; true is ignored, visibly


def _metadata_limits(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512."""
    if value is not None:
        if len(value) > 16:
            raise ValueError(f"at most 16 key-value pairs are allowed, got {len(value)}")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError(f"key {key[:64]!r}: keys are at most 64 characters and values at most 512")
    return value


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]


class PromptCacheOptions(_Request):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    # The Responses API's own:
    comparison_response_id: str | None = None
    prewarm: bool | None = None


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
    migrate_after_tokens: Annotated[int, Field(ge=1, le=_MAX_COUNT)] | None = Field(
        None,
        description="move the answer to the other endpoint of its device-cloud pair after this many answer tokens, "
        "in place of any cost-driven migration (DiSCo's Appendix D: `tandem bench quality --appendix-d`)",
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
    # "function": the deprecated functions API's result turn (a tool turn answering the function_call before it).
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    function_call: FunctionCall | None = None  # an assistant turn of the functions API (mapped onto tool_calls)
    refusal: str | None = None  # an earlier answer's refusal sent back: history, not for the model
    # Mistral's and DeepSeek's prefix completion: this final assistant message is the start of the answer.
    prefix: bool | None = None
    # A reasoning model's earlier thinking, sent back with its answer (the AI SDK's openai-compatible provider, which
    # opencode uses, sends `reasoning_content`; OpenRouter's clients `reasoning`): history the model does not read
    # (reasoning upstreams refuse it there), so never passed on; reported ignored (ChatCompletionRequest.extras).
    reasoning_content: str | None = Field(None, exclude=True)
    reasoning: str | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.prefix and self.role != "assistant":
            raise ValueError("only an assistant message can be a prefix")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.function_call is not None and (self.role != "assistant" or self.tool_calls is not None):
            raise ValueError("only an assistant message without tool_calls carries a function_call")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the name of the function it answers")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("only an assistant message carries its reasoning")
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


class Prediction(_Request):
    """A predicted output (OpenAI's latency optimisation: what is returned is the same without it)."""

    type: Literal["content"]
    content: str | list[TextPart]


def _stop_list(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


MirostatMode = Literal[0, 1, 2]


class LlamaSampling(_Request):
    """llama.cpp's sampling extras (llama-server's and llama-cpp-python's names), with their bounds, for every front
    door that takes them (the OpenAI surface; Ollama's `options`): applied on the device, forwarded to upstreams whose
    dialect takes them (clients/dialects.py). top_k is the core's own field; the others go as the request's extras."""

    top_k: Annotated[int, Field(ge=0, le=_MAX_COUNT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    mirostat_mode: MirostatMode | None = None
    mirostat_tau: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    mirostat_eta: Annotated[float, Field(gt=0.0, le=1.0)] | None = None

    SAMPLING_EXTRAS: ClassVar[tuple[str, ...]] = tuple(name for name in dialects.SAMPLING_EXTRAS if name != "top_k")

    def sampling_extras(self) -> dict[str, object]:
        """The sampling extras the request sets, by the core's names."""
        return {name: getattr(self, name) for name in self.SAMPLING_EXTRAS if getattr(self, name) is not None}


class _Sampling(LlamaSampling):
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

    # The fields beyond the core (clients/dialects.py's PLATFORM_FIELDS and SAMPLING_EXTRAS, less top_k, which the
    # core takes itself) this request type defines.
    _EXTRAS: ClassVar[tuple[str, ...]] = ("user", *LlamaSampling.SAMPLING_EXTRAS)

    def extras(self) -> dict[str, object]:
        """The fields beyond the core that the request sets, as plain JSON values: each endpoint applies or forwards
        those its dialect takes, and the others are reported as ignored."""
        out = {}
        for name in self._EXTRAS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            out["stream_options.include_obfuscation"] = True
        return out

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
    def functions_api(self) -> bool:
        """Whether the request used the deprecated functions API (its answer's call is then a `function_call`)."""
        return False

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
    # OpenAI's platform fields: forwarded where the serving endpoint's dialect takes them, else ignored visibly.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: Annotated[str, Field(max_length=128)] | None = None
    prediction: Prediction | None = None
    # Text is what every endpoint writes: the rest would hand back something other than what was asked.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None
    # Deprecated, mapped onto tools and tool_choice (`functions_api`: the answer then speaks of function_call).
    functions: Annotated[list[FunctionDefinition], Field(min_length=1, max_length=128)] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None

    _EXTRAS: ClassVar[tuple[str, ...]] = (
        *_Sampling._EXTRAS,
        *(name for name in dialects.PLATFORM_FIELDS if name not in _Sampling._EXTRAS),
    )

    _metadata = field_validator("metadata")(_metadata_limits)

    def extras(self) -> dict[str, object]:
        out = super().extras()
        for name in ("reasoning_content", "reasoning"):  # earlier reasoning in the history: dropped, reported
            if count := sum(getattr(m, name) is not None for m in self.messages):
                out[f"messages.{name}"] = count
        return out

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value):
        if value and "audio" in value:
            raise ValueError("audio output is not available: Tandem's models write text only; ask for ['text']")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value):
        if value is not None:
            raise ValueError("audio output is not available: Tandem's models write text only")
        return value

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, value):
        if value is not None:
            raise ValueError(
                "web search is not available: no endpoint searches the web, and an answer without the search "
                "would not be what was asked"
            )
        return value

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, value):
        if value is not None:
            raise ValueError(
                "moderation is not available: Tandem runs no moderation model, and an unmoderated answer would not "
                "be what was asked"
            )
        return value

    @field_validator("functions")
    @classmethod
    def _functions_or_tools(cls, value, info):
        if value is not None and (info.data.get("tools") is not None or info.data.get("tool_choice") is not None):
            raise ValueError("send tools and tool_choice, or the deprecated functions and function_call, not both")
        return value

    @field_validator("function_call")
    @classmethod
    def _an_offered_function(cls, value, info):
        functions = info.data.get("functions")
        if value is not None and functions is None:
            raise ValueError("function_call needs functions")
        if isinstance(value, NamedFunction) and value.name not in {f.name for f in functions}:
            raise ValueError(f"names {value.name!r}, which is not among functions")
        return value

    @model_validator(mode="after")
    def _function_turns_as_tool_turns(self):
        """The functions API's history as the tools API's: an assistant function_call as a one-call tool_calls, a
        function message as the tool message answering it."""
        if not any(m.function_call is not None or m.role == "function" for m in self.messages):
            return self
        turns, last_call = [], None
        for index, m in enumerate(self.messages):
            if m.function_call is not None:
                last_call = f"call_function_{index}"
                m = m.model_copy(
                    update={"function_call": None, "tool_calls": [ToolCall(id=last_call, function=m.function_call)]}
                )
            elif m.role == "function":
                if last_call is None:
                    raise ValueError(f"messages[{index}]: a function message must follow an assistant function_call")
                m = m.model_copy(update={"role": "tool", "name": None, "tool_call_id": last_call})
            turns.append(m)
        self.messages = turns
        return self

    @model_validator(mode="after")
    def _functions_as_tools(self):
        """The deprecated `functions` / `function_call` as the tools and tool_choice they stand for."""
        if self.functions is None:
            return self
        self.tools = [Tool(type="function", function=f) for f in self.functions]
        choice = self.function_call
        if isinstance(choice, NamedFunction):
            self.tool_choice = NamedToolChoice(type="function", function=choice)
        else:
            self.tool_choice = choice
        if self.parallel_tool_calls is None:
            self.parallel_tool_calls = False  # the functions API answers with one call
        return self

    @property
    def functions_api(self) -> bool:
        return self.functions is not None

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
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=0, le=MAX_CHOICES)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not available: the answer carries the completion only")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not available: the models here complete text forwards only (no insertion)")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_of_one(cls, value):
        if value is not None and value > 1:
            raise ValueError("best_of > 1 is not available: each choice is one answer; ask for n choices instead")
        return value

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
