"""What one request cost, booked once its answer ends: the usage the client is told, every attempt's tokens and
cost into the ledger (a cancelled race loser's prefill and a migration's source included), the spend metrics.

The orchestrator (app/serving/orchestrator.py) calls `Accounting.book` when an answer finishes, fails or is
abandoned. Each attempt is priced on its own endpoint (`Attempt.billed`: a cloud's usage report where it sent one,
our counts otherwise) and booked against the constrained side of the policy the request was dispatched under.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.serving.job import Job
from app.serving.metrics import Metrics
from clients.base import Usage
from policies.cost import role_of

if TYPE_CHECKING:
    from app.serving.disco import DiscoRuntime
    from app.serving.ledger import Ledger


class Accounting:
    """Books finished, failed and abandoned answers into DiSCo's runtime, the ledger and the metrics."""

    def __init__(self, disco: DiscoRuntime, ledger: Ledger, metrics: Metrics) -> None:
        self.disco = disco
        self.ledger = ledger
        self.metrics = metrics

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
        # The side this request was dispatched under: its own policy's, which may differ from the configured one.
        constrained_role = role_of(self.disco.side(job.cloud, job.policy))
        for a in job.attempts:
            prefilled, cached, decoded, reasoned = a.billed()
            if a.usage is not None and a.role == "cloud":
                self.disco.observe_usage(a.name, a.usage)
            # A cloud attempt pays its own cloud's prices (a fault or migration may have moved the answer to a
            # cloud other than the request's); the device's energy term is the same under every cloud's λ.
            priced = a.name if a.role == "cloud" else (job.cloud or a.name)
            cost = self.disco.cost_of(
                a.role, priced, prefilled, decoded, cached_tokens=cached, reasoning_tokens=reasoned
            )
            total += cost
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
            )
            self.metrics.tokens.labels(backend=a.name, phase="prompt").inc(prefilled)
            self.metrics.tokens.labels(backend=a.name, phase="completion").inc(decoded)
            self.metrics.spend.labels(endpoint=a.role).inc(cost)
        job.cost = total
        self.metrics.delayed_tokens.inc(job.delayed_tokens)
