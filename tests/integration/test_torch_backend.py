"""TorchBackend on real SmolLM2-135M: token-exact greedy decoding, continuation, cancellation, concurrency.

TorchBackend keeps no cache: an input (prompt + delivered prefix) is prefilled in fixed chunks from position 0, then
decoded a token at a time, so the same input gives the same answer (compared exactly); a reference computed along
another path (transformers' generate, or the original answer's decode of what a continuation prefills) is held to
hf_fixtures' near-tie rule.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from clients.base import Backend, BackendError, GenerationRequest, TokenEvent
from clients.hf_model import IncrementalDetokenizer
from clients.torch_local import TorchBackend
from tests.integration.hf_fixtures import chat_prompt, check_against_reference, relayed, smollm, top2_gap  # noqa: F401

N = 16


async def _backend(pair: tuple[Any, Any]) -> TorchBackend:
    model, tok = pair
    b = TorchBackend(model=model, tokenizer=tok, name="torch-test", model_id="smollm2-135m-instruct")
    assert not await b.ready()
    await b.start()
    assert await b.ready()
    return b


async def _collect(b: TorchBackend, req: GenerationRequest) -> list[TokenEvent]:
    return [ev async for ev in b.stream(req)]


def _ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


@torch.inference_mode()
def _hf_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' own greedy answer (up to its end token) and each pick's top-2 logit gap."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    tokens = out.sequences[0, len(ids) :].tolist()
    gaps = [top2_gap(step[0]) for step in out.logits]
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end], gaps


@pytest.mark.asyncio
async def test_greedy_matches_hf_generate_and_text_is_consistent(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    model, tok = smollm
    b = await _backend(smollm)
    try:
        assert isinstance(b, Backend)
        prompt = chat_prompt(tok, "List three fruits, one per line.")
        events = await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=N, temperature=0))
        ids = _ids(events)
        reference, gaps = _hf_greedy(model, b.tokenize(prompt), N)
        check_against_reference(ids, reference, gaps)  # generate prefills the prompt whole: another path
        assert events[-1].finish_reason in ("stop", "length")
        assert all(e.finish_reason is None for e in events[:-1])
        if events[-1].finish_reason == "length":
            assert len(ids) == N
        assert "".join(e.text for e in events) == b.detokenize(ids)
        # prompt_ids give the same answer as prompt_text
        again = await _collect(
            b, GenerationRequest(prompt_text="", prompt_ids=tuple(b.tokenize(prompt)), max_tokens=N, temperature=0)
        )
        assert _ids(again) == ids
    finally:
        await b.close()
    assert not await b.ready()


@pytest.mark.asyncio
async def test_continue_from_prefix_ids_and_text(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    b = await _backend(smollm)
    try:
        prompt = chat_prompt(tok, "Write one sentence about the sea.")
        full = _ids(await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=N, temperature=0)))
        assert len(full) == N
        k = 6
        rest = await _collect(
            b, GenerationRequest(prompt_text=prompt, prefix_ids=tuple(full[:k]), max_tokens=N - k, temperature=0)
        )
        # A continuation is its input, prompt + prefix, as a fresh prompt: prefilled in the same chunks (one path).
        as_prompt = GenerationRequest(
            prompt_text="", prompt_ids=(*b.tokenize(prompt), *full[:k]), max_tokens=N - k, temperature=0
        )
        assert _ids(rest) == _ids(await _collect(b, as_prompt))
        # ... and goes on with the same answer: the original decoded the prefix a token at a time (the near-tie rule,
        # on the original's own top-2 logprobs).
        scored = await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=N, temperature=0, logprobs=2))
        gaps = [e.logprobs[0].top[0][1] - e.logprobs[0].top[1][1] for e in scored if e.token_id is not None]
        assert _ids(scored) == full
        check_against_reference(_ids(rest), full[k:], gaps[k:])
        # The text path: delivered text, re-tokenised by the backend; its input is prompt + those tokens.
        prefix_text = b.detokenize(full[:k])
        rest_t = await _collect(
            b, GenerationRequest(prompt_text=prompt, prefix_text=prefix_text, max_tokens=N - k, temperature=0)
        )
        retokenised = GenerationRequest(
            prompt_text="", prompt_ids=(*b.tokenize(prompt), *b.tokenize(prefix_text)), max_tokens=N - k, temperature=0
        )
        assert _ids(rest_t) == _ids(await _collect(b, retokenised))
        assert prefix_text + "".join(e.text for e in rest_t) == b.detokenize([*b.tokenize(prefix_text), *_ids(rest_t)])
    finally:
        await b.close()


@pytest.mark.asyncio
async def test_aclose_stops_generation_within_one_token(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    b = await _backend(smollm)
    try:
        req = GenerationRequest(prompt_text=chat_prompt(tok, "Count from 1 to 500."), max_tokens=400, temperature=0)
        before = b.tokens_generated
        it = b.stream(req)
        got = [await it.__anext__() for _ in range(3)]
        assert len(got) == 3
        await it.aclose()
        await b.wait_idle()
        # The thread may have produced at most the token it was working on when the flag was set.
        assert b.tokens_generated - before <= 3 + 1
    finally:
        await b.close()


@pytest.mark.asyncio
async def test_task_cancellation_stops_generation(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    b = await _backend(smollm)
    try:
        seen: list[TokenEvent] = []
        third = asyncio.Event()

        async def consume() -> None:
            async for ev in b.stream(
                GenerationRequest(prompt_text=chat_prompt(tok, "Tell me a long story."), max_tokens=400, temperature=0)
            ):
                seen.append(ev)
                if len(seen) == 3:
                    third.set()

        before = b.tokens_generated
        task = asyncio.create_task(consume())
        await asyncio.wait_for(third.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await b.wait_idle()
        assert b.tokens_generated - before <= len(seen) + 1
    finally:
        await b.close()


@pytest.mark.asyncio
async def test_two_concurrent_streams_complete_correctly(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    b = await _backend(smollm)
    try:
        reqs = [
            GenerationRequest(prompt_text=chat_prompt(tok, q), max_tokens=12, temperature=0)
            for q in ("What is the capital of France?", "Give me a synonym for happy.")
        ]
        solo = [_ids(await _collect(b, r)) for r in reqs]
        together = await asyncio.gather(*(_collect(b, r) for r in reqs))
        assert [_ids(evs) for evs in together] == solo
        assert all(evs[-1].finish_reason in ("stop", "length") for evs in together)
    finally:
        await b.close()


@pytest.mark.asyncio
async def test_sampling_is_seeded_and_limits_are_honoured(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    b = await _backend(smollm)
    try:
        prompt = chat_prompt(tok, "Say something surprising.")
        req = GenerationRequest(prompt_text=prompt, max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
        a, c = _ids(await _collect(b, req)), _ids(await _collect(b, req))
        assert a == c and a
        ev = await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=3, temperature=0))
        assert len(ev) == 3 and ev[-1].finish_reason == "length" and ev[-1].token_id is not None
        zero = await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=0))
        assert [(e.text, e.finish_reason) for e in zero] == [("", "length")]
        n, exact = b.count_tokens(prompt)
        assert exact and n == len(tok.encode(prompt, add_special_tokens=False))
    finally:
        await b.close()


@pytest.mark.asyncio
async def test_stop_strings_and_errors(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    b = await _backend(smollm)
    try:
        prompt = chat_prompt(tok, "List three fruits, one per line.")
        free = "".join(
            e.text for e in await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=N, temperature=0))
        )
        assert "\n" in free
        # Stop strings are the relay's (clients/token_emitter.py): the backend streams past them, and the relay fed
        # its events ends the answer with the text cut before the first one.
        request = GenerationRequest(prompt_text=prompt, max_tokens=N, temperature=0, stop=("\n",))
        events = await _collect(b, request)
        assert "".join(e.text for e in events) == free
        text, finish, _ = relayed(request, events)
        assert finish == "stop" and text == free.split("\n")[0]
        with pytest.raises(BackendError) as err:
            await _collect(b, GenerationRequest(prompt_text="", max_tokens=4))
        assert err.value.status == 400
    finally:
        await b.close()
    with pytest.raises(BackendError) as err:
        await _collect(b, GenerationRequest(prompt_text="hi"))
    assert err.value.status == 503


def test_incremental_detokenizer_never_splits_characters(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    _, tok = smollm
    text = "Grüße, 你好世界! 🎉🚀 naïve café — done."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(lambda x: tok.decode(x, skip_special_tokens=True))
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some byte pieces were held back until their character completed


@pytest.mark.asyncio
async def test_logprobs_and_penalties(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    """Logprobs are the model's log-softmax at each token's position; penalties / logit_bias change the pick."""
    model, tok = smollm
    b = await _backend(smollm)
    try:
        prompt = chat_prompt(tok, "Repeat the word 'apple' ten times.")
        ids = b.tokenize(prompt)
        events = await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=10, temperature=0, logprobs=3))
        got = _ids(events)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : len(ids) - 1 + len(got)]
        expected = torch.log_softmax(logits.float(), dim=-1)
        tokened = [e for e in events if e.token_id is not None]
        for i, e in enumerate(tokened):
            (entry,) = e.logprobs
            assert entry.logprob == pytest.approx(float(expected[i, got[i]]), abs=1e-3)
            assert [t[1] for t in entry.top] == sorted((t[1] for t in entry.top), reverse=True)
            assert entry.top[0][2] == entry.bytes  # greedy: the likeliest
        banned = GenerationRequest(
            prompt_text=prompt, max_tokens=10, temperature=0, frequency_penalty=2.0, logit_bias=((got[0], -100.0),)
        )
        other = _ids(await _collect(b, banned))
        assert other[0] != got[0] and other != got
    finally:
        await b.close()


@pytest.mark.asyncio
async def test_grammar_constrained_json_and_continuation(smollm: tuple[Any, Any]) -> None:  # noqa: F811
    """A json_schema grammar masks every pick (the answer ends with the grammar, "stop"); a continuation from a
    delivered JSON prefix completes that JSON; logprobs stay the model's own."""
    import json

    from app.serving.structured import _json_rule

    _, tok = smollm
    schema = {
        "type": "object",
        # Bounded, so the answer always fits max_tokens (an unbounded number can run on until it is cut).
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    grammar = "start: " + _json_rule(schema)
    b = await _backend(smollm)
    try:
        prompt = chat_prompt(tok, "Invent a person. Answer in JSON.")
        events = await _collect(b, GenerationRequest(prompt_text=prompt, max_tokens=40, temperature=0, grammar=grammar))
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"name", "age"} and type(value["age"]) is int
        prefix = '{"name": "Bo'
        req = GenerationRequest(
            prompt_text=prompt, prefix_text=prefix, max_tokens=40, temperature=0, grammar=grammar, logprobs=0
        )
        events = await _collect(b, req)
        text = prefix + "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", text
        assert json.loads(text)["name"].startswith("Bo")
        assert any(e.logprobs[0].logprob < -1e-3 for e in events if e.token_id is not None)
    finally:
        await b.close()
