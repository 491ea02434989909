"""DiSCo against the real backends: races won by each side, DiSCo-D's delayed device start,
cost-driven migrations in both directions with byte-exact continuity, and the budget API.

The gateway runs the embedded default's shape (Qwen2.5-Coder-0.5B on llama.cpp as the device,
the 0.5B again behind a real OpenAI-compatible server on loopback as the cloud). Each test
sets the knobs it needs over PUT /v1/budget, exactly as a user would.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.launcher import free_port, start_gateway, stop_gateway
from tests.integration.disco_helpers import endpoints, evict_cache, independent_continuation, stream_chunks, trace

ADMIN = {"authorization": "Bearer admin-secret"}
MESSAGES = [{"role": "user", "content": "Write a short Python function that reverses a string."}]
BUSY = [{"role": "user", "content": "Write a very long essay about the history of computing."}]


@pytest.fixture(scope="module")
def disco_gateway(tmp_path_factory):
    state = tmp_path_factory.mktemp("state") / "budget.json"
    gw = start_gateway(f"""
[gateway]
policy = "disco"
admin_keys = ["admin-secret"]
state_file = "{state}"
trace_file = "{state.parent / "trace.jsonl"}"
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
prompt_cache_mb = 0        # evict_cache's "evaluated from position 0" holds only without stored states
prompt_cache_disk_mb = 0   # (the fast path: docs/prompt-cache.md, "Exactness")
[clouds.cloud]
model = "qwen2.5-coder-0.5b-instruct"
tokenizer = "device"
continuation = "completions"
co_located = false   # races are what these tests watch (embedded, it would never be raced against the device)
[clouds.cloud.embedded]
port = 0
n_ctx = 2048
""")
    gw.trace_path = state.parent / "trace.jsonl"
    yield gw
    stop_gateway(gw)


def put(gw, patch: dict, headers=ADMIN) -> httpx.Response:
    return httpx.put(gw.v1 + "/budget", json=patch, headers=headers, timeout=10)


def knobs(gw, **patch) -> dict:
    r = put(gw, patch)
    assert r.status_code == 200, r.text
    return r.json()


class Busy:
    """Occupies one endpoint with a long pinned stream, so the other one wins the race."""

    def __init__(self, gw, backend: str):
        self.gw, self.backend = gw, backend
        self.started = threading.Event()

    def __enter__(self):
        def run():
            # Long enough to outlast any wait; leaving the context closes the stream, which cancels it.
            body = {"model": self.backend, "messages": BUSY, "max_tokens": 1000, "temperature": 0, "stream": True}
            with httpx.stream("POST", self.gw.v1 + "/chat/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    self.started.set()
                    if self._stop:
                        break

        self._stop = False
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.started.wait(60)
        return self

    def __exit__(self, *exc):
        self._stop = True
        self.thread.join(60)


# --- races ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("busy", "winner", "loser"), [("cloud", "device", "cloud"), ("device", "cloud", "device")])
def test_race_is_won_by_the_first_token(disco_gateway, busy, winner, loser):
    # DiSCo-S, server-constrained, b = 1: the threshold is 0, so every prompt races both endpoints.
    knobs(disco_gateway, policy="disco-s", constrained_side="server", budget=1.0, migration=False)
    before = disco_gateway.metric("tandem_backend_generated_tokens", backend=loser)
    with Busy(disco_gateway, busy):
        rid, pieces, finish = stream_chunks(disco_gateway, MESSAGES, max_tokens=6)
        t = trace(disco_gateway, rid)
        busy_tokens = disco_gateway.metric("tandem_backend_generated_tokens", backend=loser) - before
    assert pieces and finish == "length"
    assert t["plan"]["kind"] == "race"
    assert sorted(endpoints(t, "endpoint")) == sorted([(winner, "finished"), (loser, "lost")])
    lost = next(e for e in t["endpoints"] if e["outcome"] == "lost")
    # The loser was cancelled while queued behind the busy stream, which it was generating for all along: it
    # generated nothing for this request, and its prefill is still booked.
    assert busy_tokens > 0
    assert lost["first_token_ms"] is None and lost["decode_tokens"] == 0
    assert lost["prefill_tokens"] == t["prompt_tokens"]


# --- DiSCo-D --------------------------------------------------------------------------------------


def test_disco_d_starts_the_device_after_its_wait(disco_gateway):
    # Device-constrained with b <= alpha: every prompt waits w_tail = F^-1(1 - b) for the cloud.
    snap = knobs(disco_gateway, policy="disco-d", constrained_side="device", budget=0.01, alpha=0.05, migration=False)
    assert snap["effective_side"] == "device"
    with Busy(disco_gateway, "cloud"):
        rid, pieces, finish = stream_chunks(disco_gateway, MESSAGES, max_tokens=4)
    assert pieces and finish == "length"
    t = trace(disco_gateway, rid)
    assert t["plan"]["kind"] == "cloud-then-device"
    wait = t["plan"]["device_delay_ms"]
    assert 0 < wait < 20_000, t
    device = next(e for e in t["endpoints"] if e["endpoint"] == "device")
    cloud = next(e for e in t["endpoints"] if e["endpoint"] == "cloud")
    assert cloud["started_ms"] < device["started_ms"]  # the cloud at once ...
    assert device["started_ms"] >= wait - 5  # ... the device only after w(l), the cloud being busy
    assert (device["outcome"], cloud["outcome"]) == ("finished", "lost")

    # With an idle cloud whose first token comes within w(l), the device never starts; one that comes later (a
    # loaded machine) has the device started at w(l).
    rid, _, _ = stream_chunks(disco_gateway, MESSAGES, max_tokens=4)
    t = trace(disco_gateway, rid)
    cloud = next(e for e in t["endpoints"] if e["endpoint"] == "cloud")
    if cloud["first_token_ms"] is not None and cloud["first_token_ms"] < wait:
        assert endpoints(t, "endpoint") == [("cloud", "finished")]
    else:
        device = next(e for e in t["endpoints"] if e["endpoint"] == "device")
        assert device["started_ms"] >= wait - 5, t


# --- cost-driven migration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "patch", "source", "target"),
    [
        # Cloud decoding is dear and the device is free: start on the cloud (DiSCo-D with no device budget), move
        # to the device.
        ("disco-d", {"exchange_rate": 0.0, "prices": {"cloud": {"prefill": 0.0, "decode": 1000.0}}}, "cloud", "device"),
        # Device energy is dear and the cloud is free: start on the device (DiSCo-S with no server budget), move to
        # the cloud.
        ("disco-s", {"exchange_rate": 1e6, "prices": {"cloud": {"prefill": 0.0, "decode": 0.0}}}, "device", "cloud"),
    ],
)
def test_cost_driven_migration_is_byte_exact(disco_gateway, policy, patch, source, target):
    # A slow reader (0.5 tok/s) so the buffer B = r_c * t_m fills even when this shared machine makes
    # the source slower than a human reader (then DiSCo rightly never starts a migration).
    knobs(
        disco_gateway, policy=policy, constrained_side="auto", budget=0.0, migration=True, consumption_rate=0.5, **patch
    )
    # The fast path (no `reproducible`): the target's path is the same as independent_continuation's only from the
    # same cache state, so both start from an evicted one.
    evict_cache(disco_gateway, target)
    rid, pieces, finish = stream_chunks(disco_gateway, MESSAGES, max_tokens=16)
    t = trace(disco_gateway, rid)
    assert finish in ("stop", "length")
    assert len(t["migrations"]) == 1, t
    m = t["migrations"][0]
    assert (m["from"], m["to"], m["reason"]) == (source, target, "cost")
    k = m["at_token"]
    assert 0 < k < len(pieces)
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    assert independent_continuation(disco_gateway, target, MESSAGES, prefix, len(pieces) - k) == rest
    assert endpoints(t, "endpoint") == [(source, "migrated-from"), (target, "finished")]
    moved = t["endpoints"][1]  # it prefilled prompt + delivered prefix, less what its KV cache still held
    assert moved["prefill_tokens"] + moved["cached_tokens"] == t["prompt_tokens"] + k
    assert moved["cached_tokens"] == 0 if target == "cloud" else 0 <= moved["cached_tokens"] < t["prompt_tokens"] + k
    assert disco_gateway.metric("tandem_migrations_total", source=source, target=target, reason="cost") >= 1


def test_no_migration_when_it_does_not_pay(disco_gateway):
    # Equal decode prices: Eq. 5's saving is zero, so the answer stays where it started.
    knobs(
        disco_gateway,
        policy="cloud",
        migration=True,
        exchange_rate=0.0,
        prices={"cloud": {"prefill": 0.0, "decode": 0.0}},
    )
    rid, pieces, _ = stream_chunks(disco_gateway, MESSAGES, max_tokens=12)
    assert pieces
    assert trace(disco_gateway, rid)["migrations"] == []


def test_a_device_answer_books_only_the_prompt_it_computed(disco_gateway):
    """The same prompt again: llama.cpp reuses it from its KV cache, and the ledger books only the rest."""
    knobs(disco_gateway, policy="device", migration=False)
    prompt = [{"role": "user", "content": "Name three prime numbers between 100 and 200."}]
    stream_chunks(disco_gateway, prompt, max_tokens=3)  # leaves this prompt in the device's KV cache

    def device_prefill() -> int:
        spend = httpx.get(disco_gateway.v1 + "/budget", headers=ADMIN, timeout=10).json()["spend"]
        return spend["endpoints"]["device"]["prefill_tokens"]

    before = device_prefill()
    rid, pieces, _ = stream_chunks(disco_gateway, prompt, max_tokens=3)
    t = trace(disco_gateway, rid)
    (device,) = t["endpoints"]
    assert pieces and device["endpoint"] == "device"
    assert t["prompt_tokens"] - 1 <= device["cached_tokens"] < t["prompt_tokens"]  # llama.cpp re-reads the last
    assert device["prefill_tokens"] + device["cached_tokens"] == t["prompt_tokens"]
    assert device_prefill() - before == device["prefill_tokens"]


# --- the budget API ------------------------------------------------------------------------------------


def test_budget_get_put_validation_and_auth(disco_gateway):
    snap = knobs(disco_gateway, policy="disco", budget=0.3, alpha=0.1)
    got = httpx.get(disco_gateway.v1 + "/budget", headers=ADMIN).json()
    assert (got["policy"], got["budget"], got["alpha"]) == ("disco", 0.3, 0.1)
    assert got == snap | {"spend": got["spend"]}
    assert {"exchange_rate", "consumption_rate", "prices", "constrained_side", "spend"} <= set(got)
    assert got["spend"]["endpoints"]["device"]["prefill_tokens"] > 0  # earlier tests were booked
    ratio = got["spend"]["window"]["realised_budget"]
    assert ratio is None or 0.0 <= ratio <= 1.0
    for field, value in [
        ("budget", 1.5),
        ("alpha", 0),
        ("exchange_rate", -1),
        ("policy", "psychic"),
        ("consumption_rate", 0),
        ("colour", "red"),
    ]:
        r = put(disco_gateway, {field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
    assert httpx.get(disco_gateway.v1 + "/budget").status_code == 401
    assert put(disco_gateway, {"budget": 0.2}, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(disco_gateway.v1 + "/budget", headers=ADMIN).json()["budget"] == 0.3  # nothing changed
    body = httpx.put(disco_gateway.v1 + "/budget", content=b"{nope", headers=ADMIN)
    assert body.status_code == 400 and body.json()["error"]["code"] == "invalid_json"


def test_budget_survives_a_restart(tmp_path):
    config = f"""
