"""A replica that dies mid-stream, on one real Redis-protocol server shared by two real gateway replicas.

Real parts: two `tandem serve` processes (the SmolLM2 device model each), a slow scripted OpenAI-compatible cloud
on loopback (tests/integration/scripted_upstream.py: one token every `GAP` seconds), a real Valkey/Redis server
(tests/integration/store_helpers.py), the `openai` SDK as client, SIGKILL. What must hold (docs/fleet.md, "A
replica crash"): a running stream books what it delivered every `settle_seconds`, into the spend and its key's
books, and the bookings of a finished stream add up to exactly what one booking at its end would be; a replica
SIGKILLed mid-stream has booked all its streams delivered but their last settle interval's tokens, and the holds it
took lapse within `settle_seconds + hold_seconds`, so the other replica admits the key's streams again.

No bound here is a guess at how fast the machine is. What must happen is waited for (with a deadline far past it);
what must not happen is checked against events, each settle interval widened by the slowness this run measured (the
longest a token came late) and by a booking's trip to the store: two bookings the store got are no further apart
than an interval (bounded from below by the polls that saw them); "the last interval's tokens" are the tokens each
stream received in the interval before the kill; a hold that had to lapse is one that no refusal started after the
bound.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.scripted_upstream import Answer, ScriptedUpstream
from tests.integration.store_helpers import StoreServer

ADMIN = "crash-admin"
KEY, KEY_NAME = "key-crash-streams", "streams"
MAX_STREAMS = 4
SETTLE, HOLD = 1.0, 4.0  # [state] settle_seconds, hold_seconds
GAP = 0.1  # seconds between two of the cloud's tokens: ten tokens a settle interval
TRIP = 0.25  # seconds allowed for a booking's trip to the store (milliseconds on loopback, when nothing is slow)
PATIENCE = 60.0  # seconds to wait for what must happen on a loaded machine; never a bound on how fast
PRICE_PREFILL, PRICE_DECODE = 150, 600  # USD per 1M tokens: micro-dollars per token
PROMPT = [{"role": "user", "content": "What is the answer?"}]


def config(upstream: ScriptedUpstream, store: StoreServer, prefix: str) -> str:
    return f"""
[gateway]
policy = "cloud"
cloud = "cloud"
state_file = ""
stall_timeout = 60
admin_keys = ["{ADMIN}"]
api_keys = [{{ key = "{KEY}", name = "{KEY_NAME}", max_streams = {MAX_STREAMS} }}]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
n_threads = 1
[disco]
profile_device = false
migration = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
[clouds.cloud.price]
prefill_per_million = {PRICE_PREFILL}
decode_per_million = {PRICE_DECODE}
[state]
backend = "valkey"
url = "{store.url}"
key_prefix = "{prefix}"
poll_seconds = 0.5
timeout = 0.5
settle_seconds = {SETTLE}
hold_seconds = {HOLD}
"""


@pytest.fixture(scope="module")
def replicas(upstream: ScriptedUpstream, store_server: StoreServer) -> Iterator[list[GatewayProcess]]:
    text = config(upstream, store_server, f"t{uuid.uuid4().hex[:8]}:")
    started: list[GatewayProcess] = []
    try:
        for _ in range(2):
            started.append(start_gateway(text, wait_for=("device", "cloud")))
        yield started
    finally:
        for gw in started:
            stop_gateway(gw)


def budget(gw: GatewayProcess) -> dict:
    r = httpx.get(gw.v1 + "/budget", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def books(gw: GatewayProcess) -> dict[str, int]:
    """The store's books as `gw` reads them: the cloud's tokens and cost, every request's, and the key's spend."""
    view = budget(gw)
    cloud = view["spend"]["endpoints"].get("cloud", {})
    [line] = [k for k in view["keys"] if k["name"] == KEY_NAME]
    assert line["source"] == "shared"
    return {
        "requests": view["spend"]["requests"],
        "input_tokens": view["spend"]["window"]["input_tokens"],
        "prefill": cloud.get("prefill_tokens", 0),
        "decode": cloud.get("decode_tokens", 0),
        "cost_micro": view["spend"]["cost_micro"],
        "key_micro": line["spent_micro"],
        "pending": view["store"]["pending"],
    }


def change(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if k != "pending"}


def slow_answer(tokens: int) -> Answer:
    return Answer(pieces=(" tick",) * tokens, gap=GAP)


class Stream:
    """One streamed answer read as it comes: the tokens received, and the usage when it ends."""

    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.received = 0
        self.arrivals: list[float] = []  # time.monotonic() of each token received
        self.usage = None
        self.ended = asyncio.Event()

    async def read(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.gw.v1, api_key=KEY, max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="tandem",
                messages=PROMPT,
                max_tokens=200,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    self.usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    self.received += 1
                    self.arrivals.append(time.monotonic())
        except (openai.APIError, httpx.HTTPError):
            pass  # its replica was killed: what it received is what it got
        finally:
            self.ended.set()
            await client.close()


async def until(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def settled(gw: GatewayProcess) -> dict[str, int]:
    """`gw`'s view of the books once its own bookings have all reached the store."""
    deadline = time.monotonic() + PATIENCE
    while (seen := books(gw))["pending"]:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    return seen


