"""Clouds that fail are remembered (issue 39, item 4; policies/breaker.py, docs/disco.md): a cloud answering 429 with
`Retry-After` is retried after the delay, or, when the delay is longer than the retry budget, the device answers at
once and the cloud cools; while it cools DiSCo's planner races it no more (the trace and GET /v1/endpoints say why),
no cost migration and no tool_choice-auto start goes onto it, and a mid-answer fault moves onto it only when nothing
else can continue; once the cool-down is over it is used again. 5xx in a row and a refused connection are retried
with backoff before the first token.

Each cooling state asserted here is deterministic: the cloud cools for an hour (`Retry-After: 3600`, longer than any
test), so no slow machine outlives it, and a pinned answer from the cloud closes it afterwards (a success closes the
breaker); the one cool-down that ends on its own is waited out by polling, with a generous deadline.

Real parts: gateways (`tandem serve` in a subprocess) with the small SmolLM2 device model (the model does not matter
here), scripted OpenAI-compatible upstreams on loopback (tests/integration/scripted_upstream.py) sending real 429s
with the header, 5xx, and a loopback port that refuses connections until an upstream starts listening on it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from policies.breaker import RetrySettings
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "Name one prime number."}]
HOUR = "3600"  # a Retry-After no test outlives: the cloud cools until a success closes its breaker
PATIENCE = 60.0  # seconds to wait for what must happen on a loaded machine; never a bound on how fast
CHEAP_CLOUD = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def refusing() -> Iterator[socket.socket]:
    """A loopback port bound and not listening: the kernel refuses connections to it until something listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, refusing: socket.socket) -> Iterator[GatewayProcess]:
    """DiSCo-S at b = 1: every request races the cloud and the device (unless the cloud cools). Clouds: "cloud" (a
    completions upstream that can continue answers), "chatcloud" (a chat upstream that takes tools itself), both on
    the scripted upstream, and "late" on the refusing port."""
    process = start_gateway(
        f"""
[gateway]
policy = "disco-s"
stall_timeout = 30    # a loaded CI box must not turn a slow device into a fault
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
n_threads = 1
[disco]
budget = 1.0
migration = false
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 10
retry_budget_seconds = 1.5
price = {CHEAP_CLOUD}
[clouds.chatcloud]
base_url = "{upstream.base_url}"
model = "scripted-chat"
continuation = "chat"
retry_budget_seconds = 2
[clouds.late]
base_url = "http://127.0.0.1:{refusing.getsockname()[1]}/v1"
model = "scripted-late"
tokenizer = "device"
continuation = "completions"
retries = 4                   # each waits 1 s × 2^k (± half): the test starts listening after the first refusal
retry_backoff_seconds = 1
retry_budget_seconds = 60
""",
        wait_for=("device", "cloud", "chatcloud"),
    )
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def ask(gw: GatewayProcess, model: str = "tandem", max_tokens: int = 4, **fields) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **fields}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def trace(gw: GatewayProcess, r: httpx.Response) -> dict:
    t = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}", timeout=10)
    t.raise_for_status()
    return t.json()


def outcomes(t: dict) -> list[tuple[str, str]]:
    return [(e["backend"], e["outcome"]) for e in t["endpoints"]]


def breaker(gw: GatewayProcess, name: str = "cloud") -> dict:
    rows = httpx.get(gw.v1 + "/endpoints", timeout=10).json()["data"]
    (row,) = [e for e in rows if e["name"] == name]
    return row["breaker"]


def wait_until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def cool_for_an_hour(gw: GatewayProcess, upstream: ScriptedUpstream, name: str) -> None:
    """A request pinned to cloud `name` answered 429 with `Retry-After: 3600`: longer than its retry budget, so not
    retried, and its breaker opens for an hour."""
    upstream.push(Answer(status=429, retry_after=HOUR))
    r = httpx.post(gw.v1 + "/chat/completions", json={"model": name, "messages": MESSAGES, "max_tokens": 4}, timeout=60)
    assert r.status_code == 429, r.text
    state = breaker(gw, name)
    assert state["state"] == "open" and state["cooling_seconds"] > 3000, state
    upstream.reset()


