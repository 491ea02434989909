"""Privacy levels hold on every route: a request at `device` never reaches the scripted cloud — not by its policy,
a race, a cost migration or a fault — and the per-key level is a floor a request can tighten but not loosen.

Real parts: a gateway started with `tandem serve`, SmolLM2 on the device, the scripted upstream on loopback
(which records every request that reaches it). With these prices an answer started on the device moves to the
cloud within a few tokens, so the tests would see any leak. (HAT's `split` level: tests/integration/
test_hat_gateway.py.)
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration import disco_helpers
from tests.integration.scripted_upstream import Answer, ScriptedUpstream

OPEN_KEY, DEVICE_KEY, ADMIN_KEY = "open-key", "device-only-key", "admin-key"
MESSAGES = [{"role": "user", "content": "Tell me a long story about a cat who learns to sail."}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
stall_timeout = 5
api_keys = ["{OPEN_KEY}", {{ key = "{DEVICE_KEY}", privacy = "device" }}]
admin_keys = ["{ADMIN_KEY}"]
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
exchange_rate = 50
consumption_rate = 1
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
price = {{ prefill_per_million = 0.05, decode_per_million = 0.10 }}
retries = 0   # a scripted failure is the cloud's one answer
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream) -> None:
    upstream.reset()


def ask(gw, key: str = OPEN_KEY, model: str = "tandem", **tandem) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    if tandem:
        body["tandem"] = tandem
    return httpx.post(gw.v1 + "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)


def trace(gw, request_id: str) -> dict:
    return disco_helpers.trace(gw, request_id, key=OPEN_KEY)


def served_by(gw, r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    t = trace(gw, r.headers["x-request-id"])
    assert t["privacy"] == "device" or t["privacy"] in ("split", "any")
    return [e["backend"] for e in t["endpoints"]]


def test_the_premise_without_a_privacy_level_the_answer_does_move_to_the_cloud(gw, upstream):
    r = ask(gw)
    t = trace(gw, r.headers["x-request-id"])
    assert [m["to"] for m in t["migrations"]] == ["cloud"] and upstream.requests and t["privacy"] == "any"


@pytest.mark.parametrize("policy", ["disco-s", "cloud"])  # a device start (then a cost move), a cloud start
def test_device_level_never_reaches_the_cloud(gw, upstream, policy):
    r = ask(gw, policy=policy, privacy="device")
    assert served_by(gw, r) == ["device"]
    t = trace(gw, r.headers["x-request-id"])
    assert t["privacy"] == "device" and t["migrations"] == []
    assert upstream.requests == []


def test_device_level_is_never_raced(gw, upstream):
    # DiSCo-S, server-constrained, b = 1: every prompt races both endpoints — except this one.
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}  # changing the budget needs an admin key
    before = httpx.get(gw.v1 + "/budget", headers=auth, timeout=10).json()
    patch = {"policy": "disco-s", "constrained_side": "server", "budget": 1.0, "migration": False}
    assert httpx.put(gw.v1 + "/budget", json=patch, headers=auth, timeout=10).status_code == 200
    try:
        raced = ask(gw)
        assert trace(gw, raced.headers["x-request-id"])["plan"]["kind"] == "race" and upstream.requests
        upstream.reset()
        r = ask(gw, privacy="device")
        assert served_by(gw, r) == ["device"] and upstream.requests == []
    finally:
        restore = {k: before[k] for k in ("policy", "constrained_side", "budget", "migration")}
        assert httpx.put(gw.v1 + "/budget", json=restore, headers=auth, timeout=10).status_code == 200


def test_a_cloud_fault_at_device_level_does_not_matter_and_at_any_level_falls_back(gw, upstream):
    upstream.push(Answer(status=500))
    r = ask(gw, policy="cloud", privacy="device")
    assert served_by(gw, r) == ["device"] and upstream.requests == []
    # The same request at `any` goes to the cloud, which fails, and the device answers: the level is what kept
    # the request away, not the fault.
    upstream.push(Answer(status=500))
    r = ask(gw, policy="cloud")
    assert served_by(gw, r)[:2] == ["cloud", "device"] and upstream.requests  # (then, cheaper, back to the cloud)


def test_the_key_level_is_a_floor(gw, upstream):
    for tandem in ({}, {"privacy": "any"}, {"policy": "cloud", "privacy": "split"}):
        r = ask(gw, DEVICE_KEY, **tandem)
        assert served_by(gw, r) == ["device"]
        assert trace(gw, r.headers["x-request-id"])["privacy"] == "device"
    assert upstream.requests == []


def test_a_pinned_endpoint_the_level_does_not_allow_is_a_400(gw, upstream):
    r = ask(gw, model="cloud", privacy="device")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tandem.privacy", r.text
    r = ask(gw, DEVICE_KEY, model="cloud")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "privacy level 'device'" in r.json()["error"]["message"]
    r = ask(gw, privacy="nowhere")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tandem.privacy"
    assert upstream.requests == []


# --- a device fault: a device that stalls mid-answer (every gap between its tokens exceeds the stall timeout) ------


@pytest.fixture(scope="module")
def stalling_gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "device"
stall_timeout = 0.001   # no device writes tokens this fast: after its first token, it has "stalled"
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
migration = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
""")
    yield process
    stop_gateway(process)


def test_a_device_fault_at_device_level_is_an_error_not_a_move(stalling_gw, upstream):
    body = {"model": "tandem", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True}
    # At `any`, the stalled answer moves to the cloud (the premise: the fault does send it away)...
    r = httpx.post(stalling_gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and upstream.requests, r.text
    rid = r.headers["x-request-id"]
    assert [m["reason"] for m in trace(stalling_gw, rid)["migrations"]] == ["stall"]
    # ...at `device` it does not: the client gets the error event, the cloud gets nothing.
    upstream.reset()
    r = httpx.post(stalling_gw.v1 + "/chat/completions", json={**body, "tandem": {"privacy": "device"}}, timeout=120)
    assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    t = trace(stalling_gw, r.headers["x-request-id"])
    assert t["privacy"] == "device" and t["migrations"] == [] and "stalled" in t["error"]
    assert upstream.requests == []
