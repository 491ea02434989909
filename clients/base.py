"""The one interface every source of tokens implements.

A backend turns a `GenerationRequest` into an async stream of `TokenEvent`s.
Every backend can continue from a prefix (prompt + tokens already delivered to
the client), which is what failover and migration build on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from clients.dialects import Dialect
from policies.quality import TokenConfidence


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate. The prompt is already rendered (chat template applied).

    `prompt_ids` is set when the gateway tokenised the prompt with a tokenizer
    the backend shares; a backend with another vocabulary uses `prompt_text`.
    `prefix_ids` / `prefix_text` are the tokens already delivered to the client
    (empty for a fresh answer): the backend must continue right after them and
    must not emit them again.
    """

    prompt_text: str
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    prefix_text: str = ""
    prefix_ids: tuple[int, ...] | None = None
    # The start of the answer the client wrote itself (a final assistant message it asked to have continued), its
    # trailing whitespace moved out (app/serving/seam.py). `prompt_text` / `prompt_ids` already end with it; a chat
    # upstream gets it as the start of the final assistant message, and `messages` go without that message.
    prefill: str = ""
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # sample from the k likeliest tokens only; 0: no such cut
    # Fields beyond the core, as the client sent them (clients/dialects.py: OpenAI's platform fields, llama.cpp's
    # sampling extras; top_k among them when asked): an endpoint applies or forwards those its dialect takes.
    extras: Mapping[str, object] = field(default_factory=dict)
    # The conversation's prompt-cache key the gateway derived where the client sent none (app/serving/cache_key.py):
    # forwarded as `prompt_cache_key` where the dialect takes that field, never reported as ignored.
    cache_key: str | None = None
    stop: tuple[str, ...] = ()  # enforced by the gateway's relay, not by backends (why: clients/token_emitter.py)
    seed: int | None = None
    # Tools and structured output (app/serving/structured.py). The tools are in `prompt_text` already; a chat
    # upstream gets them, `tool_choice` and `response_format` as the client sent them.
    grammar: str | None = None  # an llguidance grammar the answer must follow (clients/grammar.py)
    grammar_covers_prefix: bool = True  # the delivered prefix is part of what the grammar reads (else it follows it)
    # tool_choice auto: free text, but a tool call once started is whole and valid (a lazy call grammar). Optional:
    # a backend that applies grammars follows it (over the delivered prefix too) when `grammar` is None; one that
    # cannot, or whose vocabulary it does not fit, answers without it.
    tool_grammar: str | None = None
    gbnf: str | None = None  # the same constraint in llama.cpp's GBNF, for an upstream that takes one (clients/gbnf.py)
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    # Observability and sampling fields (docs/api.md). `logprobs` is None when not
    # asked, else how many top alternatives each token carries (0..20). Penalties are OpenAI's, counted over the
    # answer's tokens (the delivered prefix included); `logit_bias` is (device token id, bias) pairs.
    logprobs: int | None = None
    # The quality policy reads the device's confidence in each token (policies/quality.py): a backend that has the
    # raw logits says it on each event (`TokenEvent.confidence`); one that has not sends none.
    confidence: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The request this generation serves (its id, the client's x-request-id): a backend's own events name it (a HAT
    # session's, so its span events land on the request's trace). Never sent upstream.
    request_id: str = ""

    @property
    def forwardable(self) -> Mapping[str, object]:
        """The fields beyond the core an upstream may take: the client's, and the derived prompt-cache key where the
        client sent no key of its own (the client's wins)."""
        if self.cache_key is None or "prompt_cache_key" in self.extras:
            return self.extras
        return {**self.extras, "prompt_cache_key": self.cache_key}

    @property
    def min_p(self) -> float:
        """llama.cpp's min_p when the request sent it (among its extras), else 0: no such cut."""
        return float(self.extras.get("min_p", 0.0))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties or logit_bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    exact: bool = True  # False when counted with an estimating tokenizer
    # Parts of the two counts that providers bill at prices of their own (OpenAI's `prompt_tokens_details` and
    # `completion_tokens_details`): prompt tokens read from the provider's prompt cache, and reasoning tokens.
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability and its most likely alternatives (OpenAI's logprobs), as the endpoint that
    produced the token computed them: the log-softmax of the model's raw logits at the position the token was
    sampled from (before logit_bias, penalties, temperature and top_p).

    `token` is the token's text; a local backend leaves it None and the relay fills in the text of the event
    that carried the token (so a chunk's text is exactly its tokens' texts joined). `top` holds
    (text, logprob, bytes) of the alternatives, most likely first. `logprob` is None only for text an endpoint
    sent without logprobs although they were asked for."""

    logprob: float | None
    bytes: bytes | None = None
    top: tuple[tuple[str, float, bytes], ...] = ()
    token: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (or a text piece when the backend does not expose ids).

    The last event of a stream has `finish_reason` set ("stop" or "length") and
    may carry empty text.
    """

    text: str
    token_id: int | None = None
    t: float = field(default_factory=time.monotonic)
    finish_reason: str | None = None
    usage: Usage | None = None  # only on the last event, when the backend knows it (e.g. upstream usage)
    # Only on the first event, when the backend knows it: how many leading context tokens it took from its
    # own KV cache instead of prefilling them (llama.cpp reuses the longest prefix of its last sequence).
    cached_tokens: int | None = None
    # Only when the request asked for logprobs: one entry per token this event carries (an upstream's text
    # piece may carry several).
    logprobs: tuple[TokenLogprob, ...] | None = None
    # Only when the request asked for it (GenerationRequest.confidence): how sure the model was of this token.
    confidence: TokenConfidence | None = None
    # A reasoning model's thinking (an upstream's `reasoning_content` delta): passed to the client as it came,
    # counted, never part of the answer's text (stops, the token limit and a continuation's prefix ignore it).
    reasoning: str = ""


class BackendError(Exception):
    """A backend failed. `status` is the HTTP status the gateway should answer with
    when no token has been delivered yet (502 bad upstream answer, 503 unreachable,
    504 timed out)."""

    def __init__(self, message: str, status: int = 502, backend: str | None = None):
        super().__init__(message)
        self.status = status
        self.backend = backend


@dataclass(frozen=True)
class Concurrency:
    """How a backend serves several generations at once (outline decoding places its points by it).

    lanes: how many it runs side by side, each at the speed of one alone — a staged HAT worker's pipeline depth P
    (Jupiter: P micro-batches in flight); 1: one after another, as one llama.cpp model decodes.
    limit: the most it takes at once (a HAT worker's sessions; 1 for a model whose generations queue on its thread,
    so a queued one is not started — and timed by the relay's stall check — before its turn); None: no limit known
    (all are started)."""

    lanes: int = 1
    limit: int | None = None


@runtime_checkable
class Backend(Protocol):
    name: str
    model_id: str  # the model this backend serves, as reported by /v1/models
    # What the orchestrator plans with:
    can_continue: bool  # continues an answer from a delivered prefix (GenerationRequest.prefix_*)
    # How it continues one, which request fields beyond the core it takes, how it reports usage (clients/dialects.py)
    dialect: Dialect
    device_vocabulary: bool  # its model has the device model's tokenizer (a text prefix re-tokenises as it was)
    accepts_token_ids: bool  # takes prompts as token ids of the device model's vocabulary
    evaluations: int  # generations started so far: its KV cache can only have changed when this moved
    # How it follows GenerationRequest.grammar: "grammar" applies it token by token, also from a delivered prefix;
    # "native" passes tools / response_format to an upstream that enforces them (fresh answers only); "gbnf" sends
    # GenerationRequest.gbnf to an upstream that applies it (advanced over a delivered prefix too); "none" cannot.
    structured_output: str
    # What leaves the device when it serves (policies/privacy.py): "device" nothing, "split" hidden states (HAT),
    # "cloud" the prompt's text.
    locality: str
    # The most tokens it holds at once, prompt and answer together (the device's n_ctx, a cloud's configured or
    # reported window, a split model's context): the planner sends it no prompt (with the answer delivered so far) it
    # cannot hold with one token more, and clamps an answer's max_tokens to what the window leaves.
    context_window: int

    def cached_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` it would take from its own KV cache instead of prefilling them."""

    async def start(self) -> None:
        """Load or connect; may take long. Called once by the gateway's lifespan."""

    async def close(self) -> None: ...

    async def ready(self) -> bool:
        """True when the backend can serve now (model loaded / upstream reachable)."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Generate. Closing the iterator (aclose or task cancellation) must stop the
        backend's work promptly: llama.cpp within one token, upstream HTTP closed."""

    def count_tokens(self, text: str) -> tuple[int, bool]:
        """Token count of `text` and whether it is exact for this backend's model."""

    def concurrency(self) -> Concurrency:
        """How many generations it runs side by side, and the most it takes at once (as far as it knows now)."""


class NoPrefixCache:
    """For a backend that keeps no KV cache from one request to the next (or cannot say what it keeps)."""

    evaluations = 0

    def cached_prefix(self, ids: Sequence[int]) -> int:
        return 0
