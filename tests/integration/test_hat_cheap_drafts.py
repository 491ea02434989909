"""The device half's cheap heads (issue 40) on real weights (Qwen2.5-Coder-0.5B, the shipped adapter and reduced
draft vocabulary, a real worker on loopback): drafts from the int8 draft head, and verification by the int8 head exact
for the argmax, leave greedy output what the fp32 verification head makes it. This is also the suite's greedy HAT run
of the bundled default with everything it ships (its U-shape comparison: below).

What is exact by construction, and asserted as such: every emitted token is the fp32 verification head's argmax over
the deep states the worker returned for its position (the drafts only decide which positions a round verifies; the
int8 verification head recomputes in fp32 every row that can still be the argmax). What
is not: two runs whose drafts differ verify different row counts per pass, so the worker's deep states may differ in
the last bits and an exact near-tie may flip (README, "What is exact"); across runs the output is compared with
U-shape's as the rest of the suite does (test_hat.check_against_reference: equal, or a documented near-tie flip).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from clients.hat import rounds, station
from clients.hat.adapter import draft_files
from clients.hat.quant import Int8Linear
from clients.hat.tree import verify_tree
from clients.hat.verify import verify_round
from tests.integration.hf_fixtures import QWEN05, load
from tests.integration.test_hat import (
    WorkerServer,
    check_against_reference,
    collect,
    prompt_ids,
    token_ids,
    u_shape_greedy,
)

TOKENS = 20


@pytest.fixture(scope="module")
def qwen() -> tuple[Any, Any]:
    return load(QWEN05)


@pytest.fixture(scope="module")
def server(qwen) -> Iterator[WorkerServer]:
    s = WorkerServer(qwen[0], QWEN05, max_sessions=2).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(qwen) -> tuple[list[int], list[float]]:
    model, tok = qwen
    return u_shape_greedy(model, prompt_ids(tok), TOKENS)


@pytest.fixture
def verdicts(monkeypatch) -> list[tuple[torch.Tensor, list[int], list[int]]]:
    """Every verification the device half runs: (the deep states it verified — a tree's along its kept path —, the
    draft, the tokens it emitted)."""
    seen: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def recorded(job, head, token_bytes):
        verdict, lps = verify_round(job, head, token_bytes)
        seen.append((job.deep.clone(), list(job.draft.tokens), list(verdict.tokens)))
        return verdict, lps

    def recorded_tree(half, st, deep, draft, position):  # a lookup round's tree: its kept path is the round's chain
        new, path = verify_tree(half, st, deep, draft, position)
        seen.append((deep[path].clone(), [draft.tokens[n] for n in path[1:]], list(new)))
        return new, path

    monkeypatch.setattr(station, "verify_round", recorded)
    monkeypatch.setattr(rounds, "verify_round", recorded)
    monkeypatch.setattr(rounds, "verify_tree", recorded_tree)
    return seen


async def generate(server: WorkerServer, qwen, **options: Any) -> tuple[list[int], Any]:
    model, tok = qwen
    adapter, vocab = draft_files(QWEN05, 2)
    backend = server.backend(model, tok, QWEN05, adapter_path=adapter, draft_vocab_path=vocab, **options)
    await backend.start()
    try:
        got = token_ids(await collect(backend, prompt_ids(tok), max_tokens=TOKENS))
    finally:
        await backend.close()
    return got, backend


def fp32_argmax(half, deep: torch.Tensor) -> list[int]:
    """The fp32 head's argmax at each of `deep`'s rows, along the path the device half computed it: head_rows (a
    batch-invariant GEMM) with the fp32 head, or — with the int8 head exact for the argmax — each row's own fp32
    scores (ArgmaxHead.exact) over head_rows' best 16, among which the argmax surely is (the two fp32 paths differ
    by float reassociation, ~1e-5)."""
    scores = half.head_rows(deep)
    if half.argmax_head is None:
        return scores.argmax(-1).tolist()
    top = scores.topk(16, dim=-1).indices
    normed = half.output.norm(deep)
    return [int(ids[half.argmax_head.exact(x, ids).argmax()]) for x, ids in zip(normed, top, strict=True)]


def assert_verification_decided(got: list[int], backend, seen) -> None:
    """Each round's tokens are the fp32 verification head's argmax over the deep states it verified (recomputed here:
    the heads are batch-invariant, so the rows are the ones the station computed), and the output is the prefill's
    token followed by the rounds' tokens."""
    assert seen, "no verification round ran"
    emitted = got[:1]
    with torch.inference_mode():
        for deep, draft, tokens in seen:
            argmax = fp32_argmax(backend.half, deep)
            assert tokens == argmax[: len(tokens)]
            assert tokens[:-1] == draft[: len(tokens) - 1]  # accepted drafts, then the head's own token
            emitted += tokens
    assert got == emitted[: len(got)]


async def test_int8_heads_keep_greedy_output(server, qwen, reference, verdicts) -> None:
    ref, gaps = reference
    cheap, backend = await generate(server, qwen)  # the defaults: draft_precision and head_precision "int8"
    assert backend.half.draft_int8 is not None and isinstance(backend.half.adapter.block.self_attn.q_proj, Int8Linear)
    assert backend.half.argmax_head is not None and backend.half.argmax_head.candidates > 0  # it verified
    assert backend.stats.accepted > 0  # the cheap head's drafts were accepted: the rounds did verify them
    half = backend.half  # the shipped reduced draft vocabulary: the draft head scores its tokens, and only them
    logits = half.draft_logits(torch.zeros(1, half.hidden_size), 0)[0]
    outside = torch.ones(half.vocab_size, dtype=torch.bool)
    outside[half.draft_ids] = False
    assert torch.isinf(logits[outside]).all() and torch.isfinite(logits[~outside]).all()
    assert_verification_decided(cheap, backend, verdicts)
    cheap_rounds = len(verdicts)

    verdicts.clear()
    exact, fp32 = await generate(server, qwen, draft_precision="fp32", head_precision="fp32")
    assert fp32.half.draft_int8 is None and isinstance(fp32.half.adapter.block.self_attn.q_proj, torch.nn.Linear)
    assert fp32.half.argmax_head is None
    assert_verification_decided(exact, fp32, verdicts)
    print(f"rounds: int8 drafts {cheap_rounds}, fp32 drafts {len(verdicts)}")

    check_against_reference(cheap, ref, gaps)
    check_against_reference(exact, ref, gaps)
    check_against_reference(cheap, exact, gaps)
