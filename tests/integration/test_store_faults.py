"""The shared store's faults, on real processes (issue 37, items 1-3).

Real parts: a Redis-protocol server of this module's own (tests/integration/store_helpers.py; these tests restart it
and write to it as a newer release would, so not the session's), two `tandem serve` replicas on it (A:
`on_store_loss = "local"`, B: "closed"), a scripted OpenAI-compatible cloud on loopback, the `openai` SDK; and
ValkeyStore itself on a real server, for what a gateway's answers cannot show alone.

What must hold: after a restart every call finds the store again: no request on a "closed" replica is refused once
the store answers, and no second loss is declared (1). Settings this release cannot read leave a replica degraded
and saying so (GET /v1/budget, /health, /metrics), serving on its last good settings with its bookings still reaching
the store, until a readable version is written, by a PUT or by a replica that knows the field; fields a newer
release added are read past and kept (2). The background task survives any failure, says so, and recovers (2).
Traces written while the store is away are replayed to it, the queue's overflow counted and said (3). Running
requests' partial settlements wait through an outage as one op per request and add up on the store after it (4).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
import redis

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from app.serving.budget import SETTING_FIELDS, BudgetSettings, Price
from app.serving.ledger import Booking, Ledger
from app.serving.limits import Admission, KeyLimits
from app.serving.valkey_state import ValkeyStore
from tests.integration.scripted_upstream import ScriptedUpstream
from tests.integration.store_helpers import StoreServer, replica_config

ADMIN = "faults-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = [{"role": "user", "content": "What is the answer?"}]
TRACE_QUEUE = 3  # replica A's bound on the traces that wait for the store
T = TypeVar("T")
PATIENCE = 60.0  # seconds to wait for what must happen (a loaded 2-core machine); never a bound on how fast
# The store client's deadline for one call. A stopped store refuses connections at once, so no loss here waits for
# it; a store that answers never reaches it, so the tests that count losses exactly cannot see a spurious one when a
# loaded machine delays a reply (at 0.5 s one could: a PING that took longer was a loss).
STORE_TIMEOUT = 5.0


def with_store_timeout(config: str) -> str:
    """A replica's config (store_helpers.replica_config) with the store client's deadline at STORE_TIMEOUT."""
    assert config.count("\ntimeout = 0.5\n") == 1, config
    return config.replace("\ntimeout = 0.5\n", f"\ntimeout = {STORE_TIMEOUT}\n")


def wait_for(what: Callable[[], object], message: str, timeout: float = PATIENCE) -> object:
    deadline = time.monotonic() + timeout
    while not (seen := what()):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
    return seen


@pytest.fixture(scope="module")
def store() -> Iterator[StoreServer]:
    server = StoreServer()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"f{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def replicas(upstream: ScriptedUpstream, store: StoreServer, prefix: str) -> Iterator[list[GatewayProcess]]:
    """A: "local", at most TRACE_QUEUE traces waiting; B: "closed"."""
    configs = [
        replica_config(upstream.base_url, store, prefix, "local", ADMIN, state=f"trace_queue = {TRACE_QUEUE}"),
        replica_config(upstream.base_url, store, prefix, "closed", ADMIN),
    ]
    configs = [with_store_timeout(text) for text in configs]
    started: list[GatewayProcess] = []
    try:
        for text in configs:
            started.append(start_gateway(text, wait_for=("device", "cloud")))
        yield started
    finally:
        for gw in started:
            stop_gateway(gw)


def budget(gw: GatewayProcess) -> dict:
    r = httpx.get(gw.v1 + "/budget", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def settled(gws: list[GatewayProcess]) -> list[dict]:
    """Each replica's budget once all it queued (bookings and traces) is on the store."""

    def done() -> bool:
        stores = [budget(gw)["store"] for gw in gws]
        return all(s["connected"] and s["pending"] == 0 and s["traces_pending"] == 0 for s in stores)

    wait_for(done, "the replicas' queues never emptied")
    return [budget(gw) for gw in gws]  # read again: another replica's replay may have ended after the first view


def losses(gw: GatewayProcess) -> int:
    return Path(gw.log_path).read_text().count(" lost (")


async def ask(gw: GatewayProcess, model: str = "cloud") -> tuple[int, dict[str, str]]:
    """One chat request naming `model` ("cloud": a refusal to use it is a 503, never a quiet answer elsewhere)."""
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=PROMPT, max_tokens=4, temperature=0
        )
        assert raw.parse().choices[0].message.content
        return raw.status_code, dict(raw.headers)
    except openai.APIStatusError as exc:
        return exc.status_code, dict(exc.response.headers)
    finally:
        await client.close()


async def burst(gw: GatewayProcess, count: int) -> list[tuple[int, dict[str, str]]]:
    return await asyncio.gather(*(ask(gw) for _ in range(count)))


