"""What one request cost, booked as it goes and once more when its answer ends: the usage the client is told, every
attempt's tokens and cost into the ledger (a cancelled race loser's prefill and a migration's source included), the
spend metrics.

The orchestrator (app/serving/orchestrator.py) calls `Accounting.progress` after every token and `Accounting.book`
when an answer finishes, fails or is abandoned. Each attempt is priced on its own endpoint (`Attempt.billed`: a
cloud's usage report where it sent one, our counts otherwise) and booked against the constrained side of the policy
the request was dispatched under. A running answer books what its attempts did so far every `settle_seconds`
(`book_so_far`), as changes against each attempt's tally, so a replica that dies mid-stream has booked all but the
last interval's tokens, and the booking at the end adds only the remainder: the bookings of a request add up to
exactly what one booking at the end would have been (the ledger's window and a shared store's add them up).
The metrics count each attempt once, at the end.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from app.serving.disco import conversation_key
from app.serving.job import Attempt, Job
from app.serving.limits import SETTLE_SECONDS, saturated
from app.serving.metrics import Metrics
from clients.base import Usage
from policies.cost import role_of

if TYPE_CHECKING:
    from app.serving.disco import DiscoRuntime
    from app.serving.ledger import Ledger


class Accounting:
    """Books running answers as they go, and finished, failed and abandoned ones, into DiSCo's runtime, the ledger and
    the metrics."""

    def __init__(
        self, disco: DiscoRuntime, ledger: Ledger, metrics: Metrics, settle_seconds: float = SETTLE_SECONDS
    ) -> None:
        self.disco = disco
        self.ledger = ledger
        self.metrics = metrics
        self.settle_seconds = settle_seconds  # [state] settle_seconds: how often a running answer is booked

    def progress(self, job: Job, now: float) -> None:
        """After a token (`now`: time.monotonic()): the answer's work booked so far, once a settle interval passed."""
        if now - job.booked_at >= self.settle_seconds:
            self.book_so_far(job)

    def book_so_far(self, job: Job) -> tuple[float, int]:
        """What the running answer's attempts did until now, into the ledger (each as its change since the last
        booking); returns what the answer has cost so far (`job.cost`) and its tokens so far (the prompt's and those
        generated)."""
        job.booked_at = time.monotonic()
        job.cost = sum(self._book_attempt(job, a) for a in job.attempts)
        generated = sum(a.decode_tokens + a.reasoning_tokens for a in job.attempts)
        return job.cost, job.prompt_tokens + generated

    def book(self, job: Job, produced: int, upstream: Usage | None, finished: bool = True) -> None:
        """The answer's usage (`job.usage`), every attempt's cost into the ledger and the metrics, the request's
        total (`job.cost`). produced: the answer's tokens the client was sent; upstream: the serving cloud's usage
        report, which stands for the whole answer when that cloud alone served it. finished=False (a failed or
        abandoned answer): what was spent is booked, but the output-length estimate learns nothing from it."""
        reasoning = sum(a.reasoning_tokens for a in job.attempts)
        single_upstream = len(job.attempts) == 1 and upstream is not None and upstream.completion_tokens
        if single_upstream:
            job.usage = Usage(
                job.prompt_tokens,
                upstream.completion_tokens,
                True,
                cached_tokens=min(upstream.cached_tokens, job.prompt_tokens),
                reasoning_tokens=upstream.reasoning_tokens or min(reasoning, upstream.completion_tokens),
            )
        else:
            job.usage = Usage(job.prompt_tokens, produced + reasoning, True, reasoning_tokens=reasoning)
        if finished:
            self.disco.observe_output(job.usage.completion_tokens)
        total = 0.0
        # What each cloud was sent of the conversation (its prompt cache may keep it) and what it said it read from
        # that cache: the reports first, each against what was held before this request (a race's loser sent it too).
        sent = [a for a in job.attempts if a.role == "cloud" and a.outcome != "failed"]
        for a in sorted(sent, key=lambda a: a.usage is None):
            self.disco.observe_usage(a.name, a.usage, conversation_key(job.gen), a.context_tokens)
        for a in job.attempts:
            cost = self._book_attempt(job, a)
            total += cost
            prefilled, _, decoded, _ = a.billed()
            self.metrics.tokens.labels(backend=a.name, phase="prompt").inc(prefilled)
            self.metrics.tokens.labels(backend=a.name, phase="completion").inc(decoded)
            self.metrics.spend.labels(endpoint=a.role).inc(cost)
        job.cost = total
        self.metrics.delayed_tokens.inc(job.delayed_tokens)

    def _book_attempt(self, job: Job, a: Attempt) -> float:
        """One attempt's work until now into the ledger (what changed since its tally); returns its cost until now."""
        prefilled, cached, decoded, reasoned = a.billed()
        # A cloud attempt pays its own cloud's prices (a fault or migration may have moved the answer to a cloud
        # other than the request's); the device's energy term is the same under every cloud's λ.
        priced = a.name if a.role == "cloud" else (job.cloud or a.name)
        cost = saturated(
            self.disco.cost_of(a.role, priced, prefilled, decoded, cached_tokens=cached, reasoning_tokens=reasoned)
        )
        # The side this request was dispatched under: its own policy's, which may differ from the configured one.
        constrained_role = role_of(self.disco.side(job.cloud, job.policy))
        self.ledger.record(
            job.id,
            a.role,
            prefilled,
            decoded,
            cost,
            constrained=a.role == constrained_role,
            prompt_tokens=job.prompt_tokens,
            cached_tokens=cached,
            reasoning_tokens=reasoned,
            tally=a.booked,
        )
        return cost
