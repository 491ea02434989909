"""Per-API-key caps and rate limits: what a key may spend and how fast, and the admission arithmetic.

A request is admitted before any endpoint runs and settled after its last token (or its cancel):

- **Reserve** its worst case: the prompt and at most `reserve_tokens` generated tokens, priced at the dearest
  endpoint it may use (a migration's second prefill included). The per-request ceiling keeps a burst of agents
  with a huge `max_tokens` from being refused while the cap is far away (LiteLLM #38647); a request that writes
  past its ceiling still books every token it streamed, so the cap can be passed by at most what the requests
  in flight wrote beyond their ceilings.
- **Admit** in one step: the spend of the key's period + what is reserved by requests in flight + this
  reservation against the cap; requests and tokens of the current minute against `rpm` and `tpm`; requests in
  flight against `max_streams`. At the cap, `at_cap = "device"` admits it on the device only (nothing is
  reserved: the device costs no dollars), `"reject"` refuses it.
- **Settle** with what the ledger booked for it (every attempt, race loser, migration and failed attempt), in
  integer micro-dollars, and free its reservation. A running request settles as it goes: every `settle_seconds`
  what it booked since its last settlement is added to the key's spend and tokens (a partial settlement, deltas
  only, so the final one adds just the remainder and the sum is what one settlement at the end would add), and its
  hold's lease is renewed. A hold is a lease: one its replica stops renewing (the replica died) lapses
  `hold_seconds` after the last renewal, so a crash frees the key's streams within a lease, not at the period's end.

A key without limits is not admitted (nothing to check: no round trip to a shared store before its first token), but
its requests are settled all the same, so every key's spend is booked: `usage` is what the dashboard's budget panel
shows per key (GET /v1/budget, to an admin key), by the key's name, never the key.

`LocalCounters` is that arithmetic in this process: the single-machine store's, and a shared store's fallback
while the store is away. The shared store runs the same arithmetic as one server-side function per request
(app/serving/valkey_state.py), so a replica never admits on its own count.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass, field

PERIODS = {"minute": 60, "hour": 3600, "day": 86400, "month": None}  # month: calendar month (UTC)
MICRO = 1_000_000
# The most one booking counts, in micro-dollars (a billion dollars): a cost past it, or one that is not a number,
# is booked as this much instead of overflowing the integer the store adds up (a cap then stops the key).
MAX_MICRO = 10**15
MAX_USD = MAX_MICRO / MICRO
# A hold's lease ([state] hold_seconds): a hold its replica stops renewing (the replica died) lapses this long after
# its last renewal. A running request renews it, and settles what it booked so far, every SETTLE_SECONDS
# ([state] settle_seconds).
HOLD_SECONDS = 20.0
SETTLE_SECONDS = 2.0
# Admission outcomes: admitted, admitted on the device only (at the cap), or refused by which limit.
ADMITTED, DEVICE_ONLY = "ok", "device"
REFUSALS = ("cap", "rpm", "tpm", "streams")


@dataclass(frozen=True)
class KeyLimits:
    """One API key's limits. `name` identifies the key in the store and in the headers' logs (never the secret)."""

    name: str
    cap_usd: float | None = None
    period: str = "day"
    at_cap: str = "device"  # device | reject
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + completion) per minute
    max_streams: int | None = None  # requests in flight at once
    reserve_tokens: int = 512  # the per-request ceiling on generated tokens a reservation covers

    @property
    def limited(self) -> bool:
        """Whether any limit applies (else its requests are only settled, never admitted)."""
        return any(v is not None for v in (self.cap_usd, self.rpm, self.tpm, self.max_streams))

    @property
    def cap_micro(self) -> int | None:
        return None if self.cap_usd is None else to_micro(self.cap_usd)


def saturated(usd: float) -> float:
    """A cost within ±MAX_USD: one past it is booked as the most a booking counts, and a cost that is not a number
    as the most too (nothing on the token path raises over a cost; the bounds on prices keep real ones far below)."""
    if math.isnan(usd):
        return MAX_USD
    return max(-MAX_USD, min(MAX_USD, usd))


def to_micro(usd: float) -> int:
    """Dollars as integer micro-dollars (rounded half up): what the store adds up, so no float drift. Saturates at
    ±MAX_MICRO (`saturated`): an infinite or absurd cost never overflows the conversion or the store's integers."""
    return max(-MAX_MICRO, min(MAX_MICRO, math.floor(saturated(usd) * MICRO + 0.5)))


