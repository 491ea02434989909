"""clients/grammar.py over a Hugging Face tokenizer: one TokenMask masks numpy and torch logits, a head padded past
the tokenizer's vocabulary included, and steps over drafts tentatively (try_accept / rollback)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from clients.grammar import GrammarError, HFTokenizerGrammars

PAD = 5  # head rows past the tokenizer's vocabulary (padded embeddings)


@pytest.fixture(scope="module")
def tiny(byte_tokenizer):
    """The byte-level tokenizer (conftest.py) and its grammars, <eos> (257) the end token."""
    return byte_tokenizer, HFTokenizerGrammars(byte_tokenizer, [257], threading.Lock())


def _id(tok, text: str) -> int:
    (i,) = tok.encode(text)
    return i


def test_torch_and_numpy_masks_with_a_padded_head(tiny) -> None:
    tok, grammars = tiny
    mask = grammars.mask('start: "ab" "c"')
    vocab = len(tok) + PAD
    allowed = mask.allowed()
    assert allowed[256] and allowed.sum() >= 1
    for logits in (torch.randn(vocab), torch.randn(3, vocab)):
        out = mask.apply(logits)
        assert out.shape == logits.shape and out.dtype == logits.dtype
        assert torch.isinf(out[..., len(tok) :]).all()  # padded rows: never picked
        finite = torch.isfinite(out[..., : len(tok)])
        assert (finite == torch.from_numpy(allowed[: len(tok)])).all()
        assert torch.equal(out[..., 256], logits[..., 256])  # allowed rows keep their values
    arr = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    out = mask.apply(arr)
    assert np.isinf(out[len(tok) :]).all() and out[256] == arr[256]
    assert (np.isfinite(out[: len(tok)]) == allowed[: len(tok)]).all()
    assert int(torch.argmax(mask.apply(torch.zeros(vocab) + torch.arange(vocab)))) in np.flatnonzero(allowed)


def test_tentative_drafts_roll_back_and_the_end_is_eos_only(tiny) -> None:
    tok, grammars = tiny
    mask = grammars.mask('start: "ab" "c"')
    c = _id(tok, "c")
    assert not mask.try_accept(c)  # refused, and the state is unchanged
    assert mask.try_accept(256) and mask.try_accept(c)
    assert mask.finished
    assert np.flatnonzero(mask.allowed()).tolist() == [257]  # complete: only the end may follow
    mask.rollback(2)
    assert not mask.finished and mask.allowed()[256]
    mask.advance([256])
    mask.accept(c)
    assert mask.finished
    with pytest.raises(GrammarError):
        grammars.mask('start: "ab"').accept(c)
