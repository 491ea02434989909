"""The device's prompt cache on real llama.cpp states (SmolLM2-135M): states restored from RAM and from disk continue
exactly as the prefill they replace, files that do not match are removed unloaded, the bounds hold, interleaved
sessions keep their prefixes, a restarted gateway restores from disk, and the planner's view moves with the cache.

Greedy answers are compared on the reproducible path (one computation path: the restored chunks hold the bits the
prefill computes), with each token's raw log probability, so equal means the same logits, not only the same picks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from clients.base import GenerationRequest
from clients.llamacpp import CANONICAL_CHUNK, LlamaCppBackend
from clients.prompt_cache import PromptCacheOptions, as_tokens, state_name
from deploy.models import model_path

SMOL = "smollm2-135m-instruct"
ITEMS = " ".join(f"Item {i}: the {i}th entry of a list about apples, pears and plums." for i in range(14))
NOTES = " ".join(f"Note {i}: a line on rivers, hills and the weather of the day." for i in range(14))


def _backend(folder: Path, reproducible: bool = True, ram_mb: int = 64, disk_mb: int = 64) -> LlamaCppBackend:
    options = PromptCacheOptions(ram_mb=ram_mb, disk_mb=disk_mb, directory=folder, disk_min_tokens=64)
    return LlamaCppBackend(
        "device", model_path(SMOL), "smol", n_ctx=1024, n_threads=1, reproducible=reproducible, prompt_cache=options
    )


def _prompt(backend: LlamaCppBackend, text: str) -> tuple[int, ...]:
    return tuple(backend.tokenize_prompt(backend.render_chat([{"role": "user", "content": text}])))


async def _ask(backend: LlamaCppBackend, ids, max_tokens: int = 8, logprobs: int = 0):
    request = GenerationRequest("", prompt_ids=ids, max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    return [e async for e in backend.stream(request)]


def _answer(events) -> list[tuple[int | None, float | None]]:
    return [(e.token_id, e.logprobs[0].logprob if e.logprobs else None) for e in events]


def _whole_chunks(n: int) -> int:
    """What the reproducible path may take from a cache of an n-token input: whole chunks short of the last token's."""
    return (n - 1) // CANONICAL_CHUNK * CANONICAL_CHUNK


def test_a_state_restored_from_ram_and_from_disk_continues_as_the_prefill_it_replaces(tmp_path) -> None:
    async def run() -> None:
        first = _backend(tmp_path)
        await first.start()
        try:
            items, notes = _prompt(first, ITEMS), _prompt(first, NOTES)
            cold = await _ask(first, items)
            assert cold[0].cached_tokens == 0
            await _ask(first, notes)  # overwrites the live KV cache: the items' state is saved first
            assert first.cached_prefix(notes) == _whole_chunks(len(notes))
            # The planner's view: the items' prefix is served by the prompt cache now, not by the live cache.
            predicted = first.cached_prefix(items)
            assert predicted == _whole_chunks(len(items)) > 0
            warm = await _ask(first, items)
            assert warm[0].cached_tokens == predicted
            assert _answer(warm) == _answer(cold)
            d = first.prompt_cache.describe()
            assert d["restores_ram"] == 1 and d["restores_disk"] == 0 and d["tokens_restored"] == predicted
        finally:
            await first.close()  # the live state is saved, queued writes finish
        assert len(list(tmp_path.glob("*/*.kv"))) == 2  # both prefixes are long enough to persist

        restarted = _backend(tmp_path)
        await restarted.start()
        try:
            assert restarted.cached_prefix(items) == predicted  # known from the disk's index before any request
            again = await _ask(restarted, items)
            assert again[0].cached_tokens == predicted
            assert _answer(again) == _answer(cold)
            assert restarted.prompt_cache.describe()["restores_disk"] == 1
        finally:
            await restarted.close()

        # A flipped payload byte in the items' file: refused, removed, and the prompt prefilled (the same answer);
        # the notes' file is still restored.
        (path,) = tmp_path.glob(f"*/{state_name(as_tokens(items[:predicted]))}.kv")
        raw = bytearray(path.read_bytes())
        raw[-7] ^= 0x40
        path.write_bytes(raw)
        third = _backend(tmp_path)
        await third.start()
        try:
            prefilled = await _ask(third, items)
            assert prefilled[0].cached_tokens == 0 and _answer(prefilled) == _answer(cold)
            assert not path.exists()
            restored = await _ask(third, notes)
            assert restored[0].cached_tokens == _whole_chunks(len(notes))
            d = third.prompt_cache.describe()
            assert d["disk_refused"] == 1 and d["restores_disk"] == 1
        finally:
            await third.close()

    asyncio.run(run())