def lateness(stream: Stream) -> float:
    """The measured slowness of this run: the longest a token of `stream` came later than the cloud's pace (the
    gateway, its event loop and this client all on the same loaded cores; a booking due then was as late)."""
    return max(0.0, max(t1 - t0 for t0, t1 in itertools.pairwise(stream.arrivals)) - GAP)


def test_a_stream_is_booked_every_settle_interval_and_its_bookings_add_up_exactly(replicas, upstream):
    a, b = replicas
    tokens = 80  # eight seconds: eight settle intervals
    upstream.push(slow_answer(tokens))
    before = settled(a)

    async def run() -> tuple[Stream, list[tuple[float, float, dict[str, int]]]]:
        stream = Stream(a)
        task = asyncio.create_task(stream.read())
        polls = []  # while the stream runs: (asked, answered, the store's books as the other replica reads them)
        while not stream.ended.is_set():
            asked = time.monotonic()
            seen = change(await asyncio.to_thread(books, b), before)
            polls.append((asked, time.monotonic(), seen))
            await asyncio.sleep(0.02)
        await task
        return stream, polls

    stream, polls = asyncio.run(run())
    assert stream.received == tokens and stream.usage.completion_tokens == tokens
    # Booked as it goes: before the end the store held part of the answer, in the spend and in the key's books.
    midway = [seen for _, _, seen in polls if 0 < seen["decode"] < tokens]
    assert midway and midway[-1]["key_micro"] > 0 and midway[-1]["requests"] == 1, polls[-3:]
    # Every settle interval: no two bookings the store got were further apart than one interval (widened by the run's
    # measured lateness and a booking's trip). The gap is bounded from below, however the polls fell: the later
    # booking came after the read of the last poll that did not see it, the earlier before the first that did.
    changed = [i for i in range(1, len(polls)) if polls[i][2]["decode"] != polls[i - 1][2]["decode"]]
    assert len(changed) >= 4, polls  # eight intervals, the first and last cut
    gaps = [polls[j - 1][0] - polls[i][1] for i, j in itertools.pairwise(changed)]
    assert max(gaps) <= SETTLE + lateness(stream) + TRIP, (gaps, lateness(stream))
    prompt = stream.usage.prompt_tokens
    booked = change(settled(a), before)
    # Several bookings, and together exactly one request's booking at its end: its cost rounded once.
    whole = prompt * PRICE_PREFILL + tokens * PRICE_DECODE
    assert booked == {
        "requests": 1,
        "input_tokens": prompt,
        "prefill": prompt,
        "decode": tokens,
        "cost_micro": whole,
        "key_micro": whole,
    }