def spend_delta(after: list[dict], before: list[dict]) -> tuple[dict, dict]:
    """What the store booked between two settled views, and what the replicas booked themselves meanwhile."""
    store = {f: after[0]["spend"][f] - before[0]["spend"][f] for f in ("requests", "cost_micro")}
    own = {f: sum(a["spend_here"][f] - b["spend_here"][f] for a, b in zip(after, before, strict=True)) for f in store}
    return store, own


# -- 1. a restarted store ----------------------------------------------------------------------------------------------
def test_a_store_restarted_under_concurrent_cloud_requests_refuses_none_on_a_closed_replica_once_it_answers(
    replicas, store
):
    """The issue's run: 3-4 of 8 concurrent cloud requests got 503 store_unavailable after a restart, and the log
    showed a second loss: connections opened before the restart stayed in the pool and failed their first command."""
    _, b = replicas
    assert [s for s, _ in asyncio.run(burst(b, 8))] == [200] * 8  # the pool holds connections for 8 at once
    settled([b])
    lost_before = losses(b)
    store.stop()
    wait_for(lambda: not budget(b)["store"]["connected"], "B never noticed the store was lost")
    assert asyncio.run(ask(b))[0] == 503  # "closed": a request naming the cloud is refused while it is away
    store.start()  # empty: persistence is off
    wait_for(lambda: budget(b)["store"]["connected"], "B never found the store again")
    for _ in range(3):  # rounds of 8 at once: each takes connections from the pool
        results = asyncio.run(burst(b, 8))
        assert [s for s, _ in results] == [200] * 8, [s for s, _ in results]
        assert {h["x-tandem-backend"] for _, h in results} == {"cloud"}
    settled([b])
    assert losses(b) == lost_before + 1  # the one outage, and nothing after it


@pytest.mark.parametrize("noticed", [True, False], ids=["loss-noticed", "restart-between-calls"])
def test_after_a_restart_concurrent_calls_on_the_store_client_all_find_it(noticed, caplog):
    """ValkeyStore alone, "closed": the issue's `may_spend()` x4 gave [True, False, False, False] after a restart.
    Whether its background task noticed the outage or the store restarted between two of its polls, every call
    after the restart finds the store (admissions too: the restarted store, empty, has the library back)."""
    server = StoreServer()
    server.start()
    key = KeyLimits("restarts", rpm=1000)

    async def scenario() -> None:
        ledger = Ledger(None, BudgetSettings(prices={"cloud": Price(1.0, 2.0)}))
        poll = 0.2 if noticed else 3600.0
        store = ValkeyStore(ledger, server.url, "r:", "closed", poll_seconds=poll, timeout=STORE_TIMEOUT)
        await store.start()
        try:
            assert await bounded(*(store.may_spend() for _ in range(8))) == [True] * 8
            server.stop()
            if noticed:
                await until(lambda: not store.describe()["connected"])
            await asyncio.to_thread(server.start)
            if noticed:
                await until(lambda: store.describe()["connected"])
            assert await bounded(*(store.may_spend() for _ in range(8))) == [True] * 8
            verdicts = await bounded(*(store.admit(key, f"a{i}", time.time(), 10) for i in range(8)))
            assert [(v.status, shared) for v, shared in verdicts] == [("ok", True)] * 8
            assert store.describe()["state"] == "connected"
        finally:
            await asyncio.wait_for(store.close(), PATIENCE)

    caplog.set_level(logging.WARNING, logger="app.serving.valkey_state")
    try:
        asyncio.run(scenario())
    finally:
        server.close()
    lost = [r for r in caplog.records if " lost (" in r.getMessage()]
    assert len(lost) == (1 if noticed else 0), [r.getMessage() for r in lost]


def test_a_running_requests_progress_waits_as_one_op_through_an_outage_and_adds_up_on_replay():
    """ValkeyStore alone, "local": the partial settlements of running requests (one every settle period) while the
    store is away wait as one queued op per request, however many periods pass — each added into the request's
    waiting one — and once the store is back (restarted empty) it holds exactly their sum."""
    server = StoreServer()
    server.start()
    key = KeyLimits("progress", rpm=1000)

    async def scenario() -> None:
        ledger = Ledger(None, BudgetSettings(prices={"cloud": Price(1.0, 2.0)}))
        store = ValkeyStore(ledger, server.url, "p:", "local", poll_seconds=0.2, timeout=STORE_TIMEOUT)
        await store.start()
        try:
            now = time.time()
            running = []
            for name in ("run-1", "run-2"):
                verdict, shared = await store.admit(key, name, now, 5000)
                assert verdict.status == "ok" and shared
                running.append(Admission(name, key, 5000, verdict, now, shared))
            server.stop()
            await until(lambda: not store.describe()["connected"])
            waiting = store.describe()["pending"]
            for period in range(1, 11):
                store.progress(running[0], 100, 3, now + 2 * period)
                store.progress(running[1], -7, 1, now + 2 * period)  # a usage report that corrected our count
            assert store.describe()["pending"] == waiting + 2  # one per running request, not one per period
            await asyncio.to_thread(server.start)
            await until(lambda: store.describe()["connected"] and store.describe()["pending"] == 0)
            [line] = await store.key_usage([key], now)
            assert line["source"] == "shared"
            assert (line["spent_micro"], line["tokens_this_minute"]) == (10 * 100 - 10 * 7, 10 * 3 + 10 * 1)
        finally:
            await asyncio.wait_for(store.close(), PATIENCE)

    try:
        asyncio.run(scenario())
    finally:
        server.close()


