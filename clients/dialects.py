"""Dialects: how Tandem speaks to each kind of endpoint, one declared object per kind, looked up by name.

A `Dialect` says, for one kind of endpoint: its name, how it continues an answer that has already begun (its
`Continuation`), which request fields beyond the core it takes (and under which name), and how it reports usage. The
core reads these attributes and never compares names: the orchestrator asks `backend.dialect.continuation` where a
continuation's seam lies, the OpenAI-compatible backend asks the dialect for a continuation's body and for the
fields it forwards, and a field no endpoint of the answer took is reported as ignored (the `x-tandem-ignored-fields`
header and the trace).

Continuations, each sent exactly as its server documents it:

- "prefill": the answer so far as a final assistant message, which the server continues (llama.cpp's llama-server by
  default since 2025, Anthropic's API, OpenRouter, Ollama). Such a server may send that text back first.
- "prefix-flag": the same message with `"prefix": true` on it (Mistral; DeepSeek on its beta base URL).
- "continue-final-message": the same message, and `continue_final_message: true` with `add_generation_prompt:
  false` at the top level (vLLM, SGLang, Aphrodite: transformers' chat templates).
- "completions": raw `/v1/completions` with the chat template applied here (clients/continuation.py).
- "chat": none; such an upstream only starts answers.
- "tokens": a backend on the device's side of the wire (llama.cpp, torch, HAT's device half) evaluates the
  delivered tokens itself.

The providers' dialects (`PROVIDERS`) are what each provider documents; `[clouds.x] provider` names one
(app/providers.py adds its base URL), and a cloud's own `continuation` / `stream_usage` override its parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType


def _frozen(mapping: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Continuation:
    """How an endpoint goes on with an answer from a delivered prefix."""

    name: str
    continues: bool = True  # False: fresh answers only
    final_message: Mapping = field(default_factory=_frozen)  # fields on the final assistant message (a chat dialect)
    fields: Mapping = field(default_factory=_frozen)  # top-level fields that ask for the continuation
    chat: bool = False  # the answer so far goes as a final assistant message
    raw_prompt: bool = False  # raw /v1/completions with a chat template applied by the gateway
    evaluates_tokens: bool = False  # on the device's side of the wire: it evaluates the delivered tokens itself
    echoes_prefill: bool = False  # the server may send the final assistant message back before continuing it

    @property
    def moves_whitespace(self) -> bool:
        """Whether a text continuation moves trailing whitespace out of its prefix (app/serving/seam.py) even within
        the device's vocabulary: every chat dialect does (templates cut it, Anthropic refuses it)."""
        return not (self.evaluates_tokens or self.raw_prompt)

    def chat_request(self, messages: Sequence[dict], head: str) -> tuple[list[dict], dict]:
        """The messages, and the body's top-level fields, that ask such a server to continue an answer beginning with
        `head`."""
        if not self.chat:
            raise ValueError(f"{self.name!r} is not a chat continuation dialect")
        return [*messages, {"role": "assistant", "content": head, **self.final_message}], dict(self.fields)


CONTINUATIONS: Mapping[str, Continuation] = _frozen(
    {
        c.name: c
        for c in (
            Continuation("tokens", evaluates_tokens=True),
            Continuation("chat", continues=False),
            Continuation("prefill", chat=True, echoes_prefill=True),
            Continuation("prefix-flag", chat=True, final_message=_frozen({"prefix": True})),
            Continuation(
                "continue-final-message",
                chat=True,
                fields=_frozen({"continue_final_message": True, "add_generation_prompt": False}),
            ),
            Continuation("completions", raw_prompt=True),
        )
    }
)
# The ones an upstream may be configured with (`[clouds.x] continuation`).
UPSTREAM_CONTINUATIONS = tuple(name for name, c in CONTINUATIONS.items() if not c.evaluates_tokens)

# Request fields beyond the core that a client may send and an endpoint may take (docs/api.md lists each):
# OpenAI's platform fields, which change how a provider serves or keeps the request, not what it answers...
PLATFORM_FIELDS = (
    "reasoning_effort",
    "verbosity",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "user",
    "metadata",
    "store",
    "prediction",
)
# ... and llama.cpp's sampling extras, which the device applies and some upstreams take.
SAMPLING_EXTRAS = ("top_k", "min_p", "typical_p", "repeat_penalty", "mirostat_mode", "mirostat_tau", "mirostat_eta")
LLAMA_SAMPLING = _frozen({name: name for name in SAMPLING_EXTRAS})
# Prompt-caching hints (the Anthropic door's `cache_control`, one hint for the request): an endpoint that keeps the
# longest prefix it evaluated by itself (the device) needs none; an upstream takes them where its dialect says.
CACHE_HINTS = ("cache_control",)
# Fields Tandem honours itself, whichever endpoint serves: the request's trace records them (who asked, and the
# client's tags for it); forwarded besides to an upstream that takes them.
RECORDED_FIELDS = ("user", "metadata")


