"""The worker's prefill cost τ_s(x | y): seconds for x new positions after y cached ones, per pipeline stage, and
a staged worker's sequence partition over it.

One fit serves two readers: a staged worker's sequence partition (`SubsequencePlanner`, below) and the devices,
which get it in every OPEN reply (`prefill_tau`, one [a, b, c, d] per stage: plain numbers) and plan their own
prefill chunks with it (`chunking = "dp"`, clients/hat/prefill_plan.py). g, the decode-delay line the worker also
sends, is fitted on whatever passes ran (mostly a few positions) and has no context term, so it misprices prefill
chunks; τ is fitted only on lone pieces of consecutive positions (prefill chunks, and chains of drafts, which compute
the same), with the context and in-piece attention terms. A third reader: the scheduler prices each session's fair
share of a pass by it (`total`, app/worker/scheduler.py), so a worker whose sessions only verify learns it too.

Where the points come from: a start-up profile (`[worker] prefill_profile`: a few passes on a small grid; on by default
for a staged worker, whose sequence partition needs τ from the first prompt, off for a single-process one, where it
would cost every start several seconds on the default model), and every lone piece the worker runs afterwards.
Least squares with the x² term (`policies.sequence_partition.fit_chunk_cost`), refitted every `refit_every` new points;
with neither a profile nor given costs, at every new point until `refit_every` points have been seen (the first fit
rests on a handful of pieces and should not stand for 32 more), and with d tied to c/2: the devices' pieces come in a
few lengths only, which leave a, c and d apart undetermined (measured: a 2k-token DP plan of 32-token chunks from such a
fit). The profile's points are always kept, so the fit stays determined.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies.sequence_partition import (
    ChunkCost,
    PlanCache,
    SequenceProfile,
    equal_lengths,
    fit_chunk_cost,
    paper_partition,
    plan_makespan,
)

# The start-up profile's grid: three piece lengths (the x² term needs three) after no context and after 256 positions
PROFILE_XS = (16, 64, 192)
PROFILE_YS = (0, 256)

Point = tuple[int, int, list[float]]  # (x, y, seconds per stage)


@dataclass
class PrefillCostFit:
    """τ_s(x | y) per stage (`costs`, None until the points determine it) and the points it is fitted on."""

    stages: int
    costs: tuple[ChunkCost, ...] | None = None
    profiled: list[Point] = field(default_factory=list)  # the start-up profile (always kept)
    points: deque[Point] = field(default_factory=lambda: deque(maxlen=256))  # the last lone pieces run
    refit_every: int = 32
    min_len: int = 16  # shorter pieces are decode-sized: their time is mostly the pass's fixed cost
    version: int = 0  # bumped at every refit: plans made on an older fit are stale
    _new: int = 0
    _learning: bool = False  # no profile and no given costs: the fit rests on the pieces run so far

    def __post_init__(self) -> None:
        if self.costs is not None and len(self.costs) != self.stages:
            raise ValueError(f"{len(self.costs)} stage costs for {self.stages} stages")
        self._learning = self.costs is None and not self.profiled

    def observe(self, x: int, y: int, seconds: Sequence[float]) -> bool:
        """A prefill piece of x positions after y ran alone: seconds[s] on stage s. True when τ was refitted."""
        if len(seconds) != self.stages or x < self.min_len:
            return False
        self.points.append((x, y, [float(s) for s in seconds]))
        self._new += 1
        eager = self._learning and len(self.points) <= self.refit_every
        if self.costs is not None and self._new < (1 if eager else self.refit_every):
            return False
        # unprofiled: pieces of a few lengths only (the devices' chunk sizes), which cannot separate d from a and c
        fits = fit_stage_costs([*self.profiled, *self.points], self.stages, tied=self._learning)
        if fits is None:  # the points do not pin τ down yet (all of one length, or no context)
            return False
        self._new = 0
        self.costs = fits
        self.version += 1
        return True

    def set_profile(self, points: list[Point]) -> None:
        """A start-up profile's points: kept for good, and τ fitted on them (with any pieces seen so far)."""
        self.profiled = points
        fits = fit_stage_costs([*points, *self.points], self.stages)
        if fits is not None:
            self.costs, self._learning, self._new = fits, False, 0
            self.version += 1

    def total(self) -> ChunkCost | None:
        """τ(x | y) summed over the stages, a piece's compute time through all of them (None while undetermined):
        what the scheduler prices each session's fair share of a pass by."""
        if self.costs is None:
            return None
        return ChunkCost(*(sum(getattr(c, term) for c in self.costs) for term in ("a", "b", "c", "d")))

    def wire(self) -> list[list[float]] | None:
        """τ for the OPEN reply: [a, b, c, d] per stage, or None while undetermined."""
        if self.costs is None:
            return None
        return [[c.a, c.b, c.c, c.d] for c in self.costs]


