"""Where a gateway's shared state lives: one interface (`StateStore`), two stores.

`MemoryStore`, the default, is this process: the ledger (app/serving/ledger.py) keeps the budget settings and the
spend, the orchestrator the traces, `LocalCounters` (app/serving/limits.py) the keys' caps and rate limits. A
single gateway needs nothing more, and nothing about it changes.

`ValkeyStore` (app/serving/valkey_state.py, `[state] backend = "valkey"`) puts on a Redis-protocol server what
replicas must agree on: the budget settings with a version (compare-and-set, replicas told by pub/sub and by
polling), the spend (integer micro-dollars), the realised-budget window, the traces (a short TTL), and the keys'
admissions, and the cloud TTFT samples DiSCo estimates from (so a new replica starts warm; the device's estimators
stay local: they describe that device). The ledger stays the replica's local view, which is what it books into
first; the store is told of every booking (`book`), never waited for on a token's path.

The core talks to the store only through this interface; the Valkey module is imported by the composition root
alone, when the settings name it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from app.serving.ledger import Booking, Ledger
from app.serving.limits import HOLD_SECONDS, SETTLE_SECONDS, Admission, KeyLimits, LocalCounters, Verdict


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached: what was asked of it was not done."""


class StateStore(Protocol):
    backend: str  # "memory" | "valkey"
    settle_seconds: float  # how often a running request settles what it booked so far and renews its hold

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def may_spend(self) -> bool:
        """False while paid clouds must be refused (a lost store under `on_store_loss = "closed"`)."""

    async def admit(self, key: KeyLimits, admission_id: str, now: float, reserve_micro: int) -> tuple[Verdict, bool]:
        """The key's verdict on a request reserving `reserve_micro`, and whether the shared store gave it."""

    async def settle(self, admission: Admission) -> None:
        """Book what an admitted request spent (less what partial settlements booked) and free its reservation."""

    def progress(self, admission: Admission, spent_micro: int, tokens: int, now: float) -> None:
        """A running request's partial settlement (what it booked since the last one) and its hold's lease renewed
        from `now` (must not block)."""

    async def key_usage(self, keys: Sequence[KeyLimits], now: float) -> list[dict]:
        """Each key's line on the budget panel (app/serving/limits.py's `usage`), every replica's when shared."""

    def book(self, booking: Booking) -> None:
        """The ledger booked this (called on every booking; must not block)."""

    def keep_trace(self, request_id: str, trace: dict) -> None:
        """A request's trace, for any replica to answer GET /v1/requests/{id} (must not block)."""

    async def trace(self, request_id: str) -> dict | None:
        """A trace another replica kept; None when there is none (or no shared store)."""

    def share_server_ttft(self, cloud: str, seconds: float) -> None:
        """A cloud TTFT sample this replica measured (must not block)."""

    async def server_ttft_samples(self, clouds: list[str]) -> dict[str, list[float]]:
        """The cloud TTFT samples the replicas shared (the newest, capped; oldest first), for a new replica."""

    async def spend(self) -> dict | None:
        """The spend every replica booked, as the ledger's snapshot shapes it; None when not shared or away."""

    async def update_budget(self, patch: dict[str, Any]) -> None:
        """PUT /v1/budget: the patch applied to the current settings, made current everywhere."""

    async def reset_budget(self) -> None:
        """DELETE /v1/budget: back to the config's settings everywhere."""

    def condition(self) -> str:
        """ "connected" (a memory store always), "lost" (unreachable: bookings and traces wait) or "degraded" (it
        answers, but this replica is out of step with it: settings it cannot read, a background task failing)."""

    def describe(self) -> dict: ...


class MemoryStore:
    """Everything in this process (the default): the ledger is the budget, the counters are the limits."""

    backend = "memory"

    def __init__(self, ledger: Ledger, hold_seconds: float = HOLD_SECONDS, settle_seconds: float = SETTLE_SECONDS):
        self.counters = LocalCounters(hold_seconds)
        self.settle_seconds = settle_seconds
        self._ledger = ledger

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def may_spend(self) -> bool:
        return True

    async def admit(self, key: KeyLimits, admission_id: str, now: float, reserve_micro: int) -> tuple[Verdict, bool]:
        return self.counters.admit(key, admission_id, now, reserve_micro), False

    async def settle(self, admission: Admission) -> None:
        self.counters.settle(admission.key, admission.id, admission.now, *admission.remainder())

    def progress(self, admission: Admission, spent_micro: int, tokens: int, now: float) -> None:
        self.counters.progress(admission.key, admission.id, admission.now, now, spent_micro, tokens)

    async def key_usage(self, keys: Sequence[KeyLimits], now: float) -> list[dict]:
        return [self.counters.usage(key, now) for key in keys]

    def book(self, booking: Booking) -> None:
        pass  # the ledger is the book

    def keep_trace(self, request_id: str, trace: dict) -> None:
        pass  # the orchestrator keeps its own

    async def trace(self, request_id: str) -> dict | None:
        return None

    def share_server_ttft(self, cloud: str, seconds: float) -> None:
        pass  # DiSCo's estimators are the only copy

    async def server_ttft_samples(self, clouds: list[str]) -> dict[str, list[float]]:
        return {}

    async def spend(self) -> dict | None:
        return None

    async def update_budget(self, patch: dict[str, Any]) -> None:
        self._ledger.update(patch)

    async def reset_budget(self) -> None:
        self._ledger.reset()

    def condition(self) -> str:
        return "connected"

    def describe(self) -> dict:
        return {"backend": self.backend}