def test_a_replica_killed_mid_stream_has_booked_what_it_delivered_and_its_holds_lapse(replicas, upstream):
    a, b = replicas
    tokens = 600  # a minute each: they are cut long before the end
    upstream.push(*(slow_answer(tokens) for _ in range(MAX_STREAMS)))
    before, b_before = settled(b), budget(b)["spend_here"]

    async def run() -> tuple[list[Stream], float, list[float]]:
        streams = [Stream(a) for _ in range(MAX_STREAMS)]
        tasks = [asyncio.create_task(s.read()) for s in streams]
        # Three settle intervals in: every stream has booked several times.
        await until(lambda: all(s.received >= 3 * SETTLE / GAP for s in streams), PATIENCE, "the streams did not start")
        # The key's streams are all on A: B refuses another while they run.
        with pytest.raises(openai.RateLimitError):
            await ask(b)
        killed = time.monotonic()
        os.killpg(a.process.pid, signal.SIGKILL)
        await asyncio.gather(*tasks)
        # B admits the key's streams again once A's holds lapse: each refusal's start is kept, to be checked below.
        refused: list[float] = []
        while True:
            tried = time.monotonic()
            try:
                await ask(b)
                break
            except openai.RateLimitError:
                refused.append(tried)
                assert tried - killed < PATIENCE, "A's holds never lapsed"
                await asyncio.sleep(0.1)
        return streams, killed, refused

    streams, killed, refused = asyncio.run(run())
    a.process.wait(10)
    # The holds lapsed within settle_seconds + hold_seconds of the crash: no refusal started after that.
    assert all(t - killed <= SETTLE + HOLD for t in refused), [round(t - killed, 2) for t in refused]
    received = sum(s.received for s in streams)
    # What each stream may have lost: the tokens it received in the settle interval before the kill (its last booking
    # was at most that long before), widened by this run's measured slowness (the longest a token came later than the
    # cloud's pace: a booking due then was as late) and a booking's trip to the store.
    since = killed - SETTLE - max(lateness(s) for s in streams) - TRIP
    last_interval = sum(sum(t > since for t in s.arrivals) for s in streams)
    assert all(s.usage is None for s in streams)  # every stream was cut
    booked = change(settled(b), before)
    mine, b_after = b_before, budget(b)["spend_here"]  # less B's own answer since, booked by B
    b_cloud, b_cloud_before = b_after["endpoints"]["cloud"], mine["endpoints"].get("cloud", {})
    b_cost = b_after["cost_micro"] - mine["cost_micro"]
    for field, value in (
        ("requests", b_after["requests"] - mine["requests"]),
        ("input_tokens", b_after["window"]["input_tokens"] - mine["window"]["input_tokens"]),
        ("prefill", b_cloud["prefill_tokens"] - b_cloud_before.get("prefill_tokens", 0)),
        ("decode", b_cloud["decode_tokens"] - b_cloud_before.get("decode_tokens", 0)),
        ("cost_micro", b_cost),
        ("key_micro", b_cost),
    ):
        booked[field] -= value
    assert b_after["requests"] - mine["requests"] == 1
    # What A booked: every cut stream's prompt, and all the tokens they received but their last interval's, never
    # more than it sent (a token each may have been written and not read).
    assert received - last_interval <= booked["decode"] <= received + MAX_STREAMS, (booked, received, last_interval)
    assert booked["requests"] == MAX_STREAMS and booked["prefill"] == booked["input_tokens"] > 0
    assert booked["cost_micro"] == booked["prefill"] * PRICE_PREFILL + booked["decode"] * PRICE_DECODE
    # The key's books: settled by the same intervals (a partial settlement each), so they too miss at most the last
    # interval's tokens, and never hold more than the spend.
    floor = booked["prefill"] * PRICE_PREFILL + (received - last_interval) * PRICE_DECODE
    assert floor <= booked["key_micro"] <= booked["cost_micro"], (booked, received, last_interval)


async def ask(gw: GatewayProcess) -> None:
    """One short answer under the key (the upstream's default answer)."""
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=KEY, max_retries=0)
    try:
        await client.chat.completions.create(model="tandem", messages=PROMPT, max_tokens=20)
    finally:
        await client.close()
