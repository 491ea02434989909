"""HAT prompt chunking (Eq. 3): how many tokens of a long prompt to send per chunk.

Why: the device uploads chunk k+1 while the cloud computes chunk k. Too small
a chunk and the per-chunk compute overhead (the cloud's delay shrinks little
with fewer tokens) piles up; too large and there is little overlap. HAT picks
the X at which uploading one chunk takes as long as the cloud's waiting plus
computing it:

    X * A / beta_up = (g(mu) + g(mu + X)) / P                      (Eq. 3)

A = bytes of one token's hidden state, beta_up = upload bytes/s, g = predicted
cloud compute delay (s) for a batch of that many tokens, mu = current batched
token count, P = pipeline length. Pure: numbers in, a number out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

DelayModel = Callable[[float], float] | tuple[float, float]


def as_delay_fn(g: DelayModel) -> Callable[[float], float]:
    """A callable g(x) from a callable or linear coefficients (slope s/token, intercept s)."""
    if callable(g):
        return g
    slope, intercept = g
    return lambda x: slope * x + intercept


def chunk_size(
    *,
    token_bytes: float,
    beta_up: float,
    g: DelayModel,
    mu: float,
    pipeline: int = 1,
    min_chunk: int = 16,
    max_chunk: int = 1024,
) -> int:
    """Solve Eq. 3 for the chunk size X, clamped to [min_chunk, max_chunk].

    f(X) = X*A/beta_up - (g(mu) + g(mu+X))/P is increasing for any g that grows slower than the upload time (the
    usual case: compute is sublinear in batch size). If uploading even `min_chunk` tokens already takes longer than
    computing them, return `min_chunk` (upload-bound: smallest chunks overlap best). If compute dominates for every
    size up to `max_chunk`, return `max_chunk` (compute-bound: chunking only adds per-chunk overhead).
    Linear g is solved in closed form; any other g by integer bisection.
    """
    if min_chunk < 1 or max_chunk < min_chunk:
        raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {min_chunk}, {max_chunk}")
    if token_bytes <= 0 or beta_up <= 0 or pipeline < 1:
        raise ValueError("token_bytes and beta_up must be positive and pipeline >= 1")
    up = token_bytes / beta_up  # seconds per token uploaded

    if not callable(g):
        slope, intercept = g
        g0 = slope * mu + intercept
        denom = up - slope / pipeline
        numer = 2 * g0 / pipeline  # X*up = (g0 + g0 + slope*X) / P, solved for X
        if denom <= 0:
            return max_chunk if numer >= 0 else min_chunk
        x = numer / denom
        if not math.isfinite(x):
            return max_chunk
        return int(min(max(round(x), min_chunk), max_chunk))

    fn = as_delay_fn(g)
    g_mu = fn(mu)

    def f(x: int) -> float:
        return x * up - (g_mu + fn(mu + x)) / pipeline

    if f(min_chunk) >= 0:
        return min_chunk
    if f(max_chunk) <= 0:
        return max_chunk
    lo, hi = min_chunk, max_chunk  # f(lo) < 0 < f(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return lo if abs(f(lo)) <= abs(f(hi)) else hi


def split_prompt(length: int, chunk: int) -> list[int]:
    """Chunk lengths covering a prompt of `length` tokens (the last chunk may be shorter)."""
    if length < 0 or chunk < 1:
        raise ValueError(f"need length >= 0 and chunk >= 1, got {length}, {chunk}")
    full, rest = divmod(length, chunk)
    return [chunk] * full + ([rest] if rest else [])


def chunk_bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) token ranges of consecutive chunks."""
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out