[gateway]
policy = "disco"
admin_keys = ["admin-secret"]
state_file = "{tmp_path / "budget.json"}"
[device]
model = "smollm2-135m-instruct"
[disco]
profile_device = false
[clouds.cloud]
base_url = "http://127.0.0.1:{free_port()}/v1"
"""
    gw = start_gateway(config, wait_for=("device",))
    try:
        configured = httpx.get(gw.v1 + "/budget", headers=ADMIN).json()
        assert configured["settings_source"] == "config"
        knobs(gw, budget=0.25, exchange_rate=2.0, prices={"cloud": {"prefill": 1.0, "decode": 3.0}})
    finally:
        stop_gateway(gw)
    time.sleep(0.2)
    gw = start_gateway(config, wait_for=("device",))
    try:
        got = httpx.get(gw.v1 + "/budget", headers=ADMIN).json()
        assert (got["budget"], got["exchange_rate"]) == (0.25, 2.0)
        assert got["prices"]["cloud"] == {"prefill": 1.0, "decode": 3.0}
        assert got["settings_source"] == f"state file {tmp_path / 'budget.json'}"
        # Start-up says which source won and how to go back.
        assert f"budget = 0.25 (config: {configured['budget']!r})" in gw.log() and "--reset-budget" in gw.log()
    finally:
        stop_gateway(gw)
    time.sleep(0.2)
    gw = start_gateway(config, wait_for=("device",), options=("--reset-budget",))
    try:
        got = httpx.get(gw.v1 + "/budget", headers=ADMIN).json()
        assert got["settings_source"] == "config" and got["budget"] == configured["budget"]
        assert not (tmp_path / "budget.json").exists()
    finally:
        stop_gateway(gw)


def test_recorded_trace_replays_in_the_simulator(disco_gateway, tmp_path):
    """The gateway's JSONL trace is what `tandem bench disco --trace` replays."""
    from app.tools.bench.disco_sim import main
    from app.tools.bench.disco_trace import load_trace

    knobs(disco_gateway, policy="disco-s", constrained_side="server", budget=1.0, migration=False)
    stream_chunks(disco_gateway, MESSAGES, max_tokens=3)  # a race: both TTFTs can be recorded
    path = disco_gateway.trace_path
    trace_rows = load_trace(path)
    assert len(trace_rows.prompt_tokens) >= 5
    assert main(["--trace", str(path), "--no-plots", "-q", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").exists()