def close_breaker(gw: GatewayProcess, name: str) -> None:
    """A pinned request goes to its cloud even while it cools (the model names it); its success closes the breaker."""
    ask(gw, model=name)
    assert breaker(gw, name)["state"] == "closed"


def test_a_retry_after_within_the_budget_is_waited_for_and_the_retry_served(gw, upstream):
    retries = gw.metric("tandem_cloud_retries_total", backend="cloud")
    upstream.push(Answer(status=429, retry_after="1"), Answer())
    r = ask(gw, model="cloud")  # pinned: only the cloud can answer, so it is the retry that does
    first, second = upstream.completions()
    assert second.at - first.at >= 0.95  # it waited what the upstream asked, not a backoff of its own
    t = trace(gw, r)
    assert outcomes(t) == [("cloud", "finished")]
    assert r.json()["choices"][0]["message"]["content"]
    assert gw.metric("tandem_cloud_retries_total", backend="cloud") == retries + 1
    state = breaker(gw)
    assert state["state"] == "closed" and state["failures"] == 0  # the retry's success closed it


def fall_back(gw: GatewayProcess) -> dict:
    """The trace of one answer under the server-only baseline: the cloud first, the device only when it fails (no race
    whose winner depends on which of the two is quicker on this machine)."""
    return trace(gw, ask(gw, tandem={"policy": "cloud"}))


def test_a_long_retry_after_cools_the_cloud_and_disco_starts_only_the_device_until_it_closes(gw, upstream):
    openings = gw.metric("tandem_breaker_openings_total", backend="cloud")
    # Longer than the 1.5 s retry budget: no waiting, the device answers now and the cloud cools for an hour.
    upstream.push(Answer(status=429, retry_after=HOUR))
    t = fall_back(gw)
    assert outcomes(t) == [("cloud", "failed"), ("device", "finished")]
    assert "answered 429" in t["endpoints"][0]["error"] and "cooling until" in t["endpoints"][0]["error"]
    assert len(upstream.completions()) == 1  # not retried: the wait was longer than the budget
    assert gw.metric("tandem_breaker_openings_total", backend="cloud") == openings + 1
    state = breaker(gw)
    assert state["state"] == "open" and 3000 < state["cooling_seconds"] <= 3600
    assert state["reason"].startswith("cooling until") and "429" in state["last_error"]

    # While it cools, DiSCo's planner does not race it: the device alone answers, and the trace says why.
    for _ in range(2):
        t = trace(gw, ask(gw))
        assert t["plan"]["kind"] == "device" and "cloud cooling until" in t["plan"]["reason"], t["plan"]
        assert "answered 429" in t["plan"]["reason"]  # after what
        assert outcomes(t) == [("device", "finished")]
    assert len(upstream.completions()) == 1
    assert breaker(gw)["state"] == "open"  # still cooling after the requests above: they were checked while open

    # A success closes the breaker (here a pinned answer, which goes to the cloud whatever its state); then the cloud
    # is raced again.
    close_breaker(gw, "cloud")
    t = trace(gw, ask(gw))
    assert t["plan"]["kind"] == "race" and "cooling" not in t["plan"]["reason"]
    assert "cloud" in [e["backend"] for e in t["endpoints"]]


