"""One request's life: choose endpoints → open the stream (failing over before the first
token) → relay tokens, applying stop sequences and the token limit → account.

Stop sequences and the token limit are enforced here, not trusted to each
backend, so every endpoint (and, later, an answer that moves between endpoints)
ends the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from app.metrics import Metrics
from clients.base import Backend, BackendError, GenerationRequest, TokenEvent, Usage

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A validated request, rendered and tokenised, ready to route."""

    id: str
    gen: GenerationRequest
    prompt_tokens: int
    policy: str
    pinned: str | None = None  # a backend name when the request's model names one
    started: float = field(default_factory=time.monotonic)
    # Filled in while the answer streams:
    backend: str | None = None
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    ttft: float | None = None


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None


class StopMatcher:
    """Finds stop sequences across token boundaries. Text that might be the start of a stop
    sequence is held back until the next token decides it, so a stop sequence is never
    shown to the client, not even partly."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Orchestrator:
    def __init__(self, backends: dict[str, Backend], device: str, cloud: str | None, fallback: bool, metrics: Metrics):
        self.backends = backends
        self.device = device
        self.cloud = cloud
        self.fallback = fallback
        self.metrics = metrics

    def candidates(self, job: Job) -> list[str]:
        """Endpoints to try, in order, until one produces a first token."""
        if job.pinned is not None:
            return [job.pinned]
        first = self.cloud if job.policy == "cloud" and self.cloud else self.device
        order = [first]
        other = self.device if first == self.cloud else self.cloud
        if self.fallback and other is not None:
            order.append(other)
        return order

    async def _open(self, job: Job) -> tuple[str, AsyncIterator[TokenEvent], TokenEvent]:
        names = self.candidates(job)
        last: BackendError | None = None
        for name in names:
            stream = self.backends[name].stream(job.gen)
            try:
                first = await anext(stream)
            except BackendError as exc:
                await stream.aclose()
                self.metrics.errors.labels(backend=name, kind=f"http_{exc.status}").inc()
                log.warning("request %s: %s failed before its first token: %s", job.id, name, exc)
                last = exc
                if exc.status == 400:  # the request itself is wrong; another endpoint will not help
                    raise
                continue
            except StopAsyncIteration:
                await stream.aclose()
                last = BackendError(f"backend {name!r} ended without producing anything", 502, name)
                continue
            if last is not None:
                log.info("request %s: failed over to %s", job.id, name)
            return name, stream, first
        assert last is not None
        if len(names) > 1:
            last = BackendError(f"every endpoint failed; last error: {last}", last.status, last.backend)
        raise last

    async def generate(self, job: Job) -> AsyncIterator[Delta]:
        """Yields deltas of the answer; the first arrives with the first token, so a failure
        before it surfaces as an exception from the first `anext` (a real HTTP error)."""
        self.metrics.in_flight.inc()
        stream = None
        try:
            name, stream, event = await self._open(job)
            job.backend = name
            job.ttft = event.t - job.started
            self.metrics.ttft.labels(backend=name).observe(job.ttft)
            matcher = StopMatcher(job.gen.stop)
            limit = job.gen.max_tokens
            produced = 0
            last_t = event.t
            while True:
                if event.text or event.token_id is not None:
                    produced += 1
                text, stopped = matcher.feed(event.text)
                finish = "stop" if stopped else event.finish_reason
                if finish is None and produced >= limit:
                    finish = "length"
                if finish is not None:
                    if not stopped:
                        text += matcher.flush()
                    job.finish_reason = finish
                    self._account(job, name, produced, event.usage)
                    yield Delta(text, finish)
                    return
                yield Delta(text)
                event = await anext(stream)
                self.metrics.inter_token.labels(backend=name).observe(event.t - last_t)
                last_t = event.t
        finally:
            self.metrics.in_flight.dec()
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    def _account(self, job: Job, name: str, produced: int, upstream: Usage | None) -> None:
        if upstream is not None and upstream.completion_tokens:
            job.usage = Usage(job.prompt_tokens or upstream.prompt_tokens, upstream.completion_tokens, True)
        else:
            job.usage = Usage(job.prompt_tokens, produced, True)
        self.metrics.tokens.labels(backend=name, phase="prompt").inc(job.usage.prompt_tokens)
        self.metrics.tokens.labels(backend=name, phase="completion").inc(job.usage.completion_tokens)
