"""Token picking for the torch-based token sources (clients/torch_local.py, clients/hat/device.py).

One rule everywhere: greedy at temperature 0, else softmax(logits / T) cut to the top_k likeliest tokens (when
top_k > 0) and to those at least min_p times as likely as the likeliest (llama.cpp's min_p, when > 0),
nucleus-filtered to top_p (the top token is always kept) and drawn from the caller's generator.
Speculative decoding must accept drafts against exactly the distribution plain decoding samples from, so both go
through `probabilities`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

from clients.base import GenerationRequest, TokenLogprob


def probabilities(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> torch.Tensor:
    """The distribution a sampler draws from: softmax(logits / T), cut to the top_k likeliest tokens (top_k > 0) and
    to those at least min_p times as likely as the likeliest before T (min_p > 0, as llama.cpp cuts them),
    nucleus-filtered to top_p and renormalised.

    Works on [..., vocab].
    """
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        floor = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)
    if 0 < top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> tuple[int, torch.Tensor]:
    """The next token and the distribution it was chosen from (plain softmax when greedy: a draft's confidence)."""
    if temperature <= 0:
        return int(torch.argmax(logits)), torch.softmax(logits, dim=-1)
    probs = probabilities(logits, temperature, top_p, top_k, min_p)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> int:
    """The next token alone (greedy skips the softmax `choose` would compute)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    return choose(logits, temperature, top_p, generator, top_k, min_p)[0]


def seeded_generator(temperature: float, seed: int | None) -> torch.Generator | None:
    """A request's generator: None when greedy, else seeded from `seed` or, without one, from the OS."""
    if temperature <= 0:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator


class LogitAdjuster:
    """OpenAI's presence / frequency penalties (counted over the answer's tokens, a continued prefix included) and
    logit_bias, applied to logits before a token is picked: logit[j] += bias[j] - frequency * count[j] -
    presence * (count[j] > 0). Speculative verification applies it to each verified position with the drafts
    before that position counted (`extra`), so drafts are accepted against exactly the distribution plain
    decoding would sample from."""

    def __init__(self, request: GenerationRequest, answer: Sequence[int] = ()) -> None:
        self.presence, self.frequency = request.presence_penalty, request.frequency_penalty
        self.bias_pairs = request.logit_bias
        self.answer = list(answer)
        self._bias: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def _ready(self, vocab: int) -> None:
        if self._counts is None:
            self._counts = torch.zeros(vocab)
            for tok in self.answer:
                self.accept(tok)
            if self.bias_pairs:
                self._bias = torch.zeros(vocab)
                for tok, value in self.bias_pairs:
                    if tok < vocab:
                        self._bias[tok] = value

    def accept(self, token: int) -> None:
        if self._counts is None:
            self.answer.append(token)
        elif 0 <= token < self._counts.shape[0]:
            self._counts[token] += 1

    def apply(self, logits: torch.Tensor, extra: Sequence[int] = ()) -> torch.Tensor:
        self._ready(logits.shape[-1])
        out = logits.float()
        if self._bias is not None:
            out = out + self._bias
        if self.presence or self.frequency:
            counts = self._counts
            if extra:
                counts = counts.clone()
                counts.index_add_(0, torch.tensor(list(extra), dtype=torch.long), torch.ones(len(extra)))
            out = out - self.frequency * counts - self.presence * (counts > 0).float()
        return out


def token_logprob(logits: torch.Tensor, token: int, top: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """`token`'s entry (clients.base.TokenLogprob) from the raw logits it was sampled from, with `top`
    alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tops = ()
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        tops = tuple(
            (piece(i).decode("utf-8", errors="replace"), float(v), piece(i))
            for v, i in zip(values.tolist(), ids.tolist(), strict=True)
        )
    return TokenLogprob(float(logprobs[token]), piece(token), tops)


def speculative_sample(
    target: torch.Tensor | Callable[[int], torch.Tensor],
    draft: Sequence[torch.Tensor],
    tokens: Sequence[int],
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.).

    target: [k+1, V] — the LLM's distributions at the k draft positions and one past them — or a function
    i -> row i (computed lazily). draft: the k draft distributions the tokens were sampled from. Returns
    (accepted drafts a, the next token). The accepted drafts followed by the next token are distributed exactly
    as tokens sampled from the target model one at a time.
    """
    row = target if callable(target) else target.__getitem__
    k = len(tokens)
    for i in range(k):
        p, q, d = row(i), draft[i], int(tokens[i])
        qd = float(q[d])
        u = float(torch.rand((), generator=generator))
        if qd > 0 and u < min(1.0, float(p[d]) / qd):
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(row(k), 1, generator=generator))
