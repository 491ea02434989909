"""Jupiter's layer partition (jupiter.txt §IV-B1, Eq. 1 reconstructed), as a pure function.

A pipeline of P stages on an ordered list of devices runs contiguous layer ranges, one per stage; its steady-state
period is the slowest stage's time. `partition_layers` chooses the ranges minimising that time Σ t_l / speed_s (or
each stage's own per-layer times), each stage's memory Σ m_l within its cap (∞ otherwise): an exact DP, O(P·L²)
time, O(P·L) memory (our copy of the paper lost Eq. 1: this objective is reconstructed from §IV-B1).

The sequence partition that flows prompts through those stages is policies/sequence_partition.py. Pure: numbers in,
plain values out; the staged worker (app/worker/layer_placement.py) profiles the layers and calls it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


class InfeasiblePlan(ValueError):
    """No plan satisfies the constraints (memory caps, sub-sequence lengths)."""


@dataclass(frozen=True)
class LayerPartition:
    """Contiguous [start, end) layer ranges, one per stage in stage order, with each stage's time and memory."""

    bounds: tuple[tuple[int, int], ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """The slowest stage's time: the pipeline's steady-state period."""
        return max(self.stage_times, default=0.0)


def _per_stage(value: float | Sequence[float] | None, stages: int, default: float, name: str) -> list[float]:
    if value is None:
        return [default] * stages
    if isinstance(value, int | float):
        return [float(value)] * stages
    out = [float(v) for v in value]
    if len(out) != stages:
        raise ValueError(f"{name} needs one value per stage ({stages}), got {len(out)}")
    return out


def partition_layers(
    layer_times: Sequence[float] | Sequence[Sequence[float]],
    stages: int,
    *,
    speeds: Sequence[float] | None = None,
    layer_memory: Sequence[float] | None = None,
    memory_caps: float | Sequence[float] | None = None,
    allow_empty: bool = False,
) -> LayerPartition:
    """Split L layers into `stages` contiguous ranges minimising the slowest stage's time, within memory caps.

    layer_times: profiled time of each layer on a reference stage, with `speeds` per-stage speed factors (stage s
    runs layers i..j in Σ t_l / speed_s; 2.0 = twice as fast as the reference); or one row per stage, each stage's
    own time of every layer (stage s runs layers i..j in Σ layer_times[s][l]: exact where the stages differ by more
    than a factor, e.g. a GPU that speeds the FFN up more than attention); then no speeds. layer_memory /
    memory_caps: bytes per layer (weights plus its KV cache at the planned context) and per-stage caps (one number
    for all stages, or one per stage). allow_empty: a stage may get no layers (a very slow device is then left
    out). Stages keep their order (the devices' chain). Exact DP:

        T(k, j) = min_i max(T(k − 1, i), time_k(i..j))   over memory-feasible ranges,   T(0, 0) = 0

    O(P·L²) with prefix sums. Ties keep the earliest split. Raises InfeasiblePlan when no partition fits.
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    rows = _stage_rows(layer_times, stages, speeds)
    n = len(rows[0])
    if not allow_empty and n < stages:
        raise InfeasiblePlan(f"{n} layers cannot fill {stages} non-empty stages")
    mem = [0.0] * n if layer_memory is None else [float(m) for m in layer_memory]
    if len(mem) != n:
        raise ValueError(f"layer_memory needs one value per layer ({n}), got {len(mem)}")
    caps = _per_stage(memory_caps, stages, math.inf, "memory_caps")
    if mem and max(mem) > max(caps):
        worst = max(range(n), key=lambda i: mem[i])
        raise InfeasiblePlan(f"layer {worst} needs {mem[worst]:g} bytes, more than any stage's cap ({max(caps):g})")

    pts = [list(itertools.accumulate(row, initial=0.0)) for row in rows]
    pm = list(itertools.accumulate(mem, initial=0.0))
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        pt, cap = pts[k - 1], caps[k - 1]
        for j in range(n + 1):
            # stage k takes layers [i, j); i runs downward so the memory check can stop early
            for i in range(j if allow_empty else j - 1, -1, -1):
                if pm[j] - pm[i] > cap * (1 + 1e-12):
                    break
                prev = best[k - 1][i]
                if prev == inf:
                    continue
                value = max(prev, pt[j] - pt[i])
                if value < best[k][j] or (value == best[k][j] and i < cut[k][j]):
                    best[k][j], cut[k][j] = value, i
    if best[stages][n] == inf:
        raise InfeasiblePlan(
            f"no contiguous partition of {n} layers onto {stages} stages fits the memory caps "
            f"(total {pm[n]:g} bytes, caps {caps})"
        )
    bounds: list[tuple[int, int]] = []
    j = n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    return LayerPartition(
        bounds=tuple(bounds),
        stage_times=tuple(pts[k][e] - pts[k][s] for k, (s, e) in enumerate(bounds)),
        stage_memory=tuple(pm[e] - pm[s] for s, e in bounds),
    )


def _stage_rows(
    layer_times: Sequence[float] | Sequence[Sequence[float]], stages: int, speeds: Sequence[float] | None
) -> list[list[float]]:
    """Each stage's time of every layer: the per-stage rows as given, or the reference row over each stage's speed."""
    per_stage = bool(layer_times) and isinstance(layer_times[0], Sequence)
    if per_stage:
        if speeds is not None:
            raise ValueError("per-stage layer times already hold each stage's speed: give no speeds")
        rows = [[float(t) for t in row] for row in layer_times]  # type: ignore[union-attr]
        if len(rows) != stages or len({len(r) for r in rows}) != 1:
            raise ValueError(f"per-stage layer times need {stages} rows of equal length")
    else:
        speed = _per_stage(speeds, stages, 1.0, "speeds")
        if any(s <= 0 or not math.isfinite(s) for s in speed):
            raise ValueError("speeds must be finite and > 0")
        rows = [[float(t) / sp for t in layer_times] for sp in speed]  # type: ignore[arg-type]
    if any(t < 0 or not math.isfinite(t) for row in rows for t in row):
        raise ValueError("layer times must be finite and >= 0")
    return rows