@dataclass(frozen=True)
class Dialect:
    """How Tandem speaks to one kind of endpoint."""

    name: str
    continuation: Continuation
    # Request fields beyond the core it takes, each under its own name for it (e.g. vLLM's `repetition_penalty`).
    forwards: Mapping[str, str] = field(default_factory=_frozen)
    # It reports usage in a stream only when asked with `stream_options` (False: it refuses the field and sends
    # usage unasked).
    stream_usage: bool = True
    # It reuses the longest prefix it evaluated before by itself: a prompt-caching hint is honoured without being sent.
    reuses_prefix: bool = False

    def takes(self, name: str) -> bool:
        return name in self.forwards

    def forwarded(self, fields: Mapping[str, object]) -> dict:
        """The body fields for the request's `fields` that this endpoint takes, named as it names them."""
        return {self.forwards[name]: value for name, value in fields.items() if name in self.forwards}

    def ignored(self, fields: Mapping[str, object], endpoint: str) -> dict[str, str]:
        """The request's `fields` that this endpoint (`endpoint`, speaking this dialect) does not apply, and why. The
        ones Tandem keeps itself (the trace records them) are never ignored."""
        return {
            name: f"{endpoint} ({self.name}) does not take it"
            for name in fields
            if name not in self.forwards
            and name not in RECORDED_FIELDS
            and not (self.reuses_prefix and name in CACHE_HINTS)
        }

    def with_settings(self, continuation: str | None = None, stream_usage: bool | None = None) -> Dialect:
        """This dialect with a cloud's own continuation or streamed-usage setting over the provider's."""
        changes: dict = {}
        if continuation is not None:
            changes["continuation"] = CONTINUATIONS[continuation]
        if stream_usage is not None:
            changes["stream_usage"] = stream_usage
        return replace(self, **changes)


# The device's llama.cpp applies its sampling extras; the torch backends and HAT's device half sample with
# clients/sampling.py, which cuts to the top k and by min_p.
LLAMA_CPP = Dialect("llama.cpp", CONTINUATIONS["tokens"], forwards=LLAMA_SAMPLING, reuses_prefix=True)
TORCH = Dialect("torch", CONTINUATIONS["tokens"], forwards=_frozen({"top_k": "top_k", "min_p": "min_p"}))

_VLLM_SAMPLING = {"top_k": "top_k", "min_p": "min_p", "repeat_penalty": "repetition_penalty"}

PROVIDERS: Mapping[str, Dialect] = _frozen(
    {
        d.name: d
        for d in (
            # An upstream of no named provider: llama.cpp's sampling extras go when the client sent them (the servers
            # such a gateway is pointed at take them or ignore them); OpenAI's platform fields stay here.
            Dialect("openai-compatible", CONTINUATIONS["chat"], forwards=LLAMA_SAMPLING),
            # A trailing assistant message is history to OpenAI, never a prefix: fresh answers only. It takes every
            # platform field and refuses fields it does not define (top_k, ...).
            Dialect("openai", CONTINUATIONS["chat"], forwards=_frozen({f: f for f in PLATFORM_FIELDS})),
            # Claude continues a final assistant turn; its compatibility layer ignores the platform fields.
            Dialect("anthropic-openai", CONTINUATIONS["prefill"]),
            Dialect("deepseek", CONTINUATIONS["prefix-flag"]),
            # Its API refuses fields it does not know (stream_options too) and sends usage unasked.
            Dialect("mistral", CONTINUATIONS["prefix-flag"], stream_usage=False),
            Dialect(
                "vllm",
                CONTINUATIONS["continue-final-message"],
                forwards=_frozen({**_VLLM_SAMPLING, "reasoning_effort": "reasoning_effort", "user": "user"}),
            ),
            # llama.cpp's own server names mirostat's mode `mirostat`.
            Dialect(
                "llama-server",
                CONTINUATIONS["prefill"],
                forwards=_frozen({**LLAMA_SAMPLING, "mirostat_mode": "mirostat"}),
            ),
            # A top-level `cache_control` asks it for Anthropic's automatic caching (a breakpoint on the last cacheable
            # block); Anthropic's own OpenAI compatibility layer takes no caching hint.
            Dialect(
                "openrouter",
                CONTINUATIONS["prefill"],
                forwards=_frozen({**_VLLM_SAMPLING, "user": "user", "cache_control": "cache_control"}),
            ),
            Dialect("ollama", CONTINUATIONS["prefill"], forwards=_frozen({"reasoning_effort": "reasoning_effort"})),
        )
    }
)
GENERIC = PROVIDERS["openai-compatible"]


def upstream_dialect(
    provider: str | None, continuation: str | None = None, stream_usage: bool | None = None
) -> Dialect:
    """A cloud's dialect: its provider's (an unnamed one's: GENERIC), with the cloud's own settings over it."""
    return PROVIDERS[provider or GENERIC.name].with_settings(continuation, stream_usage)
