"""`tandem bench disco --timing`: policy recomputation and decision time, against the paper's pseudocode.

Recomputation for 1K/10K/100K samples is measured against a line-by-line transcription of Alg. 2/3 (sort + Python
loop) in the same run, and the per-request decision time (medians of repeats), for BENCHMARKS.md.
"""

from __future__ import annotations

import math
import time

import numpy as np

from app.tools.bench.disco_trace import SERVER_PRESETS
from policies.dispatch import DEFAULT_ALPHA, DiscoD, DiscoS, DispatchPolicy


def literal_alg3(lengths: np.ndarray, budget: float) -> tuple[dict[int, tuple[int, int]], float]:
    """Alg. 3 as printed (the timing baseline and a cross-check, not used to decide anything):
    p(l) by sorting (np.unique), l_th by a running sum over the sorted support, then the
    map P[l] = (I_d, I_s) over the support. Returns (P, l_th)."""
    vals, cnt = np.unique(lengths, return_counts=True)
    tokens = (vals * cnt).tolist()
    target = (1.0 - budget) * float(sum(tokens))
    acc, l_th = 0.0, math.inf
    for v, t in zip(vals.tolist(), tokens, strict=True):
        if acc + t >= target * (1 - 1e-12):
            l_th = v
            break
        acc += t
    return {v: ((1, 0) if v < l_th else (1, 1)) for v in vals.tolist()}, l_th


def literal_alg2(lengths: np.ndarray, ttft: np.ndarray, budget: float, alpha: float) -> dict[int, float]:
    """Alg. 2 as printed (timing baseline and cross-check): F from a fully sorted sample,
    p(l) by np.unique, a Python loop over the sorted support filling W[l]."""
    s = np.sort(ttft)
    n = s.shape[0]

    def finv(p: float) -> float:
        return float(s[min(n - 1, max(0, math.ceil(p * n - 1e-9) - 1))])

    m = min(alpha, budget)
    w_tail = finv(1.0 - m) if m > 0 else math.inf
    vals, cnt = np.unique(lengths, return_counts=True)
    w = dict.fromkeys(vals.tolist(), w_tail)
    if budget <= alpha:
        return w
    q_tail = (n - int(np.searchsorted(s, w_tail, side="right"))) / n
    total = float((vals * cnt).sum())
    avail = budget - q_tail
    for v, c in zip(vals.tolist(), cnt.tolist(), strict=True):
        cost = v * c / total * (1.0 - q_tail)
        if avail * (1 + 1e-12) >= cost:
            w[v] = 0.0
            avail -= cost
        else:
            p_start = min(1.0, q_tail + avail * total / (v * c))
            w[v] = min(0.0 if p_start >= 1.0 else finv(1.0 - p_start), w_tail)
            break
    return w


def timing(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), seed: int = 0) -> str:
    """Policy recompute time per sample count (ours vs the literal pseudocode in the same run)
    and per-request decide time, medians of repeats, as a markdown table."""
    import random

    rng = np.random.default_rng(seed)
    server = SERVER_PRESETS["gpt"]
    lines = [
        "| policy | samples | recompute median (ms) | literal Alg. 2/3 median (ms) | speed-up | decide median (µs) |",
        "|---|---|---|---|---|---|",
    ]

    def median_ms(fn, repeats: int) -> float:
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(0.05 + 0.9 * (i % 10) / 9)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    for n in sizes:
        lengths = np.maximum(1, np.rint(rng.lognormal(math.log(48), 0.6, n))).astype(np.int64)
        ttft = rng.lognormal(math.log(server.median), server.sigma, n)
        probe = lengths[:1000].tolist()
        repeats = 50 if n <= 10_000 else 15
        for cls in (DiscoS, DiscoD):
            pol = cls(random.Random(seed))

            def ours_fn(b: float, p: DispatchPolicy = pol, x: np.ndarray = lengths, t: np.ndarray = ttft) -> None:
                p.recompute(prompt_lengths=x, server_ttft=t, budget=b)

            def base_fn(b: float, lit: bool = cls is DiscoS, x: np.ndarray = lengths, t: np.ndarray = ttft) -> None:
                if lit:
                    literal_alg3(x, b)
                else:
                    literal_alg2(x, t, b, DEFAULT_ALPHA)

            ours, base = median_ms(ours_fn, repeats), median_ms(base_fn, repeats)
            pol.recompute(prompt_lengths=lengths, server_ttft=ttft, budget=0.5)
            per = []
            calls = 20_000
            for _ in range(7):
                t0 = time.perf_counter()
                for j in range(calls):
                    pol.decide(probe[j % 1000], 0.5)
                per.append((time.perf_counter() - t0) / calls)
            lines.append(
                f"| {cls.name} | {n:,} | {ours:.3f} | {base:.3f} | {base / ours:.1f}× | {np.median(per) * 1e6:.2f} |"
            )
    return "\n".join(lines)
