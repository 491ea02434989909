"""Prompt tokenisation with the text between special tokens cached.

llama.cpp tokenises a prompt with special tokens honoured by splitting it at every special token
(`<|im_start|>`, `<|im_end|>`, ...) and running the BPE on each piece of text between them on its own. So
the same pieces give the same tokens wherever they appear, and a chat sends the same pieces again and
again: the system prompt on every request, the whole history on every turn. Caching the pieces makes a
prompt's tokenisation cost its new text only — and on a machine where the tokenizer's tables have gone cold
between requests, a short prompt's tokenisation was ~0.2 ms of the gateway's time to first token.

Exact by construction, and only used where the construction holds: no special token inside another, none
that strips the whitespace around it, no end-of-sequence token appended. Otherwise every prompt goes to
llama.cpp whole (`cached` is False).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

import llama_cpp

_SPLIT_AT = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
_STRIPS = llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP | llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
_MAX_PIECES = 4096
_MAX_PIECE_CHARS = 1 << 20


class PromptTokenizer:
    def __init__(self, llm: llama_cpp.Llama) -> None:
        self._llm = llm
        vocab = llm._model.vocab
        specials: dict[str, int] = {}
        unknown = llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN  # llama.cpp splits at these too: no caching around them
        exact = not llama_cpp.llama_vocab_get_add_eos(vocab)
        for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
            attr = llama_cpp.llama_vocab_get_attr(vocab, token)
            if attr & unknown or (attr & _SPLIT_AT and attr & _STRIPS):
                exact = False
            elif attr & _SPLIT_AT:
                text = llama_cpp.llama_vocab_get_text(vocab, token).decode("utf-8", errors="replace")
                specials.setdefault(text, token)
        texts = sorted(specials, key=len, reverse=True)
        if any(a != b and a in b for a in texts for b in texts):
            exact = False  # llama.cpp splits longest-first over the whole prompt; a regex goes left to right
        self.cached = exact and bool(texts)
        self._specials = specials
        self._pattern = re.compile("|".join(re.escape(t) for t in texts)) if self.cached else None
        self._bos = [llm.token_bos()] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        if not self.cached:
            return self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        ids = list(self._bos)
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                ids += self._piece(text[start : match.start()])
            ids.append(self._specials[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                return ids
        ids = self._llm.tokenize(piece.encode("utf-8"), add_bos=False, special=False)
        if len(piece) <= _MAX_PIECE_CHARS:
            with self._lock:
                self._pieces[piece] = ids
                if len(self._pieces) > _MAX_PIECES:
                    self._pieces.popitem(last=False)
        return ids
