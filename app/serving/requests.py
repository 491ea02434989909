"""What a request asks of the serving core, in plain values.

endpoints/ turns each HTTP body into one of these (endpoints/serving.py); the core prepares a Job from it and never
sees a pydantic model. Optional fields left None take the gateway's defaults. Messages, tools, tool_choice and
response_format keep the OpenAI wire shapes (plain dicts), because a chat upstream is sent them as they are; the
Anthropic Messages API's bodies are translated into the same shapes (endpoints/anthropic.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from app.serving.limits import KeyLimits


@dataclass(frozen=True, kw_only=True)
class RequestInput:
    model: str
    key_privacy: str | None = None  # the privacy level of the API key it came with (policies/privacy.py)
    key_limits: KeyLimits | None = None  # that key's caps and rate limits (app/serving/limits.py)
    # Tandem's own options (the `tandem` extension):
    policy: str | None = None
    cloud: str | None = None
    privacy: str | None = None
    decoding: str | None = None
    migrate_after_tokens: int | None = None  # a forced migration after this many answer tokens
    quality_threshold: float | None = None  # the quality policy's τ for this request (policies/quality.py)
    # Whether the client reads the answer as it is written (False: it gets it whole, so an escalation may start the
    # answer over on the cloud rather than continue the device's: app/serving/orchestrator.py).
    streamed: bool = True
    # Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # sample from the k likeliest tokens only (None or 0: no such cut)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None when not asked, else how many alternatives per token
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (device token id, bias)
    choices: int = 1
    # Fields beyond the core, as sent (clients/dialects.py's PLATFORM_FIELDS and SAMPLING_EXTRAS): each endpoint
    # applies or forwards those its dialect takes; the others are reported as ignored.
    extras: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ChatInput(RequestInput):
    messages: tuple[dict, ...]  # as sent, a developer message as a system one
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    # The last message is the assistant's answer begun (a prefill: `prefix: true`, `continue_final_message`, the
    # Messages API's trailing assistant message): the answer continues its text, the deltas carry only what follows.
    continue_final: bool = False
    id_prefix: str = "chatcmpl-"  # names the request's kind in its id (`resp_` for the Responses API)


@dataclass(frozen=True, kw_only=True)
class CompletionInput(RequestInput):
    prompt: str | tuple[int, ...]  # text, or token ids of the device model's vocabulary