def period_window(period: str, now: float) -> tuple[str, float, int]:
    """(the period's label, seconds until it ends, how long its spend is kept) at `now` (UTC)."""
    length = PERIODS[period]
    if length is None:
        t = time.gmtime(now)
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        end = calendar.timegm((year, month, 1, 0, 0, 0))
        return f"{t.tm_year:04d}-{t.tm_mon:02d}", max(0.0, end - now), 32 * 86400
    start = math.floor(now / length) * length
    return f"{period[0]}{int(start)}", start + length - now, 2 * length


def minute_of(now: float) -> int:
    return int(now // 60)


@dataclass(frozen=True)
class Verdict:
    """What admission said, and the counts after it (for the `x-ratelimit-*` headers)."""

    status: str  # ADMITTED | DEVICE_ONLY | one of REFUSALS
    spent_micro: int
    reserved_micro: int
    requests: int  # this minute's, this one included when admitted
    tokens: int  # this minute's, settled
    streams: int  # in flight, this one included when admitted

    @property
    def admitted(self) -> bool:
        return self.status in (ADMITTED, DEVICE_ONLY)


# A key without limits: admitted by nobody, settled all the same.
UNLIMITED = Verdict(ADMITTED, 0, 0, 0, 0, 0)


@dataclass
class Admission:
    """One admitted request's hold on its key: settled as its choices run (`progress`: partial settlements that keep
    the hold) and once more, with the remainder, when its last choice ends."""

    id: str
    key: KeyLimits
    reserved_micro: int
    verdict: Verdict
    now: float
    shared: bool  # admitted by the shared store (else by this process's count)
    choices: int = 1
    spent_micro: int = 0  # the finished choices' cost
    tokens: int = 0
    done: int = 0
    settled_micro: int = 0  # what partial settlements already added to the key's spend ...
    settled_tokens: int = 0  # ... and to its tokens
    running: dict[str, tuple[int, int]] = field(default_factory=dict)  # a running choice: (micro, tokens) so far

    def add(self, cost_usd: float, tokens: int, choice: str | None = None) -> bool:
        """One choice's booking, whole; True when it was the last, and the admission is due to settle."""
        self.running.pop(choice or self.id, None)
        self.spent_micro += to_micro(cost_usd)
        self.tokens += tokens
        self.done += 1
        return self.done >= self.choices

    def progress(self, choice: str, cost_usd: float, tokens: int) -> tuple[int, int]:
        """A running choice's booking so far; returns what the key's books have not been told yet (micro-dollars,
        tokens: may be negative where a cloud's usage report corrected our counts), now counted as told."""
        self.running[choice] = (to_micro(cost_usd), tokens)
        return self._untold()

    def remainder(self) -> tuple[int, int]:
        """What the final settlement adds: everything booked less what partial settlements added (exact: partial +
        final = what one settlement at the end would have added)."""
        return self._untold()

    def _untold(self) -> tuple[int, int]:
        micro = self.spent_micro + sum(m for m, _ in self.running.values())
        tokens = self.tokens + sum(t for _, t in self.running.values())
        untold = (micro - self.settled_micro, tokens - self.settled_tokens)
        self.settled_micro, self.settled_tokens = micro, tokens
        return untold


def rate_headers(key: KeyLimits, verdict: Verdict, now: float) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for the key's limits (only those it has), and the cap's remainder."""
    reset_minute = f"{60 - now % 60:.0f}s"
    headers = {}
    if key.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(key.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, key.rpm - verdict.requests))
        headers["x-ratelimit-reset-requests"] = reset_minute
    if key.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(key.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, key.tpm - verdict.tokens))
        headers["x-ratelimit-reset-tokens"] = reset_minute
    if key.cap_micro is not None:
        left = max(0, key.cap_micro - verdict.spent_micro - verdict.reserved_micro)
        headers["x-tandem-budget-remaining-usd"] = f"{left / MICRO:.6f}"
    return headers


def retry_after(key: KeyLimits, status: str, now: float) -> int:
    """Seconds until the refusing limit can admit again (a stream limit: a guess of one second)."""
    if status == "cap":
        return max(1, math.ceil(period_window(key.period, now)[1]))
    if status in ("rpm", "tpm"):
        return max(1, math.ceil(60 - now % 60))
    return 1


@dataclass
class _KeyState:
    spent: dict[str, int] = field(default_factory=dict)  # period label -> micro-dollars
    holds: dict[str, tuple[int, float]] = field(default_factory=dict)  # admission id -> (micro, until)
    requests: dict[int, int] = field(default_factory=dict)  # minute -> requests
    tokens: dict[int, int] = field(default_factory=dict)  # minute -> tokens


def usage(key: KeyLimits, spent_micro: int, reserved_micro: int, streams: int, requests: int, tokens: int) -> dict:
    """A key's line on the budget panel: its name and limits, this period's spend, what is in flight, this minute's
    counts (requests and streams are counted at admission: only for a key with limits)."""
    return {
        "name": key.name,
        "period": key.period,
        "cap_usd": key.cap_usd,
        "at_cap": key.at_cap,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "max_streams": key.max_streams,
        "spent_usd": spent_micro / MICRO,
        "spent_micro": spent_micro,
        "reserved_usd": reserved_micro / MICRO,
        "streams": streams if key.limited else None,
        "requests_this_minute": requests if key.limited else None,
        "tokens_this_minute": tokens,
    }


class LocalCounters:
    """The admission arithmetic on this process's own counts (the store's function does the same, atomically)."""

    def __init__(self, hold_seconds: float = HOLD_SECONDS) -> None:
        self._keys: dict[str, _KeyState] = {}
        self.hold_seconds = hold_seconds  # a hold's lease

    def seed(self, key: KeyLimits, now: float, spent_micro: int) -> None:
        """Start the period's spend from what the shared store last said (so an outage does not forget it)."""
        state = self._keys.setdefault(key.name, _KeyState())
        label = period_window(key.period, now)[0]
        state.spent[label] = max(state.spent.get(label, 0), spent_micro)

    def admit(self, key: KeyLimits, admission_id: str, now: float, reserve_micro: int) -> Verdict:
        state = self._keys.setdefault(key.name, _KeyState())
        label = period_window(key.period, now)[0]
        minute = minute_of(now)
        for old in [m for m in state.requests if m < minute - 1]:
            state.requests.pop(old, None)
            state.tokens.pop(old, None)
        state.holds = {i: h for i, h in state.holds.items() if h[1] >= now}
        spent = state.spent.get(label, 0)
        reserved = sum(m for m, _ in state.holds.values())
        requests, tokens, streams = state.requests.get(minute, 0), state.tokens.get(minute, 0), len(state.holds)
        status = decide(key, spent, reserved, reserve_micro, requests, tokens, streams)
        if status in (ADMITTED, DEVICE_ONLY):
            reserve = reserve_micro if status == ADMITTED else 0
            state.holds[admission_id] = (reserve, now + self.hold_seconds)
            state.requests[minute] = requests = requests + 1
            reserved += reserve
            streams += 1
        return Verdict(status, spent, reserved, requests, tokens, streams)

    def usage(self, key: KeyLimits, now: float) -> dict:
        """The key's line (`usage`) on this process's counts."""
        state = self._keys.get(key.name, _KeyState())
        minute = minute_of(now)
        holds = [micro for micro, until in state.holds.values() if until >= now]
        spent = state.spent.get(period_window(key.period, now)[0], 0)
        return usage(key, spent, sum(holds), len(holds), state.requests.get(minute, 0), state.tokens.get(minute, 0))

    def settle(self, key: KeyLimits, admission_id: str, now: float, spent_micro: int, tokens: int) -> None:
        """The request's last settlement (or its remainder after partial ones): its spend and tokens, its hold freed.
        `now`: its admission's time (the period and minute it counts in)."""
        self._keys.setdefault(key.name, _KeyState()).holds.pop(admission_id, None)
        self._count(key, now, spent_micro, tokens)

    def progress(
        self, key: KeyLimits, admission_id: str, admitted: float, now: float, spent_micro: int, tokens: int
    ) -> None:
        """A running request's partial settlement: what it booked since the last one, counted in its admission's
        period and minute (`admitted`), and its hold's lease renewed from `now` (a hold that lapsed stays gone)."""
        state = self._keys.setdefault(key.name, _KeyState())
        hold = state.holds.get(admission_id)
        if hold is not None and hold[1] >= now:
            state.holds[admission_id] = (hold[0], now + self.hold_seconds)
        self._count(key, admitted, spent_micro, tokens)

    def _count(self, key: KeyLimits, now: float, spent_micro: int, tokens: int) -> None:
        state = self._keys.setdefault(key.name, _KeyState())
        label = period_window(key.period, now)[0]
        state.spent[label] = state.spent.get(label, 0) + spent_micro
        minute = minute_of(now)
        state.tokens[minute] = state.tokens.get(minute, 0) + tokens


def decide(key: KeyLimits, spent: int, reserved: int, reserve: int, requests: int, tokens: int, streams: int) -> str:
    """The admission rule: the first limit that refuses, else admitted (or device-only at the cap)."""
    if key.rpm is not None and requests >= key.rpm:
        return "rpm"
    if key.tpm is not None and tokens >= key.tpm:
        return "tpm"
    if key.max_streams is not None and streams >= key.max_streams:
        return "streams"
    cap = key.cap_micro
    if cap is not None and spent + reserved + reserve > cap:
        return DEVICE_ONLY if key.at_cap == "device" else "cap"
    return ADMITTED
