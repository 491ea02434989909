"""The statistics `tandem bench quality` reports: pass@1 with a Wilson interval, and two configurations compared on
the same problems (McNemar's exact test, a paired bootstrap interval of the difference)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion passed/n (95 % by default); (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def discordant(a: Sequence[bool], b: Sequence[bool]) -> tuple[int, int]:
    """(problems only `a` solves, problems only `b` solves), on the same problems in the same order."""
    if len(a) != len(b):
        raise ValueError(f"paired results need the same problems ({len(a)} against {len(b)})")
    only_a = sum(x and not y for x, y in zip(a, b, strict=True))
    only_b = sum(y and not x for x, y in zip(a, b, strict=True))
    return only_a, only_b


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """McNemar's exact two-sided p-value: under no difference each discordant problem goes either way with
    probability 1/2, so the smaller count is binomial(only_a + only_b, 1/2)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap(
    a: Sequence[bool], b: Sequence[bool], resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """A percentile bootstrap interval of pass@1(a) − pass@1(b), resampling problems (each keeps both results)."""
    discordant(a, b)  # the same problems, or ValueError
    n = len(a)
    if n == 0:
        return 0.0, 0.0
    differences = np.array([int(x) - int(y) for x, y in zip(a, b, strict=True)], dtype=float)
    rows = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    low, high = np.quantile(differences[rows].mean(axis=1), [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)
