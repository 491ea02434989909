"""Grammar-constrained decoding on the device, with llguidance.

A constraint is an llguidance grammar (Lark syntax, `%json {...}` for JSON schemas,
`<[id]>` for a special token), built by the gateway from the request
(app/serving/structured.py). A backend that samples itself masks the logits of
every step with the tokens the grammar allows next and tells the matcher which
token it chose. Because the matcher can be advanced over tokens it did not choose,
an answer that moves to this backend mid-way continues under the same grammar from
exactly the delivered prefix (orchestrator: migration and fault rules).

One TokenMask serves every backend: llama.cpp's (numpy logits, a vocabulary from the GGUF through
`LlamaVocabGrammars`) and the torch-based ones (torch logits, a Hugging Face tokenizer through `HFTokenizerGrammars`:
clients/torch_local.py, the HAT device half). Speculative decoding (HAT) walks the matcher over a round's drafts
tentatively (`try_accept`) and steps back (`rollback`) once the round is verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from clients.base import BackendError, GenerationRequest

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """The grammar does not compile (e.g. a JSON schema feature llguidance does not support)."""


def check_grammar(grammar: str) -> None:
    """Raise GrammarError when `grammar` does not compile (cheap: no tokenizer needed)."""
    message = llguidance.LLMatcher.validate_grammar(grammar)  # "" when it compiles
    if message:
        raise GrammarError(message.strip())


class TokenMask:
    """One generation's grammar state over one vocabulary."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self._matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._vocab = tokenizer.vocab_size
        self._bits = llg_numpy.allocate_token_bitmask(1, self._vocab)

    def advance(self, ids: Sequence[int]) -> None:
        """Move the grammar over tokens already generated (a continuation's delivered prefix)."""
        for token in ids:
            if not self._matcher.consume_token(int(token)):
                raise GrammarError(f"the delivered prefix does not fit the grammar: {self._matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens the grammar allows next."""
        llg_numpy.fill_next_token_bitmask(self._matcher, self._bits)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)

    def apply(self, logits: Any) -> Any:
        """`logits` ([vocab] or [rows, vocab]; numpy, or torch) with every token the grammar forbids at -inf. A
        vocabulary longer than the grammar's (e.g. a head padded past the tokenizer) has its extra rows at -inf too."""
        allowed = self.allowed()
        if isinstance(logits, np.ndarray):
            out = np.full_like(logits, -np.inf)
            n = min(logits.shape[-1], len(allowed))
            out[..., :n] = np.where(allowed[:n], logits[..., :n], -np.inf)
            return out
        import torch

        n = min(logits.shape[-1], len(allowed))
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[:n] = torch.from_numpy(allowed[:n])
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the grammar: {self._matcher.get_error()}")

    def try_accept(self, token: int) -> bool:
        """Consume `token` if the grammar allows it (True), else leave the state as it is (False): a draft."""
        return self._matcher.try_consume_tokens([int(token)]) == 1

    def rollback(self, n: int) -> None:
        """Forget the last `n` consumed tokens (a speculative round's tentative drafts)."""
        if n > 0 and not self._matcher.rollback(n):
            raise GrammarError(f"cannot roll the grammar back {n} tokens: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the answer ends here)."""
        return self._matcher.is_stopped()


class _Grammars:
    """TokenMasks for one model's vocabulary; its llguidance tokenizer is built once (1.5-2 s), at the first
    constrained request, whichever thread asks first."""

    def __init__(self) -> None:
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _build(self) -> llguidance.LLTokenizer:
        raise NotImplementedError

    def mask(self, grammar: str) -> TokenMask:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build()
        return TokenMask(self._tokenizer, grammar)

    async def for_request(
        self, request: GenerationRequest, answer_prefix: Callable[[], Sequence[int]], backend: str
    ) -> TokenMask | None:
        """The request's grammar (None without one), advanced over the delivered prefix (`answer_prefix()`'s ids)
        when the grammar covers it. Built on a worker thread: the first mask builds the vocabulary (~2 s). A 400
        naming `backend` when the grammar does not compile or the prefix does not fit it. Without a grammar, the
        request's optional tool grammar, always over the prefix; where that does not fit (a prefix another endpoint
        wrote unconstrained), the answer goes on without it."""
        grammar, optional = request.grammar, False
        if grammar is None:
            grammar, optional = request.tool_grammar, True
        if grammar is None:
            return None

        def build() -> TokenMask:
            mask = self.mask(grammar)
            if request.grammar_covers_prefix or optional:
                mask.advance(answer_prefix())
            return mask

        try:
            return await asyncio.to_thread(build)
        except GrammarError as exc:
            if optional:
                log.info("%s: the tool-call grammar does not fit this answer (%s); going on without it", backend, exc)
                return None
            raise BackendError(f"grammar: {exc}", status=400, backend=backend) from exc


class LlamaVocabGrammars(_Grammars):
    """TokenMasks for one llama.cpp model's vocabulary."""

    def __init__(self, vocab, n_vocab: int):
        super().__init__()
        self._vocab = vocab
        self._n_vocab = n_vocab

    def _build(self) -> llguidance.LLTokenizer:
        from llguidance.llamacpp import lltokenizer_from_vocab

        return lltokenizer_from_vocab(self._vocab, n_vocab=self._n_vocab)


class HFTokenizerGrammars(_Grammars):
    """TokenMasks for a Hugging Face (fast) tokenizer's vocabulary. `eos_ids`: the tokens that end an answer (the
    grammar allows them once it is complete); `lock`: the caller's lock around the shared Rust tokenizer, if any."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], lock: Any = None):
        super().__init__()
        self._hf = tokenizer
        self._eos = sorted(int(t) for t in eos_ids)
        self._hf_lock = lock

    def _build(self) -> llguidance.LLTokenizer:
        from llguidance.hf import from_tokenizer

        with self._hf_lock if self._hf_lock is not None else contextlib.nullcontext():
            return from_tokenizer(self._hf, eos_token=self._eos or None)
