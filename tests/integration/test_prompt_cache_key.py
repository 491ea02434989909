"""A conversation's prompt-cache key reaches the cloud on every leg: derived when the client sends none (the same on
each turn and on a migration back onto the cloud, different per conversation and API key, never its text), the
client's own passed as is, and nothing sent to a cloud whose dialect does not take the field.

Real parts: `tandem serve` in a subprocess with the bundled SmolLM2 on llama.cpp as its device and two API keys, real
HTTP, and the scripted OpenAI-compatible upstream on loopback (tests/integration/scripted_upstream.py), which records
every body it receives, configured under the `openai` provider's dialect (with a prefill continuation, so an answer
can migrate onto it), under OpenRouter's and under llama-server's. The Anthropic door's `cache_control` goes to
OpenRouter as its top-level hint and is reported ignored where no dialect takes it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.scripted_upstream import ScriptedUpstream

KEYS = ("sk-cache-key-one", "sk-cache-key-two")
SYSTEM = {"role": "system", "content": "You answer about the planets of Zanzibar."}
FIRST = {"role": "user", "content": "How many moons does Jupiter have?"}
AUTH = {"authorization": f"Bearer {KEYS[0]}"}
LATER = [FIRST, {"role": "assistant", "content": "Ninety-five."}, {"role": "user", "content": "And Saturn?"}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
cloud = "oai"
fallback = false
stall_timeout = 60     # a shared test machine: the device may be slow, never a fault here
api_keys = {list(KEYS)!r}
[device]
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
migration = false
profile_device = false
[clouds.oai]
provider = "openai"
continuation = "prefill"
base_url = "{upstream.base_url}"
model = "oai-model"
connect_timeout = 2
read_timeout = 5
[clouds.router]
provider = "openrouter"
base_url = "{upstream.base_url}"
model = "router-model"
connect_timeout = 2
read_timeout = 5
[clouds.llama]
provider = "llama-server"
base_url = "{upstream.base_url}"
model = "llama-model"
connect_timeout = 2
read_timeout = 5
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def ask(gw: GatewayProcess, messages: list[dict], tandem: dict, key: str = KEYS[0], **fields) -> httpx.Response:
    body = {"model": "tandem", "messages": messages, "max_tokens": 8, "temperature": 0, "tandem": tandem, **fields}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def sent_key(gw: GatewayProcess, upstream: ScriptedUpstream, messages: list[dict], key: str = KEYS[0]) -> str:
    """The prompt-cache key the cloud got for one answer served there."""
    before = len(upstream.requests)
    ask(gw, messages, {"policy": "cloud", "cloud": "oai"}, key)
    (sent,) = upstream.requests[before:]
    return sent.body["prompt_cache_key"]


def test_every_turn_of_a_conversation_sends_the_same_derived_key(gw, upstream):
    first = sent_key(gw, upstream, [SYSTEM, FIRST])
    assert first.startswith("tandem-")
    assert sent_key(gw, upstream, [SYSTEM, *LATER]) == first
    for text in ("Zanzibar", "Jupiter", "moons", KEYS[0], KEYS[0].removeprefix("sk-")):
        assert text not in first


def test_another_conversation_or_api_key_sends_another_key(gw, upstream):
    first = sent_key(gw, upstream, [SYSTEM, FIRST])
    other_question = sent_key(gw, upstream, [SYSTEM, {"role": "user", "content": "How many moons has Mars?"}])
    other_system = sent_key(gw, upstream, [{"role": "system", "content": "Be brief."}, FIRST])
    other_key = sent_key(gw, upstream, [SYSTEM, FIRST], key=KEYS[1])
    assert len({first, other_question, other_system, other_key}) == 4


def test_a_migration_back_onto_the_cloud_sends_the_conversations_key(gw, upstream):
    key = sent_key(gw, upstream, [SYSTEM, FIRST])
    # The next turn starts on the device and is moved onto the cloud after 2 tokens: a continuation request.
    r = ask(gw, [SYSTEM, *LATER], {"policy": "device", "cloud": "oai", "migrate_after_tokens": 2})
    trace = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}", headers=AUTH, timeout=10).json()
    assert [(m["from"], m["to"], m["reason"]) for m in trace["migrations"]] == [("device", "oai", "forced")]
    continuation = upstream.requests[-1]
    assert len(upstream.requests) == 2
    assert continuation.body["messages"][-1]["role"] == "assistant"  # the answer so far, continued
    assert continuation.body["prompt_cache_key"] == key


def test_the_clients_own_key_is_passed_as_is(gw, upstream):
    r = ask(gw, [SYSTEM, FIRST], {"policy": "cloud", "cloud": "oai"}, prompt_cache_key="my-conversation-17")
    (sent,) = upstream.requests
    assert sent.body["prompt_cache_key"] == "my-conversation-17"
    assert "prompt_cache_key" not in r.headers.get("x-tandem-ignored-fields", "")


def test_a_cloud_that_does_not_take_the_field_gets_no_derived_key_and_nothing_is_reported_ignored(gw, upstream):
    r = ask(gw, [SYSTEM, FIRST], {"policy": "cloud", "cloud": "llama"})
    (sent,) = upstream.requests
    assert sent.body["model"] == "llama-model" and "prompt_cache_key" not in sent.body
    assert "x-tandem-ignored-fields" not in r.headers
    # A client's own key there is ignored visibly, as every field the endpoint does not take.
    r = ask(gw, [SYSTEM, FIRST], {"policy": "cloud", "cloud": "llama"}, prompt_cache_key="mine")
    assert "prompt_cache_key" not in upstream.requests[-1].body
    assert "prompt_cache_key" in r.headers["x-tandem-ignored-fields"]


def messages(gw: GatewayProcess, cloud: str, **fields) -> httpx.Response:
    body = {
        "model": "tandem",
        "max_tokens": 8,
        "system": [{"type": "text", "text": SYSTEM["content"], "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [FIRST],
        "tandem": {"policy": "cloud", "cloud": cloud},
        **fields,
    }
    r = httpx.post(gw.v1 + "/messages", json=body, headers={"x-api-key": KEYS[0]}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_anthropic_cache_control_reaches_openrouter_as_its_top_level_hint(gw, upstream):
    r = messages(gw, "router")
    (sent,) = upstream.requests
    assert sent.body["model"] == "router-model"
    assert sent.body["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert "cache_control" not in r.headers.get("x-tandem-ignored-fields", "")


def test_anthropic_cache_control_is_ignored_visibly_where_no_dialect_takes_it_and_the_key_still_goes(gw, upstream):
    r = messages(gw, "oai", cache_control={"type": "ephemeral"})
    (sent,) = upstream.requests
    assert "cache_control" not in sent.body
    assert "cache_control" in r.headers["x-tandem-ignored-fields"]
    # The Messages door's conversation keys as chat's does: the same system prompt and first user message.
    assert sent.body["prompt_cache_key"] == sent_key(gw, upstream, [SYSTEM, FIRST])


def test_the_device_needs_no_cache_hint_and_reports_none_ignored(gw, upstream):
    r = messages(gw, "oai", tandem={"policy": "device"})
    assert upstream.requests == []
    assert "x-tandem-ignored-fields" not in r.headers
