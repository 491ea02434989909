"""A device half's pool of HAT workers (`worker_urls`): where each new session goes, and which worker a session
that lost its own moves to.

Placement: the worker with the lowest predicted delay for the session's next round, RTT/2 as this device measured
it (the OPEN round trip) + the worker's predicted compute g(μ + 1) from the μ and g its last OPEN reply carried
(clients/hat/link_model.py) scaled by the sessions it will be serving, + a penalty when its last reply said it
had no free session. A worker this device has not opened yet predicts no delay, so each is tried once.

A circuit breaker per worker (policies/breaker.py, as a cloud's): a failed OPEN, or a session lost mid-answer, keeps it
out of placement for a backoff that doubles with each failure in a row (1 s, 2 s, ... 30 s); a successful OPEN closes
it. When every worker's
breaker is open, the one that opens first is tried anyway (half-open): a pool never refuses outright.

Members: the static `worker_urls`, and with a registry (`worker_registry`, clients/hat/registry.py) every live
worker it lists with this device's m, refreshed at most every `refresh_seconds` when a session is placed; a worker
whose announcement expired leaves the pool (a session already on it keeps its worker until it ends or fails).
Workers of another model fail their OPEN and are kept out by their breaker.

Concurrency (outline decoding's points): each worker whose breaker is closed and that has answered an OPEN runs
its pipeline's P sessions side by side (its stages' micro-batches in flight) and takes up to its max_sessions.

The session's move itself (re-prefill of the delivered context on the new worker) is clients/hat/device.py's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from clients.base import Concurrency
from clients.hat.link_model import LinkModel
from clients.hat.registry import WorkerRegistry
from clients.hat.transport import WorkerAddress
from policies.breaker import BreakerSettings, CircuitBreaker
from policies.estimate import MovingAverage

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 30.0
WORKER_BREAKER = BreakerSettings(failures_to_open=1, cooldown_seconds=1.0, max_cooldown_seconds=MAX_BACKOFF_SECONDS)
FULL_PENALTY_SECONDS = 10.0  # a worker that said it is full: placed only when every other is worse


@dataclass
class PoolWorker:
    url: str
    address: WorkerAddress
    sessions: int = 0  # this device's sessions on it now
    rtt: MovingAverage = field(default_factory=lambda: MovingAverage(alpha=0.3))
    info: dict[str, Any] = field(default_factory=dict)  # its last OPEN reply
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(WORKER_BREAKER))

    @property
    def failures(self) -> int:  # in a row
        return self.breaker.failures

    @property
    def closed_until(self) -> float:  # monotonic: not placed on before this (the breaker is open)
        return self.breaker.open_until

    def predicted_delay(self) -> float:
        """Seconds this worker is predicted to take for a new session's round."""
        rtt = self.rtt.get(0.0)
        compute = LinkModel.worker_seconds(self.info, 1) * (1 + self.sessions) if self.info else 0.0
        free = int(self.info.get("max_sessions", 1 << 30)) - int(self.info.get("sessions", 0))
        return rtt / 2 + compute + (FULL_PENALTY_SECONDS if self.info and free <= 0 else 0.0)


class WorkerPool:
    def __init__(
        self, urls: list[str], registry: WorkerRegistry | None = None, m: int = 0, refresh_seconds: float = 1.0
    ) -> None:
        if not urls and registry is None:
            raise ValueError("a worker pool needs at least one worker URL or a registry")
        self.static = frozenset(urls)
        self.workers = [PoolWorker(url, WorkerAddress.parse(url)) for url in urls]
        self.registry = registry
        self.m = m
        self.refresh_seconds = refresh_seconds
        self._refreshed = -float("inf")
        self._registry_failing = False

    async def refresh(self, now: float | None = None) -> None:
        """The registry's live workers in, the expired out (at most every `refresh_seconds`)."""
        now = time.monotonic() if now is None else now
        if self.registry is None or now - self._refreshed < self.refresh_seconds:
            return
        self._refreshed = now
        try:
            live = await self.registry.workers(self.m)
        except (RedisError, OSError) as exc:
            if not self._registry_failing:
                log.warning("worker registry unreachable (%s): placing on the workers already known", exc)
            self._registry_failing = True
            return
        self._registry_failing = False
        known = {w.url: w for w in self.workers}
        kept = [w for w in self.workers if w.url in live or w.url in self.static]
        for url, info in live.items():
            worker = known.get(url)
            if worker is None:
                worker = PoolWorker(url, WorkerAddress.parse(url))
                kept.append(worker)
            worker.info = {**worker.info, **info}
        self.workers = kept

    async def close(self) -> None:
        if self.registry is not None:
            await self.registry.close()

    def place(self, exclude: set[str] = frozenset(), now: float | None = None) -> PoolWorker | None:
        """The worker a new session goes to, none of `exclude` (URLs); None when every worker is excluded."""
        now = time.monotonic() if now is None else now
        candidates = [w for w in self.workers if w.url not in exclude]
        if not candidates:
            return None
        closed = [w for w in candidates if w.closed_until <= now]
        if not closed:  # every breaker open: half-open on the one that closes first
            return min(candidates, key=lambda w: w.closed_until)
        return min(closed, key=PoolWorker.predicted_delay)

    def concurrency(self, now: float | None = None) -> Concurrency:
        """Sessions its workers run side by side (the sum of their pipelines' P) and take at once (the sum of their
        max_sessions; other devices' sessions there are not known: a session refused for them falls back as any
        does), from the OPEN replies so far; one lane and no limit before any worker has answered."""
        now = time.monotonic() if now is None else now
        known = [w for w in self.workers if w.info and w.closed_until <= now]
        if not known:
            return Concurrency()
        return Concurrency(
            lanes=sum(max(1, int(w.info.get("pipeline") or 1)) for w in known),
            limit=sum(max(1, int(w.info.get("max_sessions") or 1)) for w in known),
        )

    def opened(self, worker: PoolWorker, rtt: float, info: dict[str, Any]) -> None:
        worker.rtt.update(rtt)
        worker.info = dict(info)
        worker.breaker.succeeded()

    def failed(self, worker: PoolWorker, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        worker.breaker.failed("its OPEN failed or its session was lost", now)

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "url": w.url,
                "sessions": w.sessions,
                "rtt_ms": round(w.rtt.get(0.0) * 1e3, 2),
                "predicted_delay_ms": round(w.predicted_delay() * 1e3, 2),
                "failures": w.failures,
                "breaker_open_s": round(max(0.0, w.closed_until - now), 2),
            }
            for w in self.workers
        ]
