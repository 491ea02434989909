"""Endpoints that fail are remembered: a retry schedule for failures before the first token, and a circuit breaker
per endpoint with a cool-down (pure logic: the time is an argument).

Retries (`retry_wait`): a failure a retry may cure (429, 5xx, a refused connection) is tried again after an
exponential backoff with jitter, at most `retries` times and never past the request's retry budget; a
`Retry-After` the upstream sent replaces the backoff, and one longer than what is left of the budget means: do not
wait, let the request fall back now (the breaker cools the endpoint for that long).

Breaker (`CircuitBreaker`): `failures_to_open` failures in a row open it for a cool-down that doubles with each
opening in a row (`cooldown_seconds`, 2×, 4×, ... up to `max_cooldown_seconds`); a `Retry-After` opens it at once
for exactly that long; a success closes it. While it is open the planner starts nothing on the endpoint and moves
no answer onto it; when the cool-down ends the next request tries it again (the half-open probe), and one more
failure opens it again for twice as long.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetrySettings:
    retries: int = 2  # tries after the first
    backoff_seconds: float = 0.25  # before the first retry; doubled before each next one
    jitter: float = 0.5  # each wait is the backoff × (1 ± jitter), spread uniformly
    budget_seconds: float = 4.0  # the most one request waits in all before its first token


@dataclass(frozen=True)
class BreakerSettings:
    failures_to_open: int = 3
    cooldown_seconds: float = 1.0
    max_cooldown_seconds: float = 60.0


def retry_wait(
    settings: RetrySettings, retry: int, waited: float, retry_after: float | None, uniform: float
) -> float | None:
    """Seconds to wait before retry number `retry` (0: the first), having waited `waited` already, or None: do not
    retry. `retry_after`: what the upstream asked for; `uniform`: a random number in [0, 1) for the jitter."""
    left = settings.budget_seconds - waited
    if retry >= settings.retries or left <= 0:
        return None
    if retry_after is not None:
        return retry_after if retry_after <= left else None
    backoff = settings.backoff_seconds * 2**retry * (1 + settings.jitter * (2 * uniform - 1))
    return min(max(0.0, backoff), left)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """A `Retry-After` header's seconds from `now` (Unix time): delay-seconds or an HTTP date; None when absent or
    unreadable (the backoff applies)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None or when.tzinfo is None:
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


class CircuitBreaker:
    """One endpoint's breaker. `now` is monotonic seconds (what the cool-down is measured on); `wall` is Unix time,
    only to show when a cool-down ends."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.settings = settings or BreakerSettings()
        self.failures = 0  # in a row
        self.openings = 0  # in a row: the cool-down doubles with each
        self.open_until = -math.inf  # monotonic
        self.last_error = ""
        self.on_open: Callable[[], None] | None = None  # told each time it opens (a metric counts them)

    def is_open(self, now: float) -> bool:
        return now < self.open_until

    def failed(self, error: str, now: float, retry_after: float | None = None) -> bool:
        """A failure before the first token; True when it opened (or re-opened) the breaker."""
        self.failures += 1
        self.last_error = error
        if retry_after is None and self.failures < self.settings.failures_to_open:
            return False
        if retry_after is not None:
            cooldown = retry_after
        else:
            cooldown = min(self.settings.max_cooldown_seconds, self.settings.cooldown_seconds * 2**self.openings)
        self.openings += 1
        self.open_until = max(self.open_until, now + cooldown)
        if self.on_open is not None:
            self.on_open()
        return True

    def succeeded(self) -> None:
        self.failures = 0
        self.openings = 0
        self.open_until = -math.inf

    def cooling(self, now: float, wall: float) -> str | None:
        """Why the endpoint is not used now ("cooling until …"), or None when its breaker is closed."""
        left = self.open_until - now
        if left <= 0:
            return None
        until = time.strftime("%H:%M:%S", time.gmtime(wall + left))
        return f"cooling until {until} UTC ({left:.1f} s more)"

    def describe(self, now: float, wall: float) -> dict:
        left = max(0.0, self.open_until - now)
        return {
            "state": "open" if left > 0 else "closed",
            "cooling_seconds": round(left, 2),
            "cooling_until": wall + left if left > 0 else None,
            "failures": self.failures,
            "openings": self.openings,
            "last_error": self.last_error,
            "reason": self.cooling(now, wall),
        }
