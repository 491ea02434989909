"""Which of a HAT backend's concurrent streams the drafting station (clients/hat/station.py) drafts together: exact.

The station's two stages, per group G of streams: the device's batched draft steps and verification head, d(G), and
the verify stage — upload, the worker's pass, download — v(G), each T(G) = c1·W(G) + c2 (SD-edge's Eq. 17 with
policies.sd_edge.Runtime fitted from the station's own timed passes, W(G) = Σ_{i∈G} w_i the group's work). The
station runs free: a group's next draft is made as soon as its verification is back, while the other groups are at
the worker. So in steady decoding every group goes round once per period

    P = max( Σ_m d(G_m),  Σ_m v(G_m),  max_m d(G_m) + v(G_m) )

(the device busy with every group's work, the verify stage likewise, and no group faster than its own round trip:
two equal groups give 2·max(d, v), one group d + v), and every stream's round takes P. SD-edge's Alg. 1 instead
charges a step barrier (Eq. 20: group 2's draft waits for nothing, but step n + 1 starts after step n's last
verification), a different machine — `alg1_stream_groups` keeps it, as the paper's baseline for the bench.

Exact optimum. With M groups the first two terms are M·c2 + c1·W (the same for every M-grouping) and the third is
c2^d + c2^v + (c1^d + c1^v)·max_m W(G_m): for each M the best grouping is the one with the least heaviest group
(makespan on M identical machines), found by branch and bound (heaviest work first, a new group opened only once,
pruned by the best found so far; exact), for M = 1..K; the best M wins (ties: fewer groups). Up to EXACT_STREAMS
streams; beyond, longest-processing-time first (within 4/3 of the optimum) — more than the station serves.

Context. A stream's work is its rows times what a row costs at its context: w_i = rows · (1 + context_i / span),
span = the context at which a row's attention costs as much as its weights (`attention_span`, from the model's
shape: Eqs. 11-14's FLOPs), normalised so that the mean stream's work is `rows` (the fits are per row at the
streams' mean context).

Pure: numbers in, lists out; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from policies.cost import ModelArch
from policies.sd_edge import PassFlops, Runtime, plan_batches

EXACT_STREAMS = 14  # branch and bound up to this many streams (a few ms); longest-processing-time first beyond


def attention_span(arch: ModelArch) -> float:
    """The context (positions attended) at which one row's attention FLOPs equal its weights' FLOPs."""
    flops = PassFlops.of(arch)
    return flops.per_token / flops.per_pair


def stream_work(contexts: Sequence[int], rows: float, span: float = math.inf) -> list[float]:
    """Each stream's work in rows: rows · (1 + context / span), scaled so that the streams' mean is `rows`."""
    raw = [rows * (1.0 + c / span) for c in contexts]
    mean = sum(raw) / len(raw) if raw else 1.0
    return [rows * w / mean for w in raw]


def round_period(groups: Sequence[Sequence[int]], work: Sequence[float], device: Runtime, verify: Runtime) -> float:
    """P of a grouping: the free-running station's steady round time (see the module docstring)."""
    loads = [sum(work[i] for i in g) for g in groups if g]
    d = [float(device(1, w)) for w in loads]
    v = [float(verify(1, w)) for w in loads]
    return max(sum(d), sum(v), max(a + b for a, b in zip(d, v, strict=True)))


def min_heaviest(work: Sequence[float], count: int) -> list[list[int]]:
    """`work`'s indices in `count` groups (none empty) with the least heaviest group: exact by branch and bound up
    to EXACT_STREAMS items, longest-processing-time first beyond."""
    n = len(work)
    count = max(1, min(count, n))
    order = sorted(range(n), key=lambda i: (-work[i], i))
    best_groups = _lpt(work, order, count)
    if n > EXACT_STREAMS:
        return best_groups
    best = max(sum(work[i] for i in g) for g in best_groups)
    floor = max(max(work), sum(work) / count)
    loads = [0.0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    eps = 1e-12 * max(1.0, best)

    def place(k: int, used: int) -> bool:  # True once a grouping meets the lower bound (nothing can beat it)
        nonlocal best, best_groups
        if n - k < count - used:  # too few items left to fill the empty groups
            return False
        if k == n:
            top = max(loads)
            if top < best - eps:
                best, best_groups = top, [list(g) for g in members]
            return best <= floor + eps
        i = order[k]
        for g in range(min(used + 1, count)):  # a new group only as the next one: no symmetric repeats
            if loads[g] + work[i] >= best - eps:
                continue
            loads[g] += work[i]
            members[g].append(i)
            done = place(k + 1, max(used, g + 1))
            members[g].pop()
            loads[g] -= work[i]
            if done:
                return True
        return False

    place(0, 0)
    return best_groups


def _lpt(work: Sequence[float], order: Sequence[int], count: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for i in order:
        g = min(range(count), key=lambda j: (loads[j], j))
        groups[g].append(i)
        loads[g] += work[i]
    return groups


def plan_stream_groups(
    contexts: Sequence[int], device: Runtime, verify: Runtime, rows_per_stream: float, span: float = math.inf
) -> list[list[int]]:
    """The grouping of streams (indices into `contexts`) with the least round period P: exact (module docstring).
    Each group lists its streams by context; groups are in the order of their shortest context."""
    if not contexts:
        return []
    work = stream_work(contexts, rows_per_stream, span)
    best: tuple[float, list[list[int]]] | None = None
    for m in range(1, len(contexts) + 1):
        groups = min_heaviest(work, m)
        period = round_period(groups, work, device, verify)
        if best is None or period < best[0] * (1 - 1e-12):
            best = (period, groups)
    assert best is not None
    by_context = [sorted(g, key=lambda i: (contexts[i], i)) for g in best[1] if g]
    return sorted(by_context, key=lambda g: (contexts[g[0]], g[0]))


def alg1_stream_groups(
    contexts: Sequence[int], device: Runtime, verify: Runtime, rows_per_stream: float, steps: int = 1
) -> list[list[int]]:
    """SD-edge's Alg. 1 (corrected; policies/sd_edge.py) over the streams, the paper's baseline: contiguous groups of
    the context-sorted streams under Eq. 20's step barrier, every stream `rows_per_stream` rows (context does not
    enter its times: the paper pads a batch to its longest input, which ragged batching does not)."""
    if not contexts:
        return []
    n = max(1, int(steps))

    def times(batch: int, _longest: int) -> tuple[np.ndarray, np.ndarray]:
        return (
            np.full(n, float(device(batch, rows_per_stream))),
            np.full(n, float(verify(batch, rows_per_stream))),
        )

    return plan_batches(contexts, None, 1, 0.0, 1, times=times).batches
