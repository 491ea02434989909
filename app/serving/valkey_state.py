"""The shared state on a Redis-protocol server (Valkey, or Redis 7+), for gateway replicas: `[state] backend =
"valkey"` (app/serving/state.py says what is shared and what stays local).

On the server, one function library (`tandem`, loaded with FUNCTION LOAD at every (re)connection, so a store
that restarted empty gets it back; `tandem_leases` beside it) does every step that must be atomic:

- `tandem_admit` / `tandem_progress` / `tandem_settle`: a key's admission (app/serving/limits.py's rule: the
  period's spend, the reservations in flight, this minute's requests and tokens, the streams in flight), a running
  request's partial settlement with its hold's lease renewed, and its last settlement. The
  key's counters share one hash tag, `{<prefix>key:<name>}`, so a cluster keeps them on one node. Only the
  store admits; a replica never admits on its own count while the store answers.
- `tandem_book`: one ledger booking: spend per endpoint in integer micro-dollars (HINCRBY: no float drift), and
  the realised-budget window of the last N requests with its running sums (reading it is O(1)).
- `tandem_budget_swap`: PUT /v1/budget's compare-and-set on the settings' version, published on a channel. A
  replica hears the channel and also polls the version every `poll_seconds`, since pub/sub drops messages while a
  connection is down.

Traces are plain keys with a TTL; the cloud TTFT samples a list per cloud, capped at DiSCo's window. Bookings,
settlements and samples go through one queue, traces through their own (bounded: the oldest dropped past
`trace_queue`, counted), drained by a background task, bookings first: a token's path never waits on the store.

A call that breaks on its connection (one opened before a restart fails its first command) is tried once more,
after the pool's idle connections are dropped and a PING on a fresh connection (which loads the library again)
found the store; the store is declared lost only when that probe fails.

When the store cannot be reached (`on_store_loss`): the replica keeps serving. Admissions fall back to this
process's counters, seeded with the spend the store last reported for each key, and every booking, settlement and
trace waits in its queue until the store is back, then is replayed (INCRBY adds up, so the books reconcile). With
"closed", paid clouds are refused meanwhile (app/serving/core.py puts the request on the device). PUT /v1/budget
answers 503 while the store is away: a replica must not change settings the others cannot see.

The store is "degraded" while it answers but this replica is out of step with it: settings it cannot read (it
serves on its last good ones; fields a newer release added are read past and kept), or a background task that
failed (logged, retried with a backoff). Bookings keep going to the store meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as BrokenConnection
from redis.exceptions import RedisError, ResponseError
from redis.maint_notifications import MaintNotificationsConfig

from app.serving.budget import SETTING_FIELDS, BudgetSettings, apply_patch
from app.serving.ledger import Booking, Ledger
from app.serving.limits import (
    HOLD_SECONDS,
    MICRO,
    SETTLE_SECONDS,
    Admission,
    KeyLimits,
    LocalCounters,
    Verdict,
    minute_of,
    period_window,
    usage,
)
from app.serving.state import StoreUnavailable
from app.serving.valkey_functions import LEASES, LIBRARY

log = logging.getLogger(__name__)


_DOWN = (RedisError, OSError)
_SOURCE = "the shared store"
Op = Callable[[Pipeline], Any]  # queues its commands on a pipeline (a MULTI/EXEC batch)
BATCH = 256  # queued operations sent in one MULTI/EXEC
BACKOFF = (0.25, 30.0)  # a failing background task's first and longest wait before it tries again
T = TypeVar("T")


@dataclass
class _Progress:
    """A running request's partial settlement waiting for the store (an Op). While it waits, the request's later
    ones add into it — the spend and the tokens are deltas, the lease's new end is the newest — so a store outage
    queues one per running request, not one per settle period. Its `now` stays the first one's: `tandem_progress`
    renews a hold that had not lapsed by then, as the first of the separate calls would have, and each later call
    came within a lease of the one before."""

    keys: tuple[str, str, str]  # the spend of the period, the holds, the tokens of the minute
    admission_id: str
    spent_micro: int
    tokens: int
    keep: int  # the spend's TTL
    now: str
    lease_end: str
    holds_ttl: int

    def __call__(self, pipe: Pipeline) -> None:
        args = (self.spent_micro, self.tokens, self.keep, self.now, self.lease_end, self.holds_ttl)
        pipe.fcall("tandem_progress", 3, *self.keys, self.admission_id, *args)


def _broken(exc: BaseException) -> bool:
    """A call that failed on its connection rather than on the store's data: a connection opened before a restart
    (its first command fails), one cut under it, or a store that restarted empty (the library gone). A fresh
    connection may well succeed. A timeout is not one: the command may have run."""
    if isinstance(exc, ResponseError):
        return "function not found" in str(exc).lower()
    return isinstance(exc, BrokenConnection) or (isinstance(exc, OSError) and not isinstance(exc, TimeoutError))


def _no_secret(url: str) -> str:
    """The store's URL for logs and GET /v1/budget: without its password."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class ValkeyStore:
    backend = "valkey"

    def __init__(
        self,
        ledger: Ledger,
        url: str,
        prefix: str = "tandem:",
        on_store_loss: str = "local",
        trace_ttl: float = 600.0,
        poll_seconds: float = 1.0,
        timeout: float = 1.0,
        ttft_samples: int = 2000,
        hold_seconds: float = HOLD_SECONDS,
        settle_seconds: float = SETTLE_SECONDS,
        trace_queue: int = 1000,
    ):
        self.url = url
        self.prefix = prefix
        self.on_store_loss = on_store_loss
        self.trace_ttl = trace_ttl
        self.poll_seconds = poll_seconds
        self.ttft_samples = ttft_samples  # the cloud TTFT samples kept per cloud (DiSCo's window)
        self.trace_queue = trace_queue  # traces that may wait for the store; the oldest dropped past it
        # No retries inside the client: a lost store must fall back at once, not after a backoff per call; `_call`
        # tries a broken call once more, on a fresh connection.
        self._redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            # redis-py's default ("auto") skips the pool's check of an idle connection before it is handed out, so
            # one the store closed (a restart) failed its next command: off, a closed one is reopened instead.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        self.hold_seconds = hold_seconds  # a hold's lease
        self.settle_seconds = settle_seconds
        self.counters = LocalCounters(hold_seconds)  # the fallback while the store is away
        self._pending: deque[Op] = deque()  # bookings and settlements not yet on the store, in order: never dropped
        self._progress: dict[str, _Progress] = {}  # each admission's progress op in `_pending` and not yet sent
        # Traces not yet on the store, oldest first: its key → (when kept, JSON); a request's newer one replaces it.
        self._traces: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.traces_dropped = 0  # since start: traces the full queue pushed out
        self._traces_overflowing = False  # said in the log until the queue is empty again
        self._up = False
        self._budget_stale = True
        self._give_ours = False  # a store that restarted empty gets this replica's settings
        self._unreadable_version: int | None = None  # the store's settings version this replica could not read
        self._problems: dict[str, str] = {}  # what keeps this replica out of step with a store that answers
        self._recovery: asyncio.Task[bool] | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._ledger = ledger
        ledger_tag = f"{prefix}{{ledger}}"
        self._spend = f"{ledger_tag}:spend"
        self._window = (f"{ledger_tag}:window:entries", f"{ledger_tag}:window:order", f"{ledger_tag}:window:sums")
        self._budget = f"{ledger_tag}:budget"
        self._channel = f"{prefix}budget"

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._ledger.on_booking(self.book)
        try:
            await self._connect()
        except _DOWN as exc:
            self._lost(exc)
        except Exception as exc:  # the background task tries again; the gateway starts whatever the store holds
            self._trouble("the background task", exc)
        self._tasks = [asyncio.create_task(self._keep()), asyncio.create_task(self._listen())]

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._recovery] if self._recovery is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._up:
            with contextlib.suppress(*_DOWN, TimeoutError):
                await asyncio.wait_for(self._drain(), 2.0)
        if self._pending or self._traces:
            log.warning(
                "%d bookings and %d traces never reached the shared store %s",
                len(self._pending),
                len(self._traces),
                _no_secret(self.url),
            )
        await self._redis.aclose()

    async def _connect(self) -> None:
        await self._redis.connection_pool.disconnect(inuse_connections=False)  # none opened before a loss is reused
        await self._probe()
        if not self._up:
            log.info(
                "shared store %s: connected (%d bookings, %d traces to replay)",
                _no_secret(self.url),
                len(self._pending),
                len(self._traces),
            )
        self._up = True
        await self._sync_budget(publish_ours=True)

    async def _probe(self) -> None:
        """PING on a fresh connection (none of the pool's, which may predate a restart), and the libraries loaded again
        on it: a store that restarted empty has them back before any call needs them."""
        connection = self._redis.connection_pool.make_connection()
        try:
            await connection.connect()
            await connection.send_command("PING")
            await connection.read_response()
            for library in (LIBRARY, LEASES):
                await connection.send_command("FUNCTION", "LOAD", "REPLACE", library)
                await connection.read_response()
        finally:
            await connection.disconnect()

    async def _recover(self) -> bool:
        """After a call broke: the pool's idle connections dropped and the store probed, once for all the calls that
        broke at the same time. False (and the store declared lost) when the probe fails."""
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.create_task(self._reconnect())
        return await asyncio.shield(self._recovery)

    async def _reconnect(self) -> bool:
        await self._redis.connection_pool.disconnect(inuse_connections=False)
        try:
            await self._probe()
        except _DOWN as exc:
            self._lost(exc)
            return False
        self._give_ours = self._budget_stale = True  # it may have restarted empty: settings given back, or read again
        self._later()
        return self._up

    async def _call(self, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """One call on the store. A call that broke on its connection (`_broken`) is tried once more after
        `_recover`; any other failure but the store's own refusal is probed. The store is declared lost only when a
        probe fails; a failed call raises either way."""
        try:
            return await call(*args)
        except _DOWN as exc:
            if isinstance(exc, ResponseError) and not _broken(exc):
                raise  # the store answered
            if not await self._recover() or not _broken(exc):
                raise
        try:
            return await call(*args)
        except _DOWN as exc:
            if not isinstance(exc, ResponseError):
                await self._recover()
            raise

    def _lost(self, exc: BaseException) -> None:
        if self._up:
            log.warning(
                "shared store %s lost (%s): serving on, %s",
                _no_secret(self.url),
                exc,
                "paid clouds refused until it is back" if self.on_store_loss == "closed" else "limits on local counts",
            )
        self._up = False

    def _trouble(self, where: str, problem: BaseException | str | None) -> None:
        """What keeps this replica out of step with a store that answers (None: no longer), logged when it changes:
        the store is "degraded" while there is any."""
        if problem is None:
            if self._problems.pop(where, None) is not None:
                log.info("shared store %s: %s works again", _no_secret(self.url), where)
            return
        text = problem if isinstance(problem, str) else f"{type(problem).__name__}: {problem}"
        if self._problems.get(where) != text:
            unexpected = isinstance(problem, BaseException) and not isinstance(problem, _DOWN)
            log.error("shared store %s degraded: %s: %s", _no_secret(self.url), where, text, exc_info=unexpected)
        self._problems[where] = text

    async def _keep(self) -> None:
        """Reconnects, replays what waited, polls the budget's version: the one background task that writes. It
        never dies: a failure is logged, the store marked degraded, and the work tried again after a backoff."""
        assert self._wake is not None
        backoff = BACKOFF[0]
        while True:
            try:
                if not self._up:
                    await self._connect()
                await self._drain()
                if self._budget_stale:
                    self._budget_stale = False
                    await self._sync_budget(publish_ours=self._give_ours)
                    self._give_ours = False
            except _DOWN as exc:
                self._budget_stale = True  # whatever failed, the settings are read again next time
                if self._up:  # a call failed, yet the store answers its probe
                    self._trouble("the background task", exc)
                else:
                    self._lost(exc)
                await asyncio.sleep(BACKOFF[0])
                continue
            except Exception as exc:
                self._budget_stale = True
                self._trouble("the background task", exc)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, BACKOFF[1])
                continue
            self._trouble("the background task", None)
            backoff = BACKOFF[0]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
            if not self._wake.is_set():
                self._budget_stale = True  # the poll: pub/sub may have dropped a change
            self._wake.clear()

    async def _drain(self) -> None:
        """What waited, in MULTI/EXEC batches: a batch is applied whole or not at all. Bookings and settlements
        first, in order, then traces. At least once: a batch whose reply was lost after the store applied it is sent
        again (a store lost at that very moment, or a connection broken under it)."""
        while self._pending:
            batch = [self._pending[i] for i in range(min(BATCH, len(self._pending)))]
            for op in batch:  # written into the batch as they are now: a later progress queues one of its own
                if isinstance(op, _Progress) and self._progress.get(op.admission_id) is op:
                    del self._progress[op.admission_id]
            await self._call(self._send, batch)
            for _ in batch:
                self._pending.popleft()
        while self._traces and not self._pending:
            entries = list(itertools.islice(self._traces.items(), BATCH))
            now = time.monotonic()
            batch = [self._trace_op(key, text, self.trace_ttl - (now - kept)) for key, (kept, text) in entries]
            await self._call(self._send, [op for op in batch if op is not None])
            for key, entry in entries:
                if self._traces.get(key) is entry:  # not replaced by a newer trace meanwhile
                    del self._traces[key]
        if self._traces_overflowing and not self._traces:
            self._traces_overflowing = False
            log.warning(
                "shared store %s: the waiting traces are replayed; %d were dropped since start",
                _no_secret(self.url),
                self.traces_dropped,
            )

    async def _send(self, batch: list[Op]) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            for op in batch:
                op(pipe)
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, ResponseError) and _broken(reply):
                raise reply  # the store restarted empty: nothing of the batch's functions ran; again once loaded
        for reply in replies:  # a command the store refused is not retried: it would be refused again
            if isinstance(reply, Exception):
                log.error("the shared store refused a booking: %s", reply)

    async def _listen(self) -> None:
        """Budget changes published by other replicas (the poll catches what this misses). It never dies either."""
        backoff = BACKOFF[0]
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                self._trouble("the budget channel", None)
                backoff = BACKOFF[0]
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message["type"] == "message":
                        self._budget_stale = True
                        self._later()
            except _DOWN:
                await asyncio.sleep(0.5)  # the store is away: `_keep` says so
            except Exception as exc:
                self._trouble("the budget channel", exc)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, BACKOFF[1])
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _later(self, op: Op | None = None) -> None:
        if op is not None:
            self._pending.append(op)
        if self._wake is not None:
            self._wake.set()

    # -- the budget ----------------------------------------------------------------------------------------------
    def _settings_of(self, text: str) -> BudgetSettings:
        """The store's settings as this release reads them: a field a newer release added is ignored (it stays in
        the store), the prices of a cloud this replica does not have dropped."""
        return apply_patch(self._ledger.defaults, json.loads(text), unknown_backends="drop", unknown_fields="ignore")

    async def _sync_budget(self, publish_ours: bool = False) -> None:
        """Adopt the store's settings when they are newer; a store that has none (new, or restarted empty) is
        given this replica's when it has any of its own. Settings this release cannot read leave it on its last
        good ones, degraded, until a readable version is written."""
        ledger = self._ledger
        version, text = await self._call(self._redis.hmget, self._budget, ["version", "settings"])
        if version is None:
            if publish_ours and ledger.settings != ledger.defaults:
                await self._call(self._swap, 0, ledger.settings)
            return
        version = int(version)
        if version in (ledger.version, self._unreadable_version):
            return
        try:
            settings = self._settings_of(text)
        except (ValueError, TypeError) as exc:  # BudgetValidationError (naming the field), or not JSON
            field = getattr(exc, "field", None)
            self._unreadable_version = version
            self._trouble(
                "the budget settings",
                f"version {version} in the store is unreadable here ({field or 'the whole blob'}: {exc}); serving on "
                f"version {ledger.version}'s until a readable version is written (PUT /v1/budget writes one)",
            )
            return
        ledger.adopt(settings, version, _SOURCE)
        self._unreadable_version = None
        self._trouble("the budget settings", None)

    async def _swap(self, expected: int, settings: BudgetSettings, kept: dict[str, Any] | None = None) -> int:
        """The compare-and-set; `kept`: the fields a newer release wrote, which this one keeps but does not read."""
        payload = json.dumps({**(kept or {}), **settings.to_dict()})
        return int(await self._redis.fcall("tandem_budget_swap", 1, self._budget, expected, payload, self._channel))

    async def _change_budget(self, change: Callable[[BudgetSettings], BudgetSettings], keep_foreign: bool) -> None:
        ledger = self._ledger
        if not self._up:
            raise StoreUnavailable("the shared store is unreachable; budget settings cannot change until it is back")
        try:
            for _ in range(16):
                version, text = await self._call(self._redis.hmget, self._budget, ["version", "settings"])
                base, foreign = ledger.settings, {}
                if text is not None:
                    with contextlib.suppress(ValueError, TypeError):  # unreadable: this replica's last good settings
                        base = self._settings_of(text)
                    with contextlib.suppress(ValueError, AttributeError):
                        foreign = {k: v for k, v in json.loads(text).items() if k not in SETTING_FIELDS}
                new = change(base)
                expected = int(version or 0)
                swapped = await self._call(self._swap, expected, new, foreign if keep_foreign else None)
                if swapped > 0:
                    ledger.adopt(new, swapped, _SOURCE)
                    self._unreadable_version = None
                    self._trouble("the budget settings", None)
                    return
        except _DOWN as exc:
            raise StoreUnavailable(f"the shared store failed while changing the budget: {exc}") from exc
        raise StoreUnavailable("the budget kept changing under this update; try again")

    async def update_budget(self, patch: dict[str, Any]) -> None:
        """PUT: the patch applied to the store's settings (this replica's last good ones where the store's cannot be
        read), the fields a newer release added kept."""
        await self._change_budget(lambda base: apply_patch(base, patch), keep_foreign=True)

    async def reset_budget(self) -> None:
        """DELETE: the config's settings, and nothing else: a newer release's fields go back to its own defaults."""
        defaults = self._ledger.defaults
        await self._change_budget(lambda _: defaults, keep_foreign=False)

    # -- admission -------------------------------------------------------------------------------------------------
    async def may_spend(self) -> bool:
        """Under "closed", a store believed up is asked (a PING) before each request may use a paid cloud: a loss the
        background task has not noticed yet must not let a request spend unbooked. Once lost, no request waits on it."""
        if self.on_store_loss == "local":
            return True
        if not self._up:
            return False
        try:
            await self._call(self._redis.ping)
        except _DOWN:
            self._later()
        return self._up

    def _key_names(self, key: KeyLimits, now: float) -> tuple[str, str, str, str, int]:
        tag = f"{self.prefix}{{key:{key.name}}}"
        label, _, keep = period_window(key.period, now)
        minute = minute_of(now)
        return f"{tag}:spend:{label}", f"{tag}:holds", f"{tag}:rpm:{minute}", f"{tag}:tpm:{minute}", keep

    async def admit(self, key: KeyLimits, admission_id: str, now: float, reserve_micro: int) -> tuple[Verdict, bool]:
        if self._up:
            spend, holds, rpm, tpm, _ = self._key_names(key, now)
            limits = [-1 if v is None else v for v in (key.cap_micro, key.rpm, key.tpm, key.max_streams)]
            try:
                reply = await self._call(
                    self._redis.fcall,
                    "tandem_admit",
                    4,
                    spend,
                    holds,
                    rpm,
                    tpm,
                    admission_id,
                    f"{now:.3f}",
                    f"{now + self.hold_seconds:.3f}",
                    reserve_micro,
                    *limits,
                    int(key.at_cap == "device"),
                    math.ceil(2 * self.hold_seconds),
                )
                verdict = Verdict(reply[0], *(int(v) for v in reply[1:]))
                self.counters.seed(key, now, verdict.spent_micro)
                return verdict, True
            except _DOWN:
                self._later()
        return self.counters.admit(key, admission_id, now, reserve_micro), False

    async def settle(self, admission: Admission) -> None:
        key, now = admission.key, admission.now
        spend, holds, _, _, keep = self._key_names(key, now)
        tpm = f"{self.prefix}{{key:{key.name}}}:tpm:{minute_of(now)}"
        spent_micro, tokens = admission.remainder()
        args = (admission.id, spent_micro, tokens, keep)

        def op(pipe: Pipeline) -> None:
            pipe.fcall("tandem_settle", 3, spend, holds, tpm, *args)

        if not admission.shared:
            self.counters.settle(key, admission.id, now, spent_micro, tokens)
        self._progress.pop(admission.id, None)  # a waiting one still leaves before this; nothing adds into it now
        if self._up and not self._pending:
            try:
                await self._call(self._redis.fcall, "tandem_settle", 3, spend, holds, tpm, *args)
                return
            except _DOWN:
                pass
        self._later(op)  # replayed, in order, when the store is back

    def progress(self, admission: Admission, spent_micro: int, tokens: int, now: float) -> None:
        """Through the queue, like a booking (replayed after a loss; a lease renewed late finds its hold lapsed), added
        into the admission's last one while that one waits (`_Progress`)."""
        key = admission.key
        if not admission.shared:
            self.counters.progress(key, admission.id, admission.now, now, spent_micro, tokens)
        waiting = self._progress.get(admission.id)
        if waiting is not None:  # its last one has not left yet: this one adds into it
            waiting.spent_micro += spent_micro
            waiting.tokens += tokens
            waiting.lease_end = f"{now + self.hold_seconds:.3f}"
            return
        spend, holds, _, tpm, keep = self._key_names(key, admission.now)
        op = _Progress(
            (spend, holds, tpm),
            admission.id,
            spent_micro,
            tokens,
            keep,
            f"{now:.3f}",
            f"{now + self.hold_seconds:.3f}",
            math.ceil(2 * self.hold_seconds),
        )
        self._progress[admission.id] = op
        self._later(op)

    async def key_usage(self, keys: Sequence[KeyLimits], now: float) -> list[dict]:
        """Each key's counts as the store holds them (every replica's), in one round trip; this replica's own while
        the store is away (marked `"source": "local"`)."""
        if self._up:

            async def read() -> list:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key in keys:
                        spend, holds, rpm, tpm, _ = self._key_names(key, now)
                        pipe.get(spend)
                        pipe.hgetall(holds)
                        pipe.get(rpm)
                        pipe.get(tpm)
                    return await pipe.execute()

            try:
                replies = await self._call(read)
            except _DOWN:
                self._later()
            else:
                lines = []
                for i, key in enumerate(keys):
                    spent, holds, requests, tokens = replies[4 * i : 4 * i + 4]
                    live = [hold.split(":") for hold in holds.values()]
                    live = [int(micro) for micro, until in live if float(until) >= now]
                    line = usage(key, int(spent or 0), sum(live), len(live), int(requests or 0), int(tokens or 0))
                    lines.append({**line, "source": "shared"})
                return lines
        return [{**self.counters.usage(key, now), "source": "local"} for key in keys]

    # -- bookings and traces -----------------------------------------------------------------------------------------
    def book(self, booking: Booking) -> None:
        b = booking
        args = (
            b.request_id,
            b.endpoint,
            int(b.new_request),
            int(b.new_for_endpoint),
            b.prefill_tokens,
            b.decode_tokens,
            b.cost_micro,
            b.input_tokens,
            b.constrained_input,
            self._ledger.window,
        )
        keys = (self._spend, *self._window)
        self._later(lambda pipe: pipe.fcall("tandem_book", 4, *keys, *args))

    def keep_trace(self, request_id: str, trace: dict) -> None:
        """Queued apart from the bookings, at most `trace_queue` of them: past it the oldest is dropped (counted in
        `traces_dropped`, said once per outage in the log), never a booking."""
        key = f"{self.prefix}trace:{request_id}"
        self._traces.pop(key, None)
        if len(self._traces) >= self.trace_queue:
            self._traces.popitem(last=False)
            self.traces_dropped += 1
            if not self._traces_overflowing:
                log.warning(
                    "shared store %s: %d traces wait for it; the oldest are dropped (%d so far: store.traces_dropped)",
                    _no_secret(self.url),
                    self.trace_queue,
                    self.traces_dropped,
                )
            self._traces_overflowing = True
        self._traces[key] = (time.monotonic(), json.dumps(trace))
        self._later()

    @staticmethod
    def _trace_op(key: str, text: str, ttl_left: float) -> Op | None:
        """A trace's SET, readable for what is left of its TTL; None once that has run out while it waited."""
        if ttl_left < 1:
            return None
        return lambda pipe: pipe.set(key, text, ex=round(ttl_left))

    def share_server_ttft(self, cloud: str, seconds: float) -> None:
        if not self._up:
            return  # a sample is worth little later; the estimators have it here
        key, keep = self._ttft_key(cloud), self.ttft_samples

        def op(pipe: Pipeline) -> None:
            pipe.lpush(key, f"{seconds:.6f}")
            pipe.ltrim(key, 0, keep - 1)

        self._later(op)

    async def server_ttft_samples(self, clouds: list[str]) -> dict[str, list[float]]:
        if not self._up:
            return {}
        try:
            lists = [await self._call(self._redis.lrange, self._ttft_key(c), 0, self.ttft_samples - 1) for c in clouds]
        except _DOWN:
            return {}
        return {c: [float(v) for v in reversed(values)] for c, values in zip(clouds, lists, strict=True) if values}

    def _ttft_key(self, cloud: str) -> str:
        return f"{self.prefix}{{ledger}}:ttft:{cloud}"

    async def trace(self, request_id: str) -> dict | None:
        if not self._up:
            return None
        try:
            text = await self._call(self._redis.get, f"{self.prefix}trace:{request_id}")
        except _DOWN:
            return None
        return None if text is None else json.loads(text)

    async def spend(self) -> dict | None:
        """Every replica's spend, shaped as the ledger's snapshot shapes its own; None while the store is away."""
        if not self._up:
            return None

        async def read() -> list:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self._spend)
                pipe.hgetall(self._window[2])
                pipe.llen(self._window[1])
                return await pipe.execute()

        try:
            totals, sums, size = await self._call(read)
        except _DOWN:
            return None
        endpoints: dict[str, dict[str, Any]] = {}
        for field, value in totals.items():
            name, dot, what = field.rpartition(".")
            if dot:
                endpoints.setdefault(name, {})[what] = int(value)
        for entry in endpoints.values():
            entry["cost_usd"] = entry.get("cost_micro", 0) / MICRO
        win_input, win_constrained = int(sums.get("input", 0)), int(sums.get("constrained", 0))
        return {
            "requests": int(totals.get("requests", 0)),
            "cost_usd": int(totals.get("cost_micro", 0)) / MICRO,
            "cost_micro": int(totals.get("cost_micro", 0)),
            "endpoints": endpoints,
            "window": {
                "size": self._ledger.window,
                "requests": int(size),
                "input_tokens": win_input,
                "constrained_input_tokens": win_constrained,
                "realised_budget": win_constrained / win_input if win_input else None,
            },
        }

    def condition(self) -> str:
        if not self._up:
            return "lost"
        return "degraded" if self._problems else "connected"

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "url": _no_secret(self.url),
            "connected": self._up,
            "state": self.condition(),
            "problems": [f"{where}: {problem}" for where, problem in self._problems.items()],
            "on_store_loss": self.on_store_loss,
            "pending": len(self._pending),
            "traces_pending": len(self._traces),
            "traces_dropped": self.traces_dropped,
        }
