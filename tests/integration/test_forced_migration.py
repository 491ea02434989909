"""A forced migration (`"tandem": {"migrate_after_tokens": k}`, `tandem bench quality --appendix-d`) on the real
backends: the answer moves to the other endpoint of its pair after exactly k answer tokens, both ways, and the seam
is exact (nothing repeated, skipped or lost); a request where it cannot move is refused, naming the field.

Real parts: the session's embedded-default gateway (tests/conftest.py: Qwen2.5-Coder-0.5B on llama.cpp as the
device, on its reproducible path; the 0.5B again behind a real OpenAI-compatible server on loopback as the cloud), the
`openai` SDK, real HTTP.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.disco_helpers import endpoints, evict_cache, independent_continuation, sdk, trace

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."}]
K = 6


def stream(gw, tandem: dict, max_tokens: int) -> tuple[str, list[str], str | None]:
    """(request id, content pieces, finish reason) of a greedy answer streamed with the SDK."""
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"tandem": tandem},
    )
    pieces, finish = [], None
    for chunk in raw.parse():
        if chunk.choices:
            pieces += [chunk.choices[0].delta.content] if chunk.choices[0].delta.content else []
            finish = chunk.choices[0].finish_reason or finish
    return raw.headers["x-request-id"], pieces, finish


@pytest.mark.parametrize(("policy", "source", "target"), [("device", "device", "cloud"), ("cloud", "cloud", "device")])
def test_a_forced_migration_moves_the_answer_after_k_tokens_at_an_exact_seam(gateway, policy, source, target):
    before = gateway.metric("tandem_migrations_total", source=source, target=target, reason="forced")
    # The cloud's llama.cpp server reuses the longest prefix it holds: evicted, it takes the path that
    # independent_continuation's own eviction gives it (the device's reproducible path needs none).
    evict_cache(gateway, "cloud")
    rid, pieces, finish = stream(gateway, {"policy": policy, "migrate_after_tokens": K}, max_tokens=20)
    t = trace(gateway, rid)
    assert finish in ("stop", "length")
    assert len(t["migrations"]) == 1, t
    m = t["migrations"][0]
    assert (m["from"], m["to"], m["reason"], m["at_token"]) == (source, target, "forced", K)
    assert endpoints(t, "endpoint") == [(source, "migrated-from"), (target, "finished")]
    assert t["endpoints"][0]["decode_tokens"] == K and len(pieces) > K
    prefix, rest = "".join(pieces[:K]), "".join(pieces[K:])
    # What the target wrote is exactly its own greedy continuation of the delivered prefix: nothing repeated,
    # skipped or lost at the seam.
    assert independent_continuation(gateway, target, MESSAGES, prefix, len(pieces) - K) == rest
    if source == "device":  # the device's part is its own answer's start (one computation path)
        _, alone, _ = stream(gateway, {"policy": "device"}, max_tokens=K)
        assert "".join(alone) == prefix
    assert gateway.metric("tandem_migrations_total", source=source, target=target, reason="forced") == before + 1


def test_an_answer_shorter_than_k_is_not_moved(gateway):
    rid, pieces, _ = stream(gateway, {"policy": "device", "migrate_after_tokens": 4}, max_tokens=4)
    t = trace(gateway, rid)
    assert len(pieces) == 4
    assert t["migrations"] == [] and endpoints(t, "endpoint") == [("device", "finished")]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tandem": {"migrate_after_tokens": 0}}, "greater than or equal to 1"),
        ({"tandem": {"migrate_after_tokens": "soon"}}, "integer"),
        ({"tandem": {"migrate_after_tokens": 2**40}}, "less than or equal to"),
        ({"model": "device", "tandem": {"migrate_after_tokens": 8}}, "the model 'device' names one endpoint"),
        ({"tandem": {"migrate_after_tokens": 8, "privacy": "device"}}, "the privacy level 'device' keeps it off"),
    ],
)
def test_a_forced_migration_that_cannot_be_made_is_refused_naming_the_field(gateway, body, says):
    request = {"model": "tandem", "messages": MESSAGES, "max_tokens": 4, **body}
    r = httpx.post(gateway.v1 + "/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tandem.migrate_after_tokens"
    assert says in error["message"]
    assert httpx.get(gateway.url + "/health/ready", timeout=10).status_code == 200  # still serving