def test_a_cool_down_ends_on_its_own_and_the_next_request_races_the_cloud_again(gw, upstream):
    upstream.push(Answer(status=429, retry_after="2"))  # past the 1.5 s retry budget: not waited for, it cools 2 s
    t = fall_back(gw)
    assert outcomes(t) == [("cloud", "failed"), ("device", "finished")]
    assert "cooling until" in t["endpoints"][0]["error"]
    assert breaker(gw)["state"] == "open"
    wait_until(lambda: breaker(gw)["state"] == "closed", "the cool-down never ended")
    t = trace(gw, ask(gw))
    assert t["plan"]["kind"] == "race" and "cooling" not in t["plan"]["reason"]
    (cloud,) = [e for e in t["endpoints"] if e["backend"] == "cloud"]  # tried again (it won, or the device did)
    assert cloud["outcome"] in ("finished", "lost"), cloud


def test_5xx_in_a_row_are_retried_with_backoff_and_open_the_breaker(gw, upstream):
    ask(gw, model="cloud")  # an answer from the cloud closes its breaker: this test counts from zero
    assert breaker(gw)["failures"] == 0
    upstream.reset()
    retries = gw.metric("tandem_cloud_retries_total", backend="cloud")
    openings = gw.metric("tandem_breaker_openings_total", backend="cloud")
    upstream.push(Answer(status=503), Answer(status=502), Answer(status=500))
    body = {"model": "cloud", "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 502  # pinned: no other endpoint may answer
    sent = upstream.completions()
    assert len(sent) == 3  # the first try and the two retries
    # The backoff (0.25 s, doubled before the second retry, each ± half): at least its shortest draw, on any machine.
    settings = RetrySettings()
    shortest = settings.backoff_seconds * (1 - settings.jitter)
    assert sent[1].at - sent[0].at >= shortest and sent[2].at - sent[1].at >= 2 * shortest
    assert gw.metric("tandem_cloud_retries_total", backend="cloud") == retries + 2
    # Three failures in a row (the default failures_to_open) opened it for the default 1 s cool-down.
    assert gw.metric("tandem_breaker_openings_total", backend="cloud") == openings + 1
    t = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}", timeout=10).json()
    assert "answered 500" in t["error"] and "cooling until" in t["error"]
    state = breaker(gw)
    assert state["failures"] == 3 and state["openings"] == 1 and "answered 500" in state["last_error"]


def test_a_refused_connection_is_retried_and_the_retry_served(gw, refusing):
    """Nothing listens on the late cloud's port: the first try is refused, the client waits its backoff and tries
    again; the upstream starts listening once the gateway counts that retry, so a retry connects and answers."""
    retries = gw.metric("tandem_cloud_retries_total", backend="late")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, gw, "late")
        wait_until(
            lambda: gw.metric("tandem_cloud_retries_total", backend="late") > retries or answer.done(),
            "the refused request neither retried nor ended",
        )
        assert not answer.done(), answer.exception() or answer.result().text  # it waits to retry, not given up
        late = ScriptedUpstream(sock=refusing)  # listens from now on
        try:
            r = answer.result(PATIENCE)
            (sent,) = late.completions()  # the refused tries never reached it; one retry did
        finally:
            late.close()
    assert sent.body["model"] == "scripted-late"
    assert outcomes(trace(gw, r)) == [("late", "finished")]
    assert r.json()["choices"][0]["message"]["content"] == "".join(PIECES[:4])  # max_tokens 4 of its answer
    # The first retry, or the second when the first came before the upstream listened; never given up.
    assert 1 <= gw.metric("tandem_cloud_retries_total", backend="late") - retries <= 2
    assert breaker(gw, "late")["failures"] == 0  # the answer closed it


