"""Per-token logprobs: keeping them in step with the relayed text, and computing them from logits (numpy, for
llama.cpp; the torch sources use clients/sampling.py).

The relay (app/serving/relay.py) enforces stop sequences on text, which may hold back part of a token's
text until the next token decides it. `LogprobAligner` releases text only at token boundaries, so every delta's
text is exactly the concatenation of its tokens' texts. A token cut by a stop sequence keeps its logprob (and
alternatives) and carries only the part of its text that was delivered; tokens wholly inside the stop sequence
(or after it) are dropped with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from clients.base import TokenEvent, TokenLogprob
from policies.quality import TokenConfidence


class LogprobAligner:
    def __init__(self) -> None:
        self._entries: deque[TokenLogprob] = deque()
        self._text = ""  # released by the stop matcher, not yet sent (waits for its token's end)

    def add(self, event: TokenEvent) -> None:
        if event.logprobs is not None:
            for entry in event.logprobs:
                self._entries.append(entry if entry.token is not None else replace(entry, token=event.text))
        elif event.text:  # an endpoint that sent text without logprobs although they were asked for
            self._entries.append(TokenLogprob(None, event.text.encode(), (), event.text))

    def release(self, text: str, final: bool = False) -> tuple[str, tuple[TokenLogprob, ...]]:
        """The part of (held + `text`) that ends on a token boundary, and those tokens' logprobs; at the end of
        the answer (`final`) everything that was released, the last token trimmed if a stop sequence cut it."""
        buf = self._text + text
        entries = self._entries
        out: list[TokenLogprob] = []
        n = 0
        while entries and n + len(entries[0].token) <= len(buf):
            entry = entries.popleft()
            n += len(entry.token)
            out.append(entry)
        if final:
            if n < len(buf) and entries:
                rest = buf[n:]
                out.append(replace(entries.popleft(), token=rest, bytes=rest.encode("utf-8")))
            entries.clear()
            self._text = ""
            return buf, tuple(out)
        if n == 0 and out:  # only empty-text tokens (a character's first bytes): they go with the next text
            entries.extendleft(reversed(out))
            out = []
        self._text = buf[n:]
        return buf[:n], tuple(out)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float32, copy=False) - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


def confidence_of(logprobs: np.ndarray) -> TokenConfidence:
    """How sure a row of log probabilities is: its top probability, the top two's margin, its entropy (nats)."""
    second, top = np.partition(logprobs, -2)[-2:]
    probs = np.exp(logprobs)
    entropy = -float(np.dot(probs, logprobs))
    return TokenConfidence(float(np.exp(top)), float(np.exp(top) - np.exp(second)), max(0.0, entropy))


def entry_from_logprobs(logprobs: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """The entry of `token` from a row of log probabilities, with its `top` most likely alternatives."""
    alternatives: Sequence[int] = ()
    if top > 0:
        idx = np.argpartition(-logprobs, top - 1)[:top]
        alternatives = idx[np.argsort(-logprobs[idx], kind="stable")].tolist()
    tops = []
    for i in alternatives:
        raw = piece(int(i))
        tops.append((raw.decode("utf-8", errors="replace"), float(logprobs[i]), raw))
    return TokenLogprob(float(logprobs[token]), piece(token), tuple(tops))


class NumpyLogitAdjuster:
    """OpenAI's presence / frequency penalties over the answer's tokens and logit_bias, on a numpy logits row:
    logit[j] += bias[j] - frequency * count[j] - presence * (count[j] > 0)."""

    def __init__(self, vocab: int, presence: float, frequency: float, bias: Sequence[tuple[int, float]], answer=()):
        self.presence, self.frequency = presence, frequency
        self.bias = None
        if bias:
            self.bias = np.zeros(vocab, dtype=np.float32)
            for tok, value in bias:
                self.bias[tok] = value
        self.counts = np.zeros(vocab, dtype=np.float32) if (presence or frequency) else None
        for tok in answer:
            self.accept(tok)

    def accept(self, token: int) -> None:
        if self.counts is not None and 0 <= token < self.counts.shape[0]:
            self.counts[token] += 1

    def apply(self, logits: np.ndarray) -> np.ndarray:
        if self.bias is not None:
            logits = logits + self.bias
        if self.counts is not None:
            logits = logits - self.frequency * self.counts - self.presence * (self.counts > 0)
        return logits
