"""One request as the orchestrator carries it: the validated job and each endpoint's attempt at it. Read by
the orchestrator, the endpoints (ids, usage) and the traces."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from app.serving.ledger import Tally
from app.serving.seam import Seam
from clients.base import GenerationRequest, TokenEvent, Usage
from policies.dispatch import DispatchPlan, PolicyDeclaration, declaration


@dataclass
class Attempt:
    """One endpoint's part in a request."""

    role: str  # "device" | "cloud"
    name: str
    started: float
    context_tokens: int  # its context: prompt (+ delivered prefix for a migration target)
    migration: bool = False
    from_token: int = 0  # the index in the answer of the first token it would produce (a migration target's prefix)
    cached_tokens: int = 0  # of those, taken from its own KV cache (the device says so on its first event)
    stream: AsyncIterator[TokenEvent] | None = None
    first_at: float | None = None
    ended_at: float | None = None  # when it finished, failed, lost, was migrated from or cancelled
    decode_tokens: int = 0  # answer tokens it produced (reasoning not included)
    reasoning_tokens: int = 0  # reasoning pieces it streamed (clients/base.py: TokenEvent.reasoning)
    usage: Usage | None = None  # its own usage report, when it sent one (an upstream's last event)
    outcome: str = "running"  # won | lost | failed | migrated-from | finished | cancelled
    error: str | None = None
    dialect: str | None = None  # how it continued the answer (clients/dialects.py); None for a fresh start
    seam: Seam | None = None  # where a continuation from text joins the answer
    # The request's fields beyond the core that it did not apply (clients/dialects.py), and why.
    ignored: dict[str, str] = field(default_factory=dict)
    # The backend is at the end of its answer too (it said so, or it hit the same token limit):
    # reading its last events lets an HTTP upstream's connection go back to the pool.
    ended: bool = False
    booked: Tally = field(default_factory=Tally)  # what the ledger booked for it so far (booked as it goes)

    def billed(self) -> tuple[int, int, int, int]:
        """(prompt, cached, completion, reasoning) tokens its work is booked for, cached and reasoning being parts
        of the two before them. A cloud that reported its usage is booked at its own counts: what its provider
        bills, the prefix a continuation re-sent included (as cached where it says so). Otherwise ours: the context
        it was sent (less what the device took from its own KV cache: no energy spent there) and what it streamed."""
        usage = self.usage
        if usage is not None and self.role == "cloud":
            reasoning = usage.reasoning_tokens or min(self.reasoning_tokens, usage.completion_tokens)
            return usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, reasoning
        decoded = self.decode_tokens + self.reasoning_tokens
        return self.context_tokens - self.cached_tokens, 0, decoded, self.reasoning_tokens


@dataclass
class Job:
    """A validated request, rendered and tokenised, ready to route."""

    id: str
    gen: GenerationRequest
    prompt_tokens: int
    policy: str
    pinned: str | None = None  # a backend name when the request's model names one
    cloud: str | None = None  # the cloud endpoint DiSCo plays against the device for this request
    call_grammar: str | None = None  # app/serving/structured.py: Structure.call_grammar
    call_gbnf: str | None = None  # the same in GBNF
    privacy: str = "any"  # where it may go (policies/privacy.py)
    migrate_after_tokens: int | None = None  # move to the pair's other endpoint after this many tokens (forced)
    quality_threshold: float | None = None  # the request's own τ for the quality policy (None: the gateway's)
    streamed: bool = True  # the client reads the answer as it is written (False: a quality escalation starts it over)
    # The conversation's tool calls that a tool result answers, in order, as policies/quality.py's call_key: the quality
    # policy keeps the device from writing one again.
    answered_calls: tuple[tuple[str, str], ...] = ()
    # The trailing whitespace of the client's prefill (gen.prefill goes without it): dropped from the answer's start
    # where the answer writes it again (app/serving/seam.py).
    prefill_held: str = ""
    # Outline decoding (app/serving/outline.py): what the request needs of it when its gate said yes, and what the
    # trace says about it (mode, the gate's reason, the sub-requests).
    outline: Any = None
    decoding: dict | None = None
    started: float = field(default_factory=time.monotonic)
    # Filled in while the answer streams:
    backend: str | None = None
    plan: DispatchPlan | None = None
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop sequence that ended the answer (finish_reason "stop"), if one did
    ttft: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    migrations: list[dict] = field(default_factory=list)
    delayed_tokens: int = 0
    # Its max_tokens cut to what the window of the endpoint writing the answer leaves after the prompt: {"asked",
    # "given", "endpoint"} (the last cut, a migration onto a smaller window included); None when nothing was cut.
    max_tokens_clamped: dict | None = None
    limit_asked: bool = True  # its client named a limit (a clamp is told); False: the gateway's default, cut silently
    cost: float = 0.0  # what its attempts cost: booked so far while it runs, the whole once it ended
    booked_at: float = field(
        default_factory=time.monotonic
    )  # when its work was last booked (app/serving/accounting.py)
    # (the device's evaluation count, its cached prefix then): Eq. 5 asks after every token, and the answer
    # only changes when the device has run something since.
    cache_probe: tuple[int, int] | None = None
    error: str | None = None
    # Its API key's hold (app/serving/limits.py's Admission, shared by its choices) and `x-ratelimit-*` headers.
    admission: Any = None
    limit_headers: dict[str, str] = field(default_factory=dict)

    def ignored_fields(self) -> dict[str, str]:
        """The request's fields beyond the core that an endpoint which delivered part of the answer did not apply,
        and why (the first such endpoint's reason)."""
        ignored: dict[str, str] = {}
        for attempt in self.attempts:
            if attempt.first_at is not None:
                for name, why in attempt.ignored.items():
                    ignored.setdefault(name, why)
        return ignored

    @property
    def declared(self) -> PolicyDeclaration:
        """Its routing policy's declaration (policies/dispatch.py)."""
        return declaration(self.policy)

    def choice(self, index: int) -> Job:
        """Choice `index` of a request with n > 1: a job of its own (id `<id>-<index>`, its own trace), routed
        like the request. With a seed, choice i samples with seed + i, so the choices differ and choice 0 is the
        answer n=1 would give."""
        gen = self.gen
        if gen.seed is not None and index:
            gen = replace(gen, seed=(gen.seed + index + 2**63) % 2**64 - 2**63)
        return Job(
            id=f"{self.id}-{index}",
            gen=gen,
            prompt_tokens=self.prompt_tokens,
            policy=self.policy,
            pinned=self.pinned,
            cloud=self.cloud,
            call_grammar=self.call_grammar,
            call_gbnf=self.call_gbnf,
            privacy=self.privacy,
            migrate_after_tokens=self.migrate_after_tokens,
            quality_threshold=self.quality_threshold,
            streamed=self.streamed,
            answered_calls=self.answered_calls,
            admission=self.admission,
            limit_headers=self.limit_headers,
            prefill_held=self.prefill_held,
            max_tokens_clamped=self.max_tokens_clamped,
            limit_asked=self.limit_asked,
        )
