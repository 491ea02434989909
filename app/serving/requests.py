"""What a request asks of the serving core, in plain values.

endpoints/ turns each HTTP body into one of these (endpoints/serving.py); the core prepares a Job from it and never
sees a pydantic model. Optional fields left None take the gateway's defaults. Messages, tools, tool_choice and
response_format keep the OpenAI wire shapes (plain dicts), because a chat upstream is sent them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RequestInput:
    model: str
    key_privacy: str | None = None  # the privacy level of the API key it came with (policies/privacy.py)
    # Tandem's own options (the `tandem` extension):
    policy: str | None = None
    cloud: str | None = None
    privacy: str | None = None
    decoding: str | None = None
    # Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None when not asked, else how many alternatives per token
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (device token id, bias)
    choices: int = 1


@dataclass(frozen=True, kw_only=True)
class ChatInput(RequestInput):
    messages: tuple[dict, ...]  # as sent, a developer message as a system one
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    continue_final: bool = False  # the last message (an assistant one) is the answer's start, to be continued
    id_prefix: str = "chatcmpl-"  # names the request's kind in its id (`resp_` for the Responses API)


@dataclass(frozen=True, kw_only=True)
class CompletionInput(RequestInput):
    prompt: str | tuple[int, ...]  # text, or token ids of the device model's vocabulary