def fit_stage_costs(points: Sequence[Point], stages: int, *, tied: bool = False) -> tuple[ChunkCost, ...] | None:
    """τ_s per stage by least squares with the x² term (tied: d = c/2), clamped non-negative; None if the points do
    not determine it. A fit may come out with small negative terms on a noisy box; the planners need τ non-negative."""
    try:
        fits = [
            fit_chunk_cost([(x, y, ts[s]) for x, y, ts in points], quadratic=True, tied=tied) for s in range(stages)
        ]
    except ValueError:
        return None
    return tuple(ChunkCost(max(c.a, 0.0), max(c.b, 0.0), max(c.c, 0.0), max(c.d, 0.0)) for c in fits)


def profile_points(
    session: Callable[[int], Callable[[int], list[float]]],
    xs: Sequence[int] = PROFILE_XS,
    ys: Sequence[int] = PROFILE_YS,
    reps: int = 2,
) -> list[Point]:
    """The start-up profile: for each context y, `session(y)` sets up a session holding y positions and returns
    `run(x)`, which times a piece of x positions after them on every stage and crops the session back to y. Each
    point is the least of `reps` runs (other work on the box only ever adds time)."""
    points: list[Point] = []
    for y in ys:
        run = session(y)
        for x in xs:
            best: list[float] | None = None
            for _ in range(reps):
                ts = run(x)
                best = ts if best is None else [min(a, b) for a, b in zip(best, ts, strict=True)]
            assert best is not None
            points.append((x, y, best))
    return points


@dataclass
class SubsequencePlanner:
    """Splits a prefill piece of n tokens after `context` cached ones into sub-sequences for the pipeline.

    mode "dp": Jupiter's sequence partition (policies.sequence_partition.plan_sequence, exact flow-shop makespan) on the
    per-stage costs τ_s (`fit`: the start-up profile refitted from the lone prefill pieces the worker runs; one piece
    while τ is undetermined); "equal": equal lengths, the count with the least modelled makespan; "paper": Jupiter's own
    rule (policies.sequence_partition.paper_partition: min-max sub-sequences per count, the count by Eq. 4), the
    baseline; "off": one piece. τ_s(x | context + y) = a + (b + c·context)·x + c·x·y + d·x², so a piece after `context`
    tokens is planned as a prompt from 0 with b shifted; the context is rounded to `context_step` so plans are reused
    (an LRU per profile, dropped when τ is refitted).
    """

    fit: PrefillCostFit
    mode: str = "dp"
    min_len: int = 16
    granularity: int = 16
    context_step: int = 64
    cache: PlanCache = field(default_factory=lambda: PlanCache(256))
    _planned_on: int = 0  # the fit's version the cached plans were made on

    @property
    def costs(self) -> tuple[ChunkCost, ...] | None:
        return self.fit.costs

    def observe(self, x: int, y: int, seconds: Sequence[float]) -> None:
        """A prefill piece of x tokens after y ran alone through the pipeline: seconds[s] on stage s."""
        self.fit.observe(x, y, seconds)

    def profile(self, context: int) -> SequenceProfile:
        if self.fit.costs is None:
            raise ValueError("τ is not determined yet")
        y0 = self.context_step * round(context / self.context_step)
        shifted = tuple(ChunkCost(c.a, c.b + c.c * y0, c.c, c.d) for c in self.fit.costs)
        return SequenceProfile(stages=shifted, min_len=self.min_len, granularity=self.granularity)

    def lengths(self, n: int, context: int) -> list[int]:
        if self.mode == "off" or n < 2 * self.min_len or self.fit.costs is None:
            return [n]
        if self._planned_on != self.fit.version:
            self.cache = PlanCache(self.cache.maxsize)
            self._planned_on = self.fit.version
        profile = self.profile(context)
        if self.mode == "paper":
            return paper_partition(profile, n)
        if self.mode == "equal":
            best, best_value = [n], math.inf
            for parts in range(1, n // self.min_len + 1):
                lengths = equal_lengths(n, parts, self.granularity)
                if min(lengths) < self.min_len:
                    break
                value = plan_makespan(profile.stages, lengths)
                if value < best_value:
                    best, best_value = lengths, value
            return best
        return list(self.cache.plan(profile, n).lengths)
