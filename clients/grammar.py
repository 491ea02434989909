"""Grammar-constrained decoding on the device, with llguidance.

A constraint is an llguidance grammar (Lark syntax, `%json {...}` for JSON schemas,
`<[id]>` for a special token), built by the gateway from the request
(app/serving/structured.py). A backend that samples itself masks the logits of
every step with the tokens the grammar allows next and tells the matcher which
token it chose. Because the matcher can be advanced over tokens it did not choose,
an answer that moves to this backend mid-way continues under the same grammar from
exactly the delivered prefix (orchestrator: migration and fault rules).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np


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

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar forbids at -inf (a vocabulary longer than the grammar's, e.g.
        padded embeddings, is cut off too)."""
        allowed = self.allowed()
        out = np.full_like(logits, -np.inf)
        n = min(len(logits), len(allowed))
        out[:n] = np.where(allowed[:n], logits[:n], -np.inf)
        return out

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the answer ends here)."""
        return self._matcher.is_stopped()


class LlamaVocabGrammars:
    """TokenMasks for one llama.cpp model's vocabulary; its llguidance tokenizer is built once (~1.5 s), at the
    first constrained request."""

    def __init__(self, vocab, n_vocab: int):
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def mask(self, grammar: str) -> TokenMask:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                self._tokenizer = lltokenizer_from_vocab(self._vocab, n_vocab=self._n_vocab)
        return TokenMask(self._tokenizer, grammar)
