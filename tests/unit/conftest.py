"""Shared fixtures for the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Batch invariance (bit-identical rows) holds with one intra-op thread; with more, BLAS may split rows. A module
    that compares rows bit for bit marks itself `pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    """A tiny random Llama (no weights needed): 4 layers, hidden 32, 4 query / 2 KV heads, vocabulary 96."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: the 256 byte tokens (a character outside ASCII spans several), "ab" (256), and
    <eos> (257)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ab"] = len(vocab)
    rust = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<eos>")
    assert tok.encode("ab") == [256] and tok.eos_token_id == 257
    return tok