def test_no_tool_choice_auto_answer_starts_on_a_cooling_cloud(gw, upstream):
    """tool_choice auto: DiSCo starts a tools request where a started call comes out whole. The device (its call
    grammar) and a chat upstream (it takes the tools itself) both do, so a healthy chat cloud is raced; one that
    cools is not started at all, the device alone answers."""
    tools = {"tools": [ADD], "tool_choice": "auto", "tandem": {"cloud": "chatcloud"}}
    t = trace(gw, ask(gw, **tools))
    assert t["plan"]["kind"] == "race", t["plan"]
    assert "chatcloud" in [e["backend"] for e in t["endpoints"]]
    wait_until(lambda: upstream.requests, "the raced chat cloud got no request")  # it may have lost the race
    (sent,) = upstream.requests
    assert sent.path.endswith("/chat/completions") and sent.body["model"] == "scripted-chat" and sent.body["tools"]

    cool_for_an_hour(gw, upstream, "chatcloud")
    try:
        t = trace(gw, ask(gw, **tools))
        assert t["plan"]["kind"] == "device" and "chatcloud cooling until" in t["plan"]["reason"], t["plan"]
        assert outcomes(t) == [("device", "finished")]
        assert upstream.requests == []
    finally:
        close_breaker(gw, "chatcloud")


@pytest.fixture
def migrating(gw: GatewayProcess) -> Iterator[None]:
    """DiSCo-S with no server budget and the device's decoding dear (λ = 50 against a cloud at 0.05 / 0.10 USD per
    million tokens), a slow reader: answers start on the device and move to the cloud within a few tokens. The
    config's settings are back afterwards (DELETE /v1/budget)."""
    r = httpx.put(
        gw.v1 + "/budget", json={"budget": 0, "migration": True, "exchange_rate": 50, "consumption_rate": 1}, timeout=10
    )
    assert r.status_code == 200, r.text
    yield
    httpx.delete(gw.v1 + "/budget", timeout=10).raise_for_status()


def test_no_cost_migration_moves_an_answer_onto_a_cooling_cloud(gw, upstream, migrating):
    # The premise: with these prices a device answer moves to the healthy cloud for cost.
    t = trace(gw, ask(gw, max_tokens=40))
    assert t["plan"]["kind"] == "device", t["plan"]
    assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [("device", "cloud", "cost")]
    assert len(upstream.completions()) == 1

    cool_for_an_hour(gw, upstream, "cloud")
    try:
        t = trace(gw, ask(gw, max_tokens=40))
        assert t["migrations"] == [] and outcomes(t) == [("device", "finished")]
        assert upstream.requests == []
    finally:
        close_breaker(gw, "cloud")


# --- a mid-answer fault's targets ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stalling_gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    """The device stalls mid-answer: its own stall_timeout (0.1 ms) is shorter than any gap between two of its tokens
    (the first token is not held to it), so every device answer fails after its first token and goes on elsewhere.
    DiSCo-S with no server budget starts answers on the device; "cloud" is its pair, "spare" another cloud that can
    continue answers, both on the scripted upstream."""
    process = start_gateway(f"""
[gateway]
policy = "disco-s"
stall_timeout = 30
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
n_threads = 1
stall_timeout = 0.0001
[disco]
budget = 0
migration = false     # only faults move answers here
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
retry_budget_seconds = 2
[clouds.spare]
base_url = "{upstream.base_url}"
model = "scripted-spare"
tokenizer = "device"
continuation = "completions"
""")
    yield process
    stop_gateway(process)


def test_a_mid_answer_fault_moves_onto_a_cooling_cloud_only_when_nothing_else_can_continue(stalling_gw, upstream):
    gw = stalling_gw
    # The premise: the device's answer stalls and goes on on its pair, the request's cloud, first.
    t = trace(gw, ask(gw, max_tokens=12))
    assert t["plan"]["kind"] == "device", t["plan"]
    assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [("device", "cloud", "stall")]
    assert [r.body["model"] for r in upstream.completions()] == ["scripted"]

    cool_for_an_hour(gw, upstream, "cloud")
    try:
        t = trace(gw, ask(gw, max_tokens=12))
        assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [("device", "spare", "stall")]
        assert outcomes(t) == [("device", "failed"), ("spare", "finished")]
        assert [r.body["model"] for r in upstream.completions()] == ["scripted-spare"]  # none reached the cooling one
    finally:
        close_breaker(gw, "cloud")
