"""Which pending frames share the HAT worker's next forward pass, and how large a prefill piece may be.

Why not the greedy packing: one tensor frame per session per pass up to max_batch_tokens puts a 3-position
verification round into the same pass as a 256-token prefill chunk, so the round waits for the whole pass (~2 s on
a CPU worker). SD-edge (sd-edge-pipeline.txt §III-B) batches with a DP over length-sorted tasks; on the worker the
setting is simpler and the DP is exact:

* The worker's ragged batching has no padding, so a pass over a group G costs T(G) = c2 + c1·Σ_{k∈G} x_k (the fitted
  delay predictor g(x) of HAT Eq. 2, x = tokens), and the frames pending at a tick share one release time.
* Minimising the mean completion time of the pending frames is then single-machine s-batching with additive batch
  times (Coffman, Yannakakis, Magazine, Santos 1990): some optimal schedule processes the frames shortest first in
  contiguous groups, and a DP over the split points of the sorted list finds it in O(n²):

      F[i] = min_{j > i} T(x_i + … + x_{j−1}) · (n − i) + F[j],   F[n] = 0

  (every frame not yet finished waits for each pass, so a pass's time counts once per frame still pending).

The engine runs only the first group and re-plans at the next tick, when new frames may have arrived. A frame left
out `max_defer` times in a row is forced into the next pass so a prefill is never starved by a stream of short
rounds (that constraint keeps the plan feasible, not provably optimal). With the worker's default max_defer = 0
every frame is forced at once: the plan is then one pass of everything, and only the sub-chunking below acts.

A pass cannot be pre-empted, so prefill frames longer than a pass budget are split into consecutive sub-chunks
(exact with the KV cache, as chunked prefill is). The budget comes from g, not a constant: the smallest piece whose
pass spends at most `overhead` of its time on g's fixed cost, X = c2·(1 − ε) / (ε·c1).

Pure: numbers in, plain lists out; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence


def pass_time(tokens: float, slope: float, intercept: float) -> float:
    """g(x) = slope·x + intercept, the fitted time of one pass over x tokens (never below 0)."""
    return max(0.0, slope * tokens + intercept)


def total_completion(groups: Sequence[Sequence[int]], sizes: Sequence[float], slope: float, intercept: float) -> float:
    """Σ over frames of their completion time when `groups` run one pass each, in order, from time 0."""
    t = total = 0.0
    for g in groups:
        t += pass_time(sum(sizes[i] for i in g), slope, intercept)
        total += t * len(g)
    return total


def plan_groups(
    sizes: Sequence[float],
    slope: float,
    intercept: float,
    *,
    max_tokens: float | None = None,
    forced: Collection[int] = (),
) -> list[list[int]]:
    """Indices of the pending frames grouped into passes, in run order, minimising the mean completion time.

    sizes: tokens of each frame's next piece. max_tokens: a group's token cap (a single larger frame still runs
    alone). forced: frames that must run in the first pass. Ties keep fewer, earlier passes.
    """
    n = len(sizes)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (sizes[i], i))
    xs = [float(sizes[i]) for i in order]
    prefix = [0.0]
    for x in xs:
        prefix.append(prefix[-1] + x)
    rank = {idx: pos for pos, idx in enumerate(order)}
    first_end_min = max((rank[i] + 1 for i in forced), default=1)  # the first group must reach every forced frame
    best = [math.inf] * (n + 1)
    nxt = [n] * (n + 1)
    best[n] = 0.0
    for i in range(n - 1, -1, -1):
        lo = max(i + 1, first_end_min) if i == 0 else i + 1
        for j in range(lo, n + 1):
            tokens = prefix[j] - prefix[i]
            if max_tokens is not None and j - i > 1 and tokens > max_tokens:
                break
            cost = pass_time(tokens, slope, intercept) * (n - i) + best[j]
            if best[i] == math.inf or cost < best[i] - 1e-12 * max(1.0, best[i]):
                best[i], nxt[i] = cost, j
        if best[i] == math.inf and i == 0:  # the cap cannot hold the forced frames: run them together anyway
            nxt[0] = first_end_min
            best[0] = pass_time(prefix[first_end_min], slope, intercept) * n + best[first_end_min]
    groups, i = [], 0
    while i < n:
        j = nxt[i]
        groups.append(order[i:j])
        i = j
    return groups


def subchunk_tokens(
    slope: float,
    intercept: float,
    *,
    overhead: float,
    min_tokens: int,
    max_tokens: int,
) -> int:
    """The largest prefill piece one pass may carry: X with c2 / (c2 + c1·X) = ε, i.e. X = c2·(1 − ε) / (ε·c1), where
    ε is `overhead` (the worker's subchunk_overhead: at most this share of a sub-chunk's pass is g's fixed cost).

    A smaller piece would spend more than ε of its pass on the fixed cost; a larger one would make every
    verification round that arrives meanwhile wait longer. Clamped to [min_tokens, max_tokens]; without a positive
    slope (g not fitted yet) there is no basis for splitting, so max_tokens.
    """
    if not 0.0 < overhead < 1.0:
        raise ValueError(f"overhead must be in (0, 1), got {overhead}")
    if slope <= 0 or not math.isfinite(slope):
        return max_tokens
    x = max(0.0, intercept) * (1.0 - overhead) / (overhead * slope)
    return int(min(max_tokens, max(min_tokens, math.ceil(x))))


def split_sizes(total: int, piece: int) -> list[int]:
    """Consecutive sub-chunk sizes of a `total`-token frame, each at most `piece`, sizes as equal as possible."""
    if total <= 0:
        return []
    parts = max(1, math.ceil(total / max(1, piece)))
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)
