"""A replica that dies mid-stream, on one real Redis-protocol server shared by two real gateway replicas.

Real parts: two `tandem serve` processes (the SmolLM2 device model each), a slow scripted OpenAI-compatible cloud
on loopback (tests/integration/scripted_upstream.py: one token every `GAP` seconds), a real Valkey/Redis server
(tests/integration/store_helpers.py), the `openai` SDK as client, SIGKILL. What must hold (docs/fleet.md, "A
replica crash"): a running stream books what it delivered every `settle_seconds`, into the spend and its key's
books, and the bookings of a finished stream add up to exactly what one booking at its end would be; a replica
SIGKILLed mid-stream has booked all its streams delivered but the last interval or so, and the holds it took lapse
within a few leases (`hold_seconds`), so the other replica admits the key's streams again.
"""

from __future__ import annotations

import asyncio
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
GAP = 0.5  # seconds between two of the cloud's tokens: two tokens a settle interval
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
    deadline = time.monotonic() + 10
    while (seen := books(gw))["pending"]:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    return seen


def test_a_stream_is_booked_as_it_goes_and_its_bookings_add_up_exactly(replicas, upstream):
    a, b = replicas
    tokens = 16  # eight seconds: eight settle intervals
    upstream.push(slow_answer(tokens))
    before = settled(a)

    async def run() -> tuple[Stream, dict[str, int]]:
        stream = Stream(a)
        task = asyncio.create_task(stream.read())
        # Half way through, the store already holds what was delivered, less an interval or two: in the spend, and
        # in the key's books, read on the other replica.
        await until(lambda: stream.received >= tokens // 2, 60, "the stream did not get half way")
        deadline = time.monotonic() + 4 * SETTLE
        while (midway := change(books(b), before))["decode"] < stream.received - 2 * SETTLE / GAP:
            assert time.monotonic() < deadline and not stream.ended.is_set(), (midway, stream.received)
            await asyncio.sleep(0.1)
        assert midway["key_micro"] > 0 and midway["requests"] == 1
        await task
        return stream, midway

    stream, midway = asyncio.run(run())
    assert stream.received == tokens and stream.usage.completion_tokens == tokens
    assert midway["decode"] < tokens  # booked before the end
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
    tokens = 120  # a minute each: they are cut long before the end
    upstream.push(*(slow_answer(tokens) for _ in range(MAX_STREAMS)))
    before, b_before = settled(b), budget(b)["spend_here"]

    async def run() -> tuple[list[Stream], float, float]:
        streams = [Stream(a) for _ in range(MAX_STREAMS)]
        tasks = [asyncio.create_task(s.read()) for s in streams]
        await until(lambda: all(s.received >= 12 for s in streams), 120, "the streams did not start")
        # The key's streams are all on A: B refuses another while they run.
        with pytest.raises(openai.RateLimitError):
            await ask(b)
        os.killpg(a.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.gather(*tasks)
        # B admits the key's streams again once A's holds lapse: within a few leases, not at the period's end.
        while True:
            try:
                await ask(b)
                break
            except openai.RateLimitError:
                assert time.monotonic() - killed < 4 * HOLD, "A's holds did not lapse"
                await asyncio.sleep(0.2)
        return streams, killed, time.monotonic()

    streams, killed, admitted = asyncio.run(run())
    a.process.wait(10)
    received = sum(s.received for s in streams)
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
    # What A booked: every cut stream's prompt, and all the tokens they received but at most about an interval's
    # each (two here, for a loaded machine), never more than it sent.
    per_interval = SETTLE / GAP
    assert booked["requests"] == MAX_STREAMS and booked["prefill"] == booked["input_tokens"] > 0
    assert received - MAX_STREAMS * 2 * per_interval <= booked["decode"] <= received + MAX_STREAMS, (booked, received)
    assert booked["cost_micro"] == booked["prefill"] * PRICE_PREFILL + booked["decode"] * PRICE_DECODE
    # The key's books: settled by the same intervals, at most one behind the spend.
    lag = MAX_STREAMS * 2 * per_interval * PRICE_DECODE
    assert booked["cost_micro"] - lag <= booked["key_micro"] <= booked["cost_micro"], booked
    assert admitted - killed < 4 * HOLD


async def ask(gw: GatewayProcess) -> None:
    """One short answer under the key (the upstream's default answer)."""
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=KEY, max_retries=0)
    try:
        await client.chat.completions.create(model="tandem", messages=PROMPT, max_tokens=20)
    finally:
        await client.close()