def test_the_fast_path_restores_the_same_next_token_distribution(tmp_path) -> None:
    """The fast path takes a restored state's every position and evaluates only the rest; the first token's
    distribution is the prefill's up to float reassociation (its last token is evaluated in another batch)."""

    async def run() -> None:
        backend = _backend(tmp_path, reproducible=False, disk_mb=0)
        await backend.start()
        try:
            items, notes = _prompt(backend, ITEMS), _prompt(backend, NOTES)
            cold = await _ask(backend, items, max_tokens=1, logprobs=10)
            await _ask(backend, notes, max_tokens=1)
            warm = await _ask(backend, items, max_tokens=1, logprobs=10)
            assert warm[0].cached_tokens == len(items) - 1
            assert backend.prompt_cache.describe()["restores_ram"] == 1
            before = {raw: logprob for _, logprob, raw in cold[0].logprobs[0].top}
            after = {raw: logprob for _, logprob, raw in warm[0].logprobs[0].top}
            shared = before.keys() & after.keys()
            assert len(shared) >= 8
            assert max(abs(before[t] - after[t]) for t in shared) < 0.02
        finally:
            await backend.close()

    asyncio.run(run())


def test_the_cache_stays_within_its_bounds_under_a_flood_of_distinct_prompts(tmp_path) -> None:
    async def run() -> None:
        # A SmolLM2 state is ~23 KB a token: 4 MiB hold one of these ~100-token prompts' states, 6 MiB on disk two.
        backend = _backend(tmp_path, ram_mb=4, disk_mb=6)
        await backend.start()
        try:
            for i in range(5):
                text = " ".join(f"Flood {i}.{j}: distinct words number {i * 100 + j}." for j in range(7))
                await _ask(backend, _prompt(backend, text), max_tokens=1)
                backend.prompt_cache.flush()
                d = backend.prompt_cache.describe()
                assert d["bytes"] <= 4 << 20 and d["disk_bytes"] <= 6 << 20
                assert sum(p.stat().st_size for p in tmp_path.glob("*/*.kv")) <= 6 << 20
            assert d["saves"] >= 4 and d["ram_evictions"] >= 3 and d["disk_evictions"] >= 2 and d["entries"] == 1
        finally:
            await backend.close()

    asyncio.run(run())


# --- the gateway: two sessions, what it says, a restart -------------------------------------------------------------

SYSTEM = "You are a careful assistant for a fruit shop. " + " ".join(
    f"Rule {i}: answer briefly and name the fruit {i}." for i in range(8)
)


def _config(folder: Path) -> str:
    return f"""
[gateway]
policy = "device"
[device]
reproducible = true
model = "{SMOL}"
n_ctx = 2048
prompt_cache_mb = 64
prompt_cache_disk_mb = 64
prompt_cache_disk_min_tokens = 64
prompt_cache_dir = "{folder}"
[disco]
profile_device = false
"""


@pytest.fixture(scope="module")
def kv_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def gateways(kv_folder) -> Iterator[list[GatewayProcess]]:
    """The module's gateways, one at a time: the last test restarts it on the same prompt-cache folder."""
    running = [start_gateway(_config(kv_folder))]
    yield running
    stop_gateway(running[-1])


CONVERSATIONS = {
    "a": ["Which fruit is best for a pie, and why?", "And for a smoothie?", "And for a salad?"],
    "b": ["How should plums be stored at home?", "For how many days do they keep?", "Can they be frozen?"],
}


