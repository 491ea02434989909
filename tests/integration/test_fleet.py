"""Two gateway replicas on one real Redis-protocol server (`[state] backend = "valkey"`).

Real parts: two `tandem serve` processes (the SmolLM2 device model each), a scripted OpenAI-compatible cloud on
loopback, a real Valkey/Redis server started for the session (tests/integration/store_helpers.py), the `openai`
SDK as client. What must hold across replicas: a budget PUT on one is seen by the other (by pub/sub, or at its
next poll of the version); the
realised budget of requests split over both stays within ±3 % of b; a trace
is served by the replica that did not serve it; the spend each booked adds up on the store to exactly what both
report; a replica started later begins with the cloud TTFT samples the others measured; a key's dollar cap and its
requests-per-minute hold whichever replica serves; and when the store is
lost, "local" keeps using the cloud, "closed" answers on the device, nothing fails, and the books reconcile once
the store is back. The store-loss test runs last: it restarts the store, which forgets everything.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from pydantic import SecretStr

from app.config import key_label
from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.scripted_upstream import ScriptedUpstream
from tests.integration.store_helpers import StoreServer

ADMIN = "fleet-admin"
PLAIN, CAPPED, REJECTING, LIMITED = "key-plain", "key-capped", "key-reject", "key-rpm"
CAP_USD = 0.245  # ~31 cloud answers of ~$0.0077 (35 prompt tokens at $150/M, 4 answer tokens at $600/M)
MAX_TOKENS = 4  # = the capped keys' reserve_tokens: a reservation covers a whole answer
PROMPT = [{"role": "user", "content": "What is the answer?"}]


def config(upstream: ScriptedUpstream, store: StoreServer, prefix: str, on_loss: str) -> str:
    return f"""
[gateway]
policy = "cloud"
cloud = "cloud"
state_file = ""
stall_timeout = 60  # the device's first answer on a loaded 2-core machine
admin_keys = ["{ADMIN}"]
api_keys = [
  "{PLAIN}",
  {{ key = "{CAPPED}", name = "capped", cap_usd = {CAP_USD}, at_cap = "device", reserve_tokens = {MAX_TOKENS} }},
  {{ key = "{REJECTING}", name = "rejecting", cap_usd = 0.01, at_cap = "reject", reserve_tokens = {MAX_TOKENS} }},
  {{ key = "{LIMITED}", name = "limited", rpm = 4 }},
]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
n_threads = 1  # two replicas (and the suite) share the cores: llama.cpp's threads would wait on each other
[disco]
profile_device = false
migration = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
[clouds.cloud.price]
prefill_per_million = 150.0
decode_per_million = 600.0
[state]
backend = "valkey"
url = "{store.url}"
key_prefix = "{prefix}"
on_store_loss = "{on_loss}"
poll_seconds = 0.5
timeout = 0.5
"""


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def replicas(upstream: ScriptedUpstream, store_server: StoreServer, prefix: str) -> Iterator[list[GatewayProcess]]:
    """Replica A keeps serving on local counts when the store is lost; replica B refuses paid clouds then."""
    configs = [config(upstream, store_server, prefix, loss) for loss in ("local", "closed")]
    started: list[GatewayProcess] = []
    try:
        for text in configs:
            started.append(start_gateway(text, wait_for=("device", "cloud")))
        yield started
    finally:
        for gw in started:
            stop_gateway(gw)


def budget(gw: GatewayProcess) -> dict:
    r = httpx.get(gw.v1 + "/budget", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


# How long a wait for something the replicas do in the background (a booking reaching the store, a change heard)
# may take before the test calls it lost: far beyond what a loaded 2-core machine needs (a second or two), so only a
# hang reaches it. The waits themselves end as soon as the thing is seen.
PATIENCE = 60.0


def eventually(probe, done, limit: float = PATIENCE):
    """probe() again until done(its value); that value. Fails with the last value after `limit` seconds."""
    deadline = time.monotonic() + limit
    while not done(value := probe()):
        assert time.monotonic() < deadline, value
        time.sleep(0.05)
    return value


def settled(gws: list[GatewayProcess]) -> list[dict]:
    """Each replica's budget once its bookings have all reached the store."""
    eventually(
        lambda: [budget(gw) for gw in gws],
        lambda views: all(v["store"]["connected"] and v["store"]["pending"] == 0 for v in views),
    )
    # Read again: a view taken before another replica's replay finished would miss what it replayed.
    return [budget(gw) for gw in gws]


