"""Jupiter's sequence partition (policies/sequence_partition.py): the DP against brute force, the flow-shop
recursion against a discrete-event simulation, the DP against equal splits, one chunk, the paper's rule and HAT's
Eq. 3."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque

import pytest

from policies.layer_partition import InfeasiblePlan
from policies.sequence_partition import (
    ChunkCost,
    PlanCache,
    SequenceProfile,
    compare_device_prefill,
    completion_times,
    equal_lengths,
    fit_chunk_cost,
    makespan,
    paper_partition,
    plan_device_prefill,
    plan_makespan,
    plan_sequence,
)

# --- helpers ------------------------------------------------------------------------------------------------------


def simulate(times: list[list[float]]) -> tuple[float, dict[tuple[int, int], float]]:
    """A discrete-event simulation of sub-sequences flowing through stages: each stage is one server with a FIFO
    queue in front of it; all sub-sequences wait at stage 0 from time 0. Returns the makespan and every finish."""
    stages, jobs = len(times), len(times[0]) if times else 0
    queues = [deque(range(jobs)) if s == 0 else deque() for s in range(stages)]
    busy = [False] * stages
    events: list[tuple[float, int, int, int]] = []  # (time, tie, stage, job)
    tie = itertools.count()
    finish: dict[tuple[int, int], float] = {}

    def start_idle(now: float) -> None:
        for s in range(stages):
            if not busy[s] and queues[s]:
                job = queues[s].popleft()
                busy[s] = True
                heapq.heappush(events, (now + times[s][job], next(tie), s, job))

    start_idle(0.0)
    now = 0.0
    while events:
        now, _, s, job = heapq.heappop(events)
        finish[(s, job)] = now
        busy[s] = False
        if s + 1 < stages:
            queues[s + 1].append(job)
        start_idle(now)
    return (now if jobs else 0.0), finish


def compositions(total: int) -> list[list[int]]:
    """Every way to write total as an ordered sum of positive parts."""
    out = []
    for mask in range(1 << max(0, total - 1)):
        parts, last = [], 0
        for b in range(total - 1):
            if mask >> b & 1:
                parts.append(b + 1 - last)
                last = b + 1
        parts.append(total - last)
        out.append(parts)
    return out


def grid_ok(lengths: list[int] | tuple[int, ...], n: int, *, min_len: int, granularity: int, max_len=None) -> bool:
    if sum(lengths) != n:
        return False
    edges = list(itertools.accumulate(lengths))[:-1]
    if any(e % granularity for e in edges):
        return False
    if n < min_len:
        return list(lengths) == [n]
    return all(x >= min_len and (max_len is None or x <= max_len) for x in lengths)


def random_cost(rng: random.Random, scale: float = 1.0) -> ChunkCost:
    return ChunkCost(
        a=rng.choice([0.0, rng.uniform(0, 2)]) * scale,
        b=rng.uniform(0.05, 1.0) * scale,
        c=rng.choice([0.0, rng.uniform(0, 0.05)]) * scale,
        d=rng.choice([0.0, rng.uniform(0, 0.05)]) * scale,
    )


# --- flow shop ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_flow_shop_recursion_equals_discrete_event_simulation(seed: int) -> None:
    rng = random.Random(seed)
    stages, jobs = rng.randint(1, 5), rng.randint(1, 8)
    times = [[rng.choice([0.0, rng.uniform(0, 5), rng.uniform(0, 50)]) for _ in range(jobs)] for _ in range(stages)]
    span, finish = simulate(times)
    assert makespan(times) == pytest.approx(span)
    c = completion_times(times)
    for (s, k), t in finish.items():
        assert c[s][k] == pytest.approx(t)


def test_flow_shop_small_cases() -> None:
    assert makespan([]) == 0.0
    assert makespan([[1.0, 2.0, 3.0]]) == pytest.approx(6.0)  # one stage: the sum
    # Two stages, the second slow: first chunk's stage-1 time plus all of stage 2.
    assert makespan([[1, 1, 1], [5, 5, 5]]) == pytest.approx(16.0)
    with pytest.raises(ValueError):
        completion_times([[1, 2], [3]])


# --- the cost model -----------------------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients() -> None:
    true = ChunkCost(a=0.16, b=0.007, c=2e-6)
    pts = [(x, y, true(x, y)) for x in (16, 64, 256) for y in (0, 256, 1024)]
    got = fit_chunk_cost(pts)
    for name in "abc":
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6)
    assert got.d == 0.0
    quad = ChunkCost(a=0.01, b=0.001, c=1e-6, d=5e-7)
    rng = random.Random(0)
    pts = [(x, y, quad(x, y) * (1 + rng.uniform(-1e-4, 1e-4))) for x in (8, 32, 128, 512) for y in (0, 128, 2048)]
    got = fit_chunk_cost(pts, quadratic=True)
    assert (got.a, got.b, got.c, got.d) == pytest.approx((quad.a, quad.b, quad.c, quad.d), rel=1e-2, abs=1e-4)
    with pytest.raises(ValueError, match="do not determine"):
        fit_chunk_cost([(16, 0, 1.0), (32, 0, 2.0)])  # no context: c is unknown
    with pytest.raises(ValueError):
        fit_chunk_cost([])


# --- sequence partition -------------------------------------------------------------------------------------------


def brute_sequence(stages, n, *, min_len, granularity, max_len=None) -> float:
    best = math.inf
    for parts in compositions(n):
        if grid_ok(parts, n, min_len=min_len, granularity=granularity, max_len=max_len):
            best = min(best, plan_makespan(stages, parts))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_sequence_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    p = rng.choice([1, 2, 2, 3, 3, 4])
    stages = tuple(random_cost(rng, scale=rng.choice([0.1, 1.0, 10.0])) for _ in range(p))
    n = rng.randint(1, 14)
    min_len, granularity = rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 3])
    max_len = rng.choice([None, None, max(min_len, rng.randint(3, 8))])
    profile = SequenceProfile(stages=stages, min_len=min_len, granularity=granularity, max_len=max_len)
    expected = brute_sequence(stages, n, min_len=min_len, granularity=granularity, max_len=max_len)
    if expected == math.inf and n >= min_len:
        with pytest.raises(InfeasiblePlan):
            plan_sequence(profile, n)
        return
    plan = plan_sequence(profile, n)
    assert plan.exact and plan.grid == granularity
    assert grid_ok(plan.lengths, n, min_len=min_len, granularity=granularity, max_len=max_len)
    assert plan.makespan == pytest.approx(plan_makespan(stages, plan.lengths))
    if n >= min_len:
        assert plan.makespan == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(12))
def test_sequence_dp_never_worse_than_equal_splits_one_chunk_or_the_paper(seed: int) -> None:
    rng = random.Random(100 + seed)
    p = rng.randint(1, 4)
    stages = tuple(
        ChunkCost(a=rng.uniform(0, 0.2), b=rng.uniform(1e-4, 1e-2), c=rng.choice([0, 1e-6, 1e-5])) for _ in range(p)
    )
    n = rng.randint(100, 700)
    g, min_len = rng.choice([8, 16]), rng.choice([16, 32])
    profile = SequenceProfile(stages=stages, min_len=min_len, granularity=g)
    plan = plan_sequence(profile, n)
    assert plan.exact
    assert grid_ok(plan.lengths, n, min_len=min_len, granularity=g)
    tol = 1e-9 * plan.makespan
    assert plan.makespan <= plan_makespan(stages, [n]) + tol
    for parts in range(1, n // min_len + 1):
        lengths = equal_lengths(n, parts, g)
        if all(x >= min_len for x in lengths):
            assert plan.makespan <= plan_makespan(stages, lengths) + tol
    assert plan.makespan <= plan_makespan(stages, paper_partition(profile, n)) + tol


def test_later_subsequences_are_shorter_when_attention_grows() -> None:
    # Equal stages, strong attention (x·y to the context and x²/2 inside the sub-sequence): the paper's observation
    # that equal lengths are not optimal, since later sub-sequences attend to more.
    stages = (ChunkCost(a=0.01, b=1e-3, c=2e-5, d=1e-5),) * 3
    plan = plan_sequence(SequenceProfile(stages=stages, min_len=16, granularity=16), 1024)
    assert len(plan.lengths) > 1 and plan.lengths[0] > plan.lengths[-1]
    assert plan.makespan < plan_makespan(stages, equal_lengths(1024, len(plan.lengths), 16))


def test_sequence_edge_cases() -> None:
    stage = ChunkCost(a=0.1, b=0.01)
    short = plan_sequence(SequenceProfile(stages=(stage, stage), min_len=32, granularity=16), 20)
    assert short.lengths == (20,) and short.makespan == pytest.approx(2 * stage(20, 0))
    assert plan_sequence(SequenceProfile(stages=(stage,)), 0).lengths == ()
    # P = 1 with a fixed cost per pass and no context term: one chunk (splitting only adds passes).
    assert plan_sequence(SequenceProfile(stages=(stage,), min_len=1), 50).lengths == (50,)
    # max_len forces a split; every piece, the last included, must still reach min_len.
    capped = plan_sequence(SequenceProfile(stages=(stage, stage), min_len=16, granularity=16, max_len=32), 40)
    assert capped.lengths == (16, 24)
    with pytest.raises(InfeasiblePlan):  # 16 + 4: the last piece would be too short
        plan_sequence(SequenceProfile(stages=(stage,), min_len=16, granularity=16, max_len=16), 20)
    with pytest.raises(ValueError):
        SequenceProfile(stages=())
    with pytest.raises(ValueError):
        SequenceProfile(stages=(stage,), min_len=8, max_len=4)


def test_one_stage_much_slower_than_the_others() -> None:
    fast = ChunkCost(a=0.001, b=1e-5)
    slow = ChunkCost(a=0.0, b=1e-2)  # 1000x the per-token time, no fixed cost
    stages = (fast, slow, fast)
    plan = plan_sequence(SequenceProfile(stages=stages, min_len=16, granularity=16), 512)
    # The slow stage's total work is a floor; the plan gets within the first and last chunk of the others.
    floor = 512 * 1e-2
    assert floor <= plan.makespan <= floor + 2 * fast(16, 0) + 1e-9
    assert plan.lengths[0] == 16  # the slow stage starts as early as possible
    # The same with the slow stage first: the last chunk is as short as allowed.
    plan = plan_sequence(SequenceProfile(stages=(slow, fast, fast), min_len=16, granularity=16), 512)
    assert plan.lengths[-1] == 16


def test_grid_is_coarsened_for_long_prompts_and_the_front_cap_reports_inexact() -> None:
    stage = ChunkCost(a=0.01, b=1e-3, c=1e-6)
    plan = plan_sequence(SequenceProfile(stages=(stage, stage), min_len=16, granularity=16, max_positions=32), 4096)
    assert plan.grid == 128 and all(b % 128 == 0 for b in itertools.accumulate(plan.lengths[:-1]))
    rng = random.Random(7)
    stages = tuple(random_cost(rng) for _ in range(4))
    capped = plan_sequence(SequenceProfile(stages=stages, max_front=1), 14)
    full = plan_sequence(SequenceProfile(stages=stages), 14)
    assert full.exact and capped.makespan >= full.makespan - 1e-9
    assert capped.makespan <= plan_makespan(stages, [14]) + 1e-9  # never worse than the incumbent


def test_plan_cache_is_a_small_lru() -> None:
    stage = ChunkCost(a=0.01, b=1e-3)
    a, b = SequenceProfile(stages=(stage, stage)), SequenceProfile(stages=(stage,))
    cache = PlanCache(maxsize=2)
    first = cache.plan(a, 64)
    assert cache.plan(SequenceProfile(stages=(ChunkCost(a=0.01, b=1e-3),) * 2), 64) is first  # equal profile: a hit
    cache.plan(a, 65)
    cache.plan(b, 64)  # evicts (a, 64), the least recently used
    assert len(cache) == 2 and (cache.hits, cache.misses) == (1, 3)
    cache.plan(a, 64)
    assert cache.misses == 4
    with pytest.raises(ValueError):
        PlanCache(0)


# --- the device → link → worker path ------------------------------------------------------------------------------

DEVICE = ChunkCost(a=0.002, b=2e-4, c=1e-8)  # a laptop's input layers
CPU_WORKER = ChunkCost(a=0.16, b=0.007, c=2e-6)  # a CPU worker: g(x) ≈ 0.16 s + 7 ms/token
GPU_WORKER = ChunkCost(a=0.01, b=2e-5, c=1e-9)


@pytest.mark.parametrize(
    ("worker", "beta_up", "n"),
    [(CPU_WORKER, 2e6, 300), (CPU_WORKER, 2e6, 1500), (GPU_WORKER, 2e6, 1200), (GPU_WORKER, 50e6, 800)],
)
def test_device_prefill_plan_beats_eq3_and_one_frame(worker: ChunkCost, beta_up: float, n: int) -> None:
    kw = {"token_bytes": 4096, "beta_up": beta_up, "per_frame": 0.002, "latency": 0.02}
    cmp = compare_device_prefill(n, DEVICE, worker, **kw)
    assert sum(cmp.planned) == n and sum(cmp.eq3) == n
    assert grid_ok(cmp.planned, n, min_len=16, granularity=16)
    tol = 1e-9 * cmp.planned_makespan
    assert cmp.planned_makespan <= cmp.eq3_makespan + tol
    assert cmp.planned_makespan <= cmp.one_frame_makespan + tol
    assert cmp.gain_over_eq3 >= 1.0 - 1e-9 and cmp.gain_over_one_frame >= 1.0 - 1e-9
    plan = plan_device_prefill(n, DEVICE, worker, **kw)
    assert plan.lengths == cmp.planned and plan.makespan == pytest.approx(cmp.planned_makespan)


def test_device_prefill_latency_only_shifts_the_makespan() -> None:
    kw = {"token_bytes": 4096, "beta_up": 2e6}
    near = plan_device_prefill(600, DEVICE, GPU_WORKER, **kw)
    far = plan_device_prefill(600, DEVICE, GPU_WORKER, latency=0.05, **kw)
    assert far.lengths == near.lengths and far.makespan == pytest.approx(near.makespan + 0.05)
    cache = PlanCache()
    plan_device_prefill(600, DEVICE, GPU_WORKER, cache=cache, **kw)
    plan_device_prefill(600, DEVICE, GPU_WORKER, cache=cache, **kw)
    assert (cache.hits, cache.misses) == (1, 1)


def test_the_tied_fit_recovers_a_causal_cost_from_few_lengths() -> None:
    true = ChunkCost(0.2, 1e-2, 8e-6, 4e-6)  # d = c/2
    points = [(x, y, float(true(x, y))) for x, y in [(160, 0), (160, 160), (160, 320), (64, 480), (128, 0)]]
    got = fit_chunk_cost(points, tied=True)
    assert [got.a, got.b, got.c, got.d] == pytest.approx([true.a, true.b, true.c, true.d], rel=1e-6)
    with pytest.raises(ValueError):
        fit_chunk_cost([(160, 0, 1.0), (160, 160, 2.0)], tied=True)  # one length: a and b not separable