def _turn(gw: GatewayProcess, history: list[dict], question: str) -> tuple[dict, list[dict]]:
    """One turn of a conversation: its answer appended to the history; the trace of the turn."""
    messages = [*history, {"role": "user", "content": question}]
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "tandem", "messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    trace = httpx.get(f"{gw.v1}/requests/{r.headers['x-request-id']}", timeout=10).json()
    return trace, [*messages, {"role": "assistant", "content": answer}]


def _device(trace: dict) -> dict:
    (device,) = trace["endpoints"]
    assert device["backend"] == "device"
    return device


def _prompt_cache(gw: GatewayProcess) -> dict:
    rows = httpx.get(gw.v1 + "/endpoints", timeout=10).json()["data"]
    return next(r for r in rows if r["name"] == "device")["prompt_cache"]


HISTORIES: dict[str, list[dict]] = {}
PROMPTS: dict[str, list[int]] = {"a": [], "b": []}  # each turn's prompt tokens


def test_two_interleaved_sessions_keep_both_prefixes(gateways) -> None:
    gw = gateways[-1]
    system = [{"role": "system", "content": SYSTEM}]
    for name, questions in CONVERSATIONS.items():  # a's first turn, then b's: b overwrites a's live KV cache
        trace, HISTORIES[name] = _turn(gw, system, questions[0])
        PROMPTS[name].append(trace["prompt_tokens"])
    shared = _device(trace)["cached_tokens"]  # what b's first turn took from a's: the system prompt's chunks
    assert 0 < shared < _whole_chunks(PROMPTS["a"][0])
    for name, questions in CONVERSATIONS.items():  # each second turn finds its own first turn's prefix
        trace, HISTORIES[name] = _turn(gw, HISTORIES[name], questions[1])
        PROMPTS[name].append(trace["prompt_tokens"])
        cached = _device(trace)["cached_tokens"]
        assert cached >= _whole_chunks(PROMPTS[name][0]) > shared, (name, cached, PROMPTS[name])
    d = _prompt_cache(gw)
    assert d["restores_ram"] >= 1 and d["hits"] >= 2 and d["hit_rate"] > 0 and d["entries"] >= 1


def test_endpoints_and_metrics_say_what_the_cache_holds(gateways) -> None:
    gw = gateways[-1]
    deadline = time.monotonic() + 30
    while (d := _prompt_cache(gw))["disk_entries"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # the idle snapshot and the writer thread, off the requests' path
    assert d["disk_entries"] >= 2 and 0 < d["disk_bytes"] <= d["disk_limit_bytes"] == 64 << 20
    assert d["bytes"] <= d["limit_bytes"] == 64 << 20 and 0 < d["token_hit_rate"] < 1
    assert gw.metric("tandem_prompt_cache_entries", backend="device", tier="disk") == d["disk_entries"]
    assert gw.metric("tandem_prompt_cache_bytes", backend="device", tier="ram") == d["bytes"]
    assert gw.metric("tandem_prompt_cache_restores_total", backend="device", tier="ram") == d["restores_ram"]
    assert gw.metric("tandem_prompt_cache_tokens_total", backend="device", kind="cached") == d["tokens_cached"]
    assert gw.metric("tandem_prompt_cache_lookups_total", backend="device") == d["lookups"] >= 4


def test_a_restarted_gateway_answers_the_next_turn_from_the_restored_prefix(gateways, kv_folder) -> None:
    stop_gateway(gateways[-1])
    gateways.append(start_gateway(_config(kv_folder)))
    gw = gateways[-1]
    d = _prompt_cache(gw)
    assert d["disk_entries"] >= 2 and d["entries"] == 0  # indexed from disk, nothing loaded yet
    for name, questions in CONVERSATIONS.items():  # each third turn: its second turn's prefix, read from disk
        trace, HISTORIES[name] = _turn(gw, HISTORIES[name], questions[2])
        assert _device(trace)["cached_tokens"] >= _whole_chunks(PROMPTS[name][1]), (name, trace, PROMPTS[name])
    assert _prompt_cache(gw)["restores_disk"] == 2
