"""The llama.cpp device backend on the bundled 0.5B: KV prefix reuse is measured, not assumed.

A migration to the device continues from prompt + delivered tokens; llama.cpp reuses the longest prefix its
KV cache still holds (e.g. the prompt, when the device lost the first-token race), and DiSCo's migration cost
(Eq. 5) and booking count only what is really prefilled. The backend's prediction (`cached_prefix`) and what
it reports on the first event (`cached_tokens`) must agree with each other and with what llama.cpp did.
"""

from __future__ import annotations

import asyncio
from itertools import pairwise

from clients.base import GenerationRequest
from clients.llamacpp import CANONICAL_CHUNK, LlamaCppBackend
from deploy.models import model_path


async def _collect(backend: LlamaCppBackend, request: GenerationRequest):
    return [e async for e in backend.stream(request)]


def test_kv_prefix_reuse_is_predicted_and_reported() -> None:
    async def run() -> None:
        backend = LlamaCppBackend("device", model_path("qwen2.5-coder-0.5b-instruct"), "qwen", n_ctx=512, n_threads=1)
        await backend.start()
        try:
            chat = backend.render_chat([{"role": "user", "content": "Count from one to twenty, in words."}])
            prompt = tuple(backend.tokenize_prompt(chat))
            ask = GenerationRequest("", prompt_ids=prompt, max_tokens=4, temperature=0.0, logprobs=0)
            first = await _collect(backend, ask)
            assert backend.evaluations == 1  # the orchestrator re-asks cached_prefix only when this moves
            assert first[0].cached_tokens == 0  # nothing evaluated before: a cold cache
            assert all(e.cached_tokens is None for e in first[1:])
            delivered = [e.token_id for e in first[:2]]
            predicted = backend.cached_prefix([*prompt, *delivered])
            assert predicted == len(prompt) + 1  # the prompt and the first delivered token are still in the cache
            cont = GenerationRequest(
                "", prompt_ids=prompt, prefix_ids=tuple(delivered), max_tokens=2, temperature=0.0, logprobs=0
            )
            again = await _collect(backend, cont)
            assert again[0].cached_tokens == predicted
            # One computation path: the second delivered token is evaluated alone on the cache cells that held the
            # prompt and the first, as the first answer's decode evaluated it, so even the logits are the same.
            assert _answer(again) == _answer(first[2:4])
            other = backend.tokenize_prompt("A different prompt entirely.")
            assert backend.cached_prefix(other) == 0
        finally:
            await backend.close()

    asyncio.run(run())


def test_tokens_come_in_lockstep_in_order_and_stop_at_once_on_close() -> None:
    """The model thread computes a token only once the reader has taken the previous one, so a reader that
    pauses gets the same tokens in the same order, and closing the stream computes no further token. (Reproducible:
    the same request again is evaluated as the first was, not from the first's cache, so its tokens compare.)"""

    async def run() -> None:
        backend = LlamaCppBackend(
            "device", model_path("smollm2-135m-instruct"), "smol", n_ctx=512, n_threads=1, reproducible=True
        )
        await backend.start()
        try:
            chat = backend.render_chat([{"role": "user", "content": "Count from one to fifty, in words."}])
            prompt = tuple(backend.tokenize_prompt(chat))
            request = GenerationRequest("", prompt_ids=prompt, max_tokens=24, temperature=0.0)
            whole = await _collect(backend, request)
            assert len(whole) >= 4

            stream = backend.stream(request)
            first = await anext(stream)
            await asyncio.sleep(0.3)
            assert backend.tokens_generated == len(whole) + 1  # nothing computed ahead of the reader
            paused = [first, *[e async for e in stream]]
            assert [e.token_id for e in paused] == [e.token_id for e in whole]
            assert all(a.t <= b.t for a, b in pairwise(paused))

            stream = backend.stream(request)
            before = backend.tokens_generated
            await anext(stream)
            await anext(stream)
            await stream.aclose()
            for _ in range(50):
                if backend.active == 0:
                    break
                await asyncio.sleep(0.01)
            assert backend.active == 0  # the thread is free again
            assert backend.tokens_generated - before == 2  # and computed no token after the close
        finally:
            await backend.close()

    asyncio.run(run())


def _answer(events) -> list[tuple[int | None, float | None]]:
    """Each token with its raw log probability: equal floats mean the same logits, not just the same argmax."""
    return [(e.token_id, e.logprobs[0].logprob if e.logprobs else None) for e in events]


def test_reproducible_path_gives_the_same_answer_whatever_the_cache_holds() -> None:
    """On the reproducible path an input is evaluated in the same chunks from position 0 however it arrives, so the
    logits — not only the picks — are bit-identical: cold, repeated, after another prompt sharing its start, and as
    a continuation (prompt + delivered prefix) against the same tokens sent as a fresh prompt."""

    async def run() -> None:
        backend = LlamaCppBackend(
            "device", model_path("qwen2.5-coder-0.5b-instruct"), "qwen", n_ctx=512, n_threads=1, reproducible=True
        )
        await backend.start()
        try:
            system = {
                "role": "system",
                "content": "You are a patient teacher. Explain things step by step, with one short example for "
                "each step, in plain words a newcomer to programming understands, and end with a one-line summary.",
            }
            question = {"role": "user", "content": "Explain how a hash map works, and why lookups are fast on average."}
            chat = backend.render_chat([system, question])
            prompt = tuple(backend.tokenize_prompt(chat))
            assert len(prompt) > 2 * CANONICAL_CHUNK, len(prompt)

            def ask(ids, prefix=None, max_tokens=12):
                request = GenerationRequest(
                    "", prompt_ids=ids, prefix_ids=prefix, max_tokens=max_tokens, temperature=0.0, logprobs=0
                )
                return _collect(backend, request)

            cold = await ask(prompt)
            assert cold[0].cached_tokens == 0
            repeated = await ask(prompt)
            # Whole chunks are kept; the chunk holding the last token is evaluated again, as on a cold cache.
            assert repeated[0].cached_tokens == (len(prompt) - 1) // CANONICAL_CHUNK * CANONICAL_CHUNK > 0
            assert _answer(repeated) == _answer(cold)

            other = backend.render_chat([system, {"role": "user", "content": "Name three colours."}])
            await ask(tuple(backend.tokenize_prompt(other)), max_tokens=3)  # the cache now holds another prompt
            again = await ask(prompt)
            assert 0 < again[0].cached_tokens < repeated[0].cached_tokens  # only the shared system prompt's chunks
            assert again[0].cached_tokens % CANONICAL_CHUNK == 0
            assert _answer(again) == _answer(cold)

            # A continuation is the same input as the prompt with the delivered tokens appended.
            delivered = tuple(e.token_id for e in cold[:5])
            predicted = backend.cached_prefix([*prompt, *delivered])
            continued = await ask(prompt, prefix=delivered, max_tokens=6)
            assert continued[0].cached_tokens == predicted
            fresh = await ask(prompt + delivered, max_tokens=6)
            assert _answer(continued) == _answer(fresh)
        finally:
            await backend.close()

    asyncio.run(run())