async def ask(gw: GatewayProcess, key: str) -> tuple[int, dict[str, str]]:
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="tandem", messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        completion = raw.parse()
        assert completion.choices[0].message.content
        return raw.status_code, dict(raw.headers)
    except openai.APIStatusError as exc:
        return exc.status_code, dict(exc.response.headers)
    finally:
        await client.close()


async def spread(gws: list[GatewayProcess], key: str, count: int, at_once: int) -> list[tuple[int, dict]]:
    """`count` requests alternating over the replicas, `at_once` in flight."""
    gate = asyncio.Semaphore(at_once)

    async def one(i: int):
        async with gate:
            return await ask(gws[i % len(gws)], key)

    return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_budget_put_on_one_replica_is_seen_by_the_other(replicas):
    a, b = replicas
    before = budget(b)["version"]
    r = httpx.put(a.v1 + "/budget", json={"budget": 0.3}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["budget"] == 0.3 and r.json()["version"] > before
    seen = eventually(lambda: budget(b), lambda view: view["budget"] == 0.3)
    assert seen["version"] == r.json()["version"] and seen["settings_source"] == "the shared store"


SHORT = "Hi"
# Sixty tokens more. Every prompt begins with a number of its own (four digits, one token each: every prompt of a
# length has the same token count), so the device's prompt cache holds no prompt beyond the chat template's ~24
# tokens and a digit or two (DiSCo decides on the tokens the device would evaluate, docs/disco.md "Planning with
# caches": a prompt it had raced on and held whole would count as a short one). The long prompt's tokens past those
# stay well above the short one's whole length, the threshold Eq. 3 sets between the two.
LONG = (
    "Hi! Two gateway replicas answer my requests, one after the other, and both book what they spend on one shared "
    "store. Do they play the same budget, so that the share of my prompts' tokens that goes to the cloud is the share "
    "I set on either of them, and not twice it?"
)
_numbers = iter(range(10**9))


def numbered(text: str) -> list[dict]:
    """A prompt no earlier one begins like: its own number first (scrambled, so the next one differs at its first
    digit)."""
    return [{"role": "user", "content": f"{next(_numbers) * 7919 % 10_000:04d} {text}"}]


async def batches_on_both(gws: list[GatewayProcess], batches: int, policy: str = "disco-s") -> tuple[int, int]:
    """`batches` rounds of five short and five long prompts under `policy` on each replica at once, a round after the
    previous one ended; returns the two prompt lengths. A replica's policies recompute every 10 requests it sees
    (counted as they start, whatever their policy), so whenever they do it has seen as many short prompts as long
    ones."""
    clients = [openai.AsyncOpenAI(base_url=gw.v1, api_key=PLAIN, max_retries=0) for gw in gws]

    async def one(client: openai.AsyncOpenAI, text: str) -> int:
        answer = await client.chat.completions.create(
            model="tandem",
            messages=numbered(text),
            max_tokens=1,
            temperature=0,
            extra_body={"tandem": {"policy": policy}},
        )
        return answer.usage.prompt_tokens

    try:
        for _ in range(batches):
            lengths = await asyncio.gather(*(one(c, t) for c in clients for t in [SHORT, LONG] * 5))
        assert set(lengths[0::2]) == {lengths[0]} and set(lengths[1::2]) == {lengths[1]}
        return lengths[0], lengths[1]
    finally:
        for client in clients:
            await client.close()


def window(view: dict) -> tuple[int, int]:
    w = view["window"]
    return w["input_tokens"], w["constrained_input_tokens"]


def test_the_realised_budget_across_both_replicas_stays_within_3_percent_of_b(replicas):
    """DiSCo-S (server-constrained) with b set on one replica: the prompts shorter than its threshold stay on the
    device, the rest race, and the store's window (both replicas' bookings) shows the share b of input tokens on the
    cloud. Two prompt lengths in equal numbers, and b = L_long / (L_short + L_long): Eq. 3's threshold then falls
    between the two lengths, so each replica's choice is exact (no draw at a tie) once it has 20 length samples,
    and the realised ratio is b only if both replicas play the same b and the store adds up both windows."""
    a, b = replicas
    # 20 length samples on each replica, past the estimator's prior (the cloud answers: no device time spent on them)
    short, long_ = asyncio.run(batches_on_both(replicas, 2, policy="cloud"))
    target = long_ / (short + long_)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    # DiSCo-S as the replicas' policy: each makes its threshold from the 20 samples now (GET /v1/budget shows it), and
    # not from the samples at its first DiSCo-S request, which has counted itself already.
    r = httpx.put(a.v1 + "/budget", json={"budget": target, "policy": "disco-s"}, headers=admin)
    assert r.status_code == 200, r.text
    eventually(lambda: budget(b), lambda view: view["budget"] == target)  # B recomputes its threshold on hearing it
    before = settled(replicas)
    for view in before:  # Eq. 3's threshold between the two lengths: every short prompt on the device, no draw
        state = view["dispatch"]["policy_state"]
        assert state["l_th"] == short and state["tie_fraction"] > 1 - 1e-9, state
    try:
        asyncio.run(batches_on_both(replicas, 2))  # 40 requests, 20 on each replica
        after = settled(replicas)
    finally:
        httpx.put(a.v1 + "/budget", json={"budget": 0.3, "policy": "cloud"}, headers=admin)
    shared = [x - y for x, y in zip(window(after[0]["spend"]), window(before[0]["spend"]), strict=True)]
    here = [
        [x - y for x, y in zip(window(v["spend_here"]), window(w["spend_here"]), strict=True)]
        for v, w in zip(after, before, strict=True)
    ]
    assert shared[0] == 20 * (short + long_) and shared == [here[0][i] + here[1][i] for i in range(2)]
    realised = shared[1] / shared[0]
    assert abs(realised - target) <= 0.03, (realised, target, here)
    for mine in here:  # and each replica on its own: neither made up for the other
        assert abs(mine[1] / mine[0] - target) <= 0.03, (mine, target)


def test_a_trace_is_served_by_the_replica_that_did_not_serve_it(replicas):
    a, b = replicas
    status, headers = asyncio.run(ask(a, PLAIN))
    assert status == 200
    request_id = headers["x-request-id"]
    auth = {"Authorization": f"Bearer {PLAIN}"}
    r = eventually(  # A writes the trace to the store in the background, once the answer has ended
        lambda: httpx.get(f"{b.v1}/requests/{request_id}", headers=auth, timeout=10), lambda r: r.status_code != 404
    )
    assert r.status_code == 200 and r.json()["id"] == request_id
    assert [e["endpoint"] for e in r.json()["endpoints"]] == ["cloud"]
    assert httpx.get(f"{b.v1}/requests/nope-{request_id}", headers=auth, timeout=10).status_code == 404


def test_spend_split_over_both_replicas_adds_up_exactly_on_the_store(replicas):
    results = asyncio.run(spread(replicas, PLAIN, 40, 8))
    assert [s for s, _ in results] == [200] * 40
    a, b = settled(replicas)
    assert a["spend"] == b["spend"]  # both read the one book
    shared, here = a["spend"], [a["spend_here"], b["spend_here"]]
    assert here[0]["requests"] >= 20 and here[1]["requests"] >= 20
    for field in ("requests", "cost_micro"):
        assert shared[field] == here[0][field] + here[1][field], field
    for endpoint, totals in shared["endpoints"].items():
        for field in ("requests", "prefill_tokens", "decode_tokens", "cost_micro"):
            mine = sum(h["endpoints"].get(endpoint, {}).get(field, 0) for h in here)
            assert totals[field] == mine, (endpoint, field)
    for field in ("requests", "input_tokens", "constrained_input_tokens"):
        assert shared["window"][field] == here[0]["window"][field] + here[1]["window"][field], field
    # Spend per key (the dashboard's budget panel): the same on both replicas, read from the store. Every request so
    # far was PLAIN's (a key without limits: settled, never admitted), each answer one cloud booking.
    lines = [{k["name"]: k for k in view["keys"]} for view in (a, b)]
    plain = lines[0][key_label(SecretStr(PLAIN))]
    assert lines[0] == lines[1] and plain["source"] == "shared"
    assert plain["spent_micro"] == shared["cost_micro"] and plain["requests_this_minute"] is None
    assert lines[0]["capped"]["cap_usd"] == CAP_USD and lines[0]["capped"]["spent_micro"] == 0
    assert PLAIN not in str(a["keys"]) and CAPPED not in str(a["keys"])


def test_a_new_replica_starts_with_the_cloud_ttft_samples_the_others_measured(replicas, upstream, store_server, prefix):
    a, b = settled(replicas)
    measured = sum(v["spend_here"]["endpoints"]["cloud"]["requests"] for v in (a, b))  # one first token each
    assert measured >= 40
    late = start_gateway(config(upstream, store_server, prefix, "local"), wait_for=("device", "cloud"))
    try:
        assert budget(late)["dispatch"]["estimates"]["cloud_ttft_samples"] == measured
        assert budget(late)["spend"]["requests"] == a["spend"]["requests"]  # and the same books
    finally:
        stop_gateway(late)


def test_a_dollar_cap_holds_across_replicas_under_concurrency_and_then_answers_on_the_device(
    replicas, store_server, prefix
):
    results = asyncio.run(spread(replicas, CAPPED, 32, 32))
    assert [s for s, _ in results] == [200] * 32  # at_cap = "device": nobody is refused
    backends = [h["x-tandem-backend"] for _, h in results]
    assert "cloud" in backends and "device" in backends, backends
    settled(replicas)
    store = redis.Redis.from_url(store_server.url, decode_responses=True)
    [spend_key] = store.keys(f"{prefix}{{key:capped}}:spend:*")
    spent = int(store.get(spend_key)) / 1e6
    # Every reservation covered its whole answer (and then some: a migration's second prefill), so the burst
    # stopped short of the cap by at most what the reservations in flight held over their answers.
    assert CAP_USD - 0.03 < spent <= CAP_USD, spent
    # Later requests take what is left, then answer on the device; the cap is passed by at most one request's
    # ceiling (the device's energy cost of its answers, fractions of a micro-dollar each).
    for _ in range(6):
        status, headers = asyncio.run(ask(replicas[1], CAPPED))
        assert status == 200
        if headers["x-tandem-backend"] == "device":
            break
    assert headers["x-tandem-backend"] == "device"
    assert float(headers["x-tandem-budget-remaining-usd"]) < 0.0083
    settled(replicas)
    assert int(store.get(spend_key)) / 1e6 <= CAP_USD + 0.0083


def test_at_a_rejecting_cap_the_answer_is_429_in_the_openai_envelope(replicas):
    a, b = replicas
    assert asyncio.run(ask(a, REJECTING))[0] == 200  # the first request's reservation fits the cap of $0.01 ...
    client = openai.OpenAI(base_url=b.v1, api_key=REJECTING, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="tandem", messages=PROMPT, max_tokens=MAX_TOKENS)
    error = caught.value
    assert error.code == "insufficient_quota" and error.type == "insufficient_quota"
    assert int(error.response.headers["retry-after"]) >= 1


def test_a_per_key_rpm_limit_holds_across_both_replicas(replicas):
    if time.time() % 60 > 45:  # the limit is per calendar minute: start the run inside one
        time.sleep(61 - time.time() % 60)
    results = [asyncio.run(ask(replicas[i % 2], LIMITED)) for i in range(7)]
    assert [s for s, _ in results] == [200] * 4 + [429] * 3
    assert [h["x-ratelimit-remaining-requests"] for _, h in results[:4]] == ["3", "2", "1", "0"]
    assert all(h["x-ratelimit-limit-requests"] == "4" for _, h in results)
    assert 1 <= int(results[-1][1]["retry-after"]) <= 60


def test_a_lost_store_local_keeps_the_cloud_closed_answers_on_the_device_and_the_books_reconcile(
    replicas, store_server
):
    a, b = replicas
    before = [v["spend_here"] for v in settled(replicas)]
    store_server.stop()
    try:
        lost = [asyncio.run(ask(gw, PLAIN)) for gw in (a, b, a, b, a, b)]
        assert [s for s, _ in lost] == [200] * 6
        assert [h["x-tandem-backend"] for _, h in lost] == ["cloud", "device"] * 3
        r = httpx.put(a.v1 + "/budget", json={"budget": 0.4}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        views = [budget(gw) for gw in (a, b)]
        assert not views[0]["store"]["connected"] and views[0]["store"]["pending"] > 0
        assert "spend_here" not in views[0]  # the replica's own books while the store is away
    finally:
        store_server.start()  # empty: persistence is off
    after = settled(replicas)
    pairs = list(zip(after, before, strict=True))
    delta = {f: sum(v["spend_here"][f] - w[f] for v, w in pairs) for f in ("requests", "cost_micro")}
    # The restarted store holds exactly what the replicas booked while it was away, replayed.
    assert after[0]["spend"]["requests"] == delta["requests"] == 6
    assert after[0]["spend"]["cost_micro"] == delta["cost_micro"]
    assert after[0]["budget"] == after[1]["budget"] == 0.3  # the settings were given back to the new store