async def bounded(*calls: Awaitable[T]) -> list[T]:
    """The calls at once, failing (not hanging) if they have not all ended within PATIENCE."""
    return await asyncio.wait_for(asyncio.gather(*calls), PATIENCE)


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


# -- 2. settings this release cannot read ------------------------------------------------------------------------------
def write_settings(store: StoreServer, prefix: str, settings: dict) -> int:
    """A budget change as another replica makes it (a newer release's): the store's compare-and-set, published."""
    r = redis.Redis.from_url(store.url, decode_responses=True)
    key = f"{prefix}{{ledger}}:budget"
    version = int(r.hget(key, "version") or 0)
    swapped = r.fcall("tandem_budget_swap", 1, key, version, json.dumps(settings), f"{prefix}budget")
    assert swapped == version + 1
    return swapped


def stored_settings(store: StoreServer, prefix: str) -> dict:
    r = redis.Redis.from_url(store.url, decode_responses=True)
    return json.loads(r.hget(f"{prefix}{{ledger}}:budget", "settings"))


def seen_by_all(gws: list[GatewayProcess], check: Callable[[dict], bool], message: str) -> list[dict]:
    wait_for(lambda: all(check(budget(gw)) for gw in gws), message)
    return [budget(gw) for gw in gws]


def test_settings_a_newer_release_wrote_are_read_past_or_leave_replicas_degraded_until_repaired(
    replicas, store, prefix
):
    a, b = replicas
    before = settled(replicas)
    current = {f: before[0][f] for f in SETTING_FIELDS}
    newer = {**current, "budget": 0.35, "surge": {"multiplier": 2}}  # a field this release does not know

    # A newer release's settings: its field is read past (with a warning) and kept in the store.
    version = write_settings(store, prefix, newer)
    views = seen_by_all(replicas, lambda v: v["version"] == version, "the newer settings were not adopted")
    assert [(v["budget"], v["store"]["state"]) for v in views] == [(0.35, "connected")] * 2
    assert all("ignoring surge" in Path(gw.log_path).read_text() for gw in replicas)
    r = httpx.put(b.v1 + "/budget", json={"budget": 0.4}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert stored_settings(store, prefix) == {**newer, "budget": 0.4}  # the newer field survived an older PUT
    r = httpx.put(b.v1 + "/budget", json={"surge": 3}, headers=AUTH, timeout=30)  # a client's own typo stays a 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "surge", r.text
    good = seen_by_all(replicas, lambda v: v["budget"] == 0.4, "the PUT was not seen")[0]["version"]

    def degrade() -> int:
        """Settings this release cannot read (a policy it does not have): both replicas stay on version `good`'s,
        degraded and saying so, their bookings still reaching the store."""
        unreadable = write_settings(store, prefix, {**newer, "policy": "disco-next", "budget": 0.2})
        views = seen_by_all(replicas, lambda v: v["store"]["state"] == "degraded", "no replica said it is degraded")
        for view in views:
            assert (view["version"], view["budget"], view["policy"]) == (good, 0.4, current["policy"])
            [problem] = view["store"]["problems"]
            assert f"version {unreadable}" in problem and "policy" in problem, problem
        for gw in replicas:
            health = httpx.get(gw.url + "/health", timeout=30)
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert health.json()["store"]["state"] == "degraded"
            assert 'tandem_store_state{state="degraded"} 1.0' in httpx.get(gw.url + "/metrics", timeout=30).text
            assert "disco-next" in Path(gw.log_path).read_text()
        for gw in (a, b, a, b):  # served on the last good settings: the cloud, as policy "cloud" says
            status, headers = asyncio.run(ask(gw, model="tandem"))
            assert (status, headers["x-tandem-backend"]) == (200, "cloud")
        return unreadable

    # Repaired by a replica that knows the field: it writes a readable version.
    degrade()
    version = write_settings(store, prefix, {**newer, "budget": 0.25})
    views = seen_by_all(replicas, lambda v: v["version"] == version, "the repair was not adopted")
    assert [(v["budget"], v["store"]["state"], v["store"]["problems"]) for v in views] == [(0.25, "connected", [])] * 2
    assert all(httpx.get(gw.url + "/health", timeout=30).json() == {"status": "ok"} for gw in replicas)

    # Repaired by a PUT: the store's unreadable settings do not make it a 400; it patches the last good ones.
    good = version
    httpx.put(b.v1 + "/budget", json={"budget": 0.4}, headers=AUTH, timeout=30).raise_for_status()
    good += 1
    degrade()
    r = httpx.put(a.v1 + "/budget", json={"budget": 0.3}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    views = seen_by_all(replicas, lambda v: v["version"] == r.json()["version"], "the PUT was not adopted")
    assert [(v["budget"], v["policy"], v["store"]["state"]) for v in views] == [
        (0.3, current["policy"], "connected")
    ] * 2
    assert stored_settings(store, prefix) == {**current, "budget": 0.3, "surge": {"multiplier": 2}}

    # The books: every request of the test is on the store, once.
    after = settled(replicas)
    on_store, booked = spend_delta(after, before)
    assert on_store == booked and on_store["requests"] == 8
    httpx.put(a.v1 + "/budget", json={"budget": current["budget"]}, headers=AUTH, timeout=30).raise_for_status()


def test_the_store_loop_survives_a_failure_it_did_not_expect_says_so_and_recovers(tmp_path, caplog):
    """Its replica's budget state file cannot be written (its folder is a file), so adopting settings another
    replica wrote fails: the loop logs it, says degraded, keeps sending bookings, and adopts them once it can."""
    server = StoreServer()
    server.start()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")

    async def scenario() -> None:
        ledger = Ledger(blocker / "budget.json", BudgetSettings(prices={"cloud": Price(1.0, 2.0)}))
        store = ValkeyStore(ledger, server.url, "s:", poll_seconds=0.2, timeout=STORE_TIMEOUT)
        await store.start()
        try:
            changed = {**ledger.settings.to_dict(), "budget": 0.7}
            version = await asyncio.to_thread(write_settings, server, "s:", changed)
            await until(lambda: store.describe()["state"] == "degraded")
            [problem] = store.describe()["problems"]
            assert "cannot write budget state file" in problem
            for i in range(3):
                store.book(Booking(f"r{i}", "cloud", True, True, 10, 2, 1000 + i, 10, 10))
            await until(lambda: store.describe()["pending"] == 0)  # bookings go on while it is degraded
            assert ledger.version != version
            blocker.unlink()
            await until(lambda: store.describe()["state"] == "connected")
            assert (ledger.version, ledger.settings.budget) == (version, 0.7)
            spend = await store.spend()
            assert spend is not None and (spend["requests"], spend["cost_micro"]) == (3, 3003)
        finally:
            await asyncio.wait_for(store.close(), PATIENCE)

    caplog.set_level(logging.INFO, logger="app.serving.valkey_state")
    try:
        asyncio.run(scenario())
    finally:
        server.close()
    said = [r for r in caplog.records if "degraded" in r.getMessage()]
    assert said and said[0].exc_info is not None  # logged with its traceback, not swallowed
    assert any("works again" in r.getMessage() for r in caplog.records)


# -- 3. traces of an outage --------------------------------------------------------------------------------------------
def test_traces_written_while_the_store_is_away_are_replayed_the_overflow_counted(replicas, store):
    a, b = replicas
    before = settled(replicas)
    dropped = before[0]["store"]["traces_dropped"]
    store.stop()
    try:
        wait_for(lambda: not budget(a)["store"]["connected"], "A never noticed the store was lost")
        ids = []
        for _ in range(TRACE_QUEUE + 2):
            status, headers = asyncio.run(ask(a))
            assert status == 200
            ids.append(headers["x-request-id"])
        view = budget(a)["store"]
        assert view["traces_pending"] == TRACE_QUEUE and view["traces_dropped"] == dropped + 2
        assert view["pending"] >= TRACE_QUEUE + 2  # every booking waits: none dropped for a trace
        assert "the oldest are dropped" in Path(a.log_path).read_text()
    finally:
        store.start()  # empty: persistence is off
    after = settled(replicas)
    auth = {"Authorization": "Bearer unused"}
    found = [httpx.get(f"{b.v1}/requests/{i}", headers=auth, timeout=30).status_code for i in ids]
    assert found == [404] * 2 + [200] * TRACE_QUEUE  # the newest waited and were replayed; the two oldest dropped
    assert after[0]["spend"]["requests"] == after[0]["spend_here"]["requests"] - before[0]["spend_here"]["requests"]
    assert after[0]["spend"]["requests"] == TRACE_QUEUE + 2  # the restarted store has every booking of the outage
