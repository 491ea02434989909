"""A cost migration only goes where the answer can continue, and a target that fails before its first token
leaves the answer on its healthy source: the client gets the whole answer, and the trace says what happened.

Real parts: gateways started with `tandem serve`; the device models are real (SmolLM2 against a scripted
upstream, Qwen2.5-Coder-0.5B against the real embedded stand-in cloud, llama-cpp-python's server with
Qwen2.5-Coder-1.5B, which is SIGSTOPped to make it hang). Prices make the device the dearer decoder (a cloud
at 0.05 / 0.10 USD per million tokens), so DiSCo moves answers that start on the device to the cloud.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, free_port, start_gateway, stop_gateway
from tests.integration.disco_helpers import (
    embedded_server_pid,
    evict_cache,
    independent_continuation,
    signal_process,
    trace,
)
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "Tell me a long story about a cat who learns to sail."}]
CHEAP_CLOUD = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"


def ask(gw: GatewayProcess, model: str = "tandem", cloud: str | None = None, max_tokens: int = 40) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    if cloud is not None:
        body["tandem"] = {"cloud": cloud}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def content(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def outcomes(t: dict) -> list[tuple[str, str]]:
    return [(e["backend"], e["outcome"]) for e in t["endpoints"]]


# --- against a scripted upstream ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cost_gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    # SmolLM2 is so small that only a high λ makes its decoding dearer than the cloud's.
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
stall_timeout = 5
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
exchange_rate = 50
consumption_rate = 1    # a slow reader: the client's lead, and so the move, comes within a few tokens
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
price = {CHEAP_CLOUD}
retries = 0   # each test scripts one fault: it is the target's failure, not retried
[clouds.chatcloud]
base_url = "{upstream.base_url}"
model = "scripted-chat"
continuation = "chat"
price = {CHEAP_CLOUD}
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(request) -> None:
    if "upstream" in request.fixturenames:
        request.getfixturevalue("upstream").reset()


def test_cost_migration_moves_answers_to_a_cheaper_cloud_that_can_continue(cost_gw, upstream):
    """The premise of the tests below: with these prices the answer does move, and continues exactly."""
    r = ask(cost_gw, cloud="cloud")
    t = trace(cost_gw, r.headers["x-request-id"])
    (migration,) = t["migrations"]
    assert outcomes(t) == [("device", "migrated-from"), ("cloud", "finished")] and "error" not in migration
    device_part = content(ask(cost_gw, model="device", max_tokens=migration["at_token"]))
    assert content(r) == device_part + "".join(PIECES)
    (sent,) = upstream.completions()
    assert sent.body["prompt"].endswith("assistant\n" + device_part)  # continued from exactly the delivered text


def test_cost_migration_never_targets_a_cloud_that_cannot_continue(cost_gw, upstream):
    r = ask(cost_gw, cloud="chatcloud")
    t = trace(cost_gw, r.headers["x-request-id"])
    assert t["migrations"] == [] and outcomes(t) == [("device", "finished")]
    assert upstream.requests == []
    assert content(r) == content(ask(cost_gw, model="device"))


@pytest.mark.parametrize(
    "failure",
    [Answer(status=500), Answer(status=429), Answer(before="hang"), Answer(pieces=(), then="close")],
    ids=["500", "429", "hang", "closed"],
)
def test_a_target_that_fails_first_leaves_the_answer_on_its_source(cost_gw, upstream, failure):
    failed_before = cost_gw.metric("tandem_migrations_failed_total", source="device", target="cloud", reason="cost")
    upstream.push(failure)
    r = ask(cost_gw, cloud="cloud")
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # Nothing lost, nothing repeated: exactly the device's own answer.
    assert content(r) == content(ask(cost_gw, model="device"))
    t = trace(cost_gw, r.headers["x-request-id"])
    (migration,) = t["migrations"]
    assert migration["to"] == "cloud" and migration["error"]
    assert outcomes(t) == [("device", "finished"), ("cloud", "failed")]
    assert t["completion_tokens"] == 40 and "error" not in t
    failed = cost_gw.metric("tandem_migrations_failed_total", source="device", target="cloud", reason="cost")
    assert failed == failed_before + 1


# --- against the real embedded stand-in cloud ----------------------------------------------------------


@pytest.fixture(scope="module")
def real_gw() -> Iterator[GatewayProcess]:
    port = free_port()
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
stall_timeout = 10     # the patience for a migration target's first token: the 1.5B prefills on shared cores
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
consumption_rate = 1
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
price = {CHEAP_CLOUD}
[clouds.cloud.embedded]
port = {port}
n_ctx = 2048
[clouds.chatcloud]
base_url = "http://127.0.0.1:{port}/v1"
model = "qwen2.5-coder-1.5b-instruct"
continuation = "chat"
price = {CHEAP_CLOUD}
""")
    yield process
    stop_gateway(process)


def test_real_cloud_cost_migration_continues_exactly(real_gw):
    evict_cache(real_gw, "cloud")  # the cloud's path is then the one independent_continuation takes
    r = ask(real_gw, cloud="cloud", max_tokens=24)
    t = trace(real_gw, r.headers["x-request-id"])
    (migration,) = t["migrations"]
    assert outcomes(t) == [("device", "migrated-from"), ("cloud", "finished")]
    k, text = migration["at_token"], content(r)
    device_part = content(ask(real_gw, model="device", max_tokens=k))
    assert text.startswith(device_part)
    assert text[len(device_part) :] == independent_continuation(real_gw, "cloud", MESSAGES, device_part, 24 - k)


def test_real_chat_only_cloud_is_not_a_migration_target(real_gw):
    r = ask(real_gw, cloud="chatcloud", max_tokens=24)
    t = trace(real_gw, r.headers["x-request-id"])
    assert t["migrations"] == [] and outcomes(t) == [("device", "finished")]
    assert content(r) == content(ask(real_gw, model="device", max_tokens=24))


def test_real_cloud_that_hangs_leaves_the_answer_on_the_device(real_gw):
    pid = embedded_server_pid(real_gw)
    signal_process(pid, signal.SIGSTOP)
    try:
        r = ask(real_gw, cloud="cloud", max_tokens=24)
    finally:
        signal_process(pid, signal.SIGCONT)
    t = trace(real_gw, r.headers["x-request-id"])
    (migration,) = t["migrations"]
    assert "sent nothing" in migration["error"]
    assert outcomes(t) == [("device", "finished"), ("cloud", "failed")]
    assert content(r) == content(ask(real_gw, model="device", max_tokens=24))
