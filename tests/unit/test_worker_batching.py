"""The worker's batch planner (policies/worker_batching.py) against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from policies.sd_edge import contiguous_partitions
from policies.worker_batching import plan_groups, split_sizes, subchunk_tokens, total_completion


def brute_force(sizes: list[float], slope: float, intercept: float) -> float:
    """The least total completion time over every order and every grouping into consecutive passes."""
    best = float("inf")
    n = len(sizes)
    for perm in itertools.permutations(range(n)):
        for groups in contiguous_partitions(n):
            plan = [[perm[i] for i in g] for g in groups]
            best = min(best, total_completion(plan, sizes, slope, intercept))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_shortest_first_dp_equals_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    sizes = [rng.choice([1, 2, 3, 4, 8, 16, 64, 128, 256]) * rng.uniform(0.5, 1.5) for _ in range(n)]
    slope, intercept = rng.uniform(1e-4, 1e-2), rng.choice([0.0, 0.01, 0.17, 1.0])
    groups = plan_groups(sizes, slope, intercept)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert total_completion(groups, sizes, slope, intercept) == pytest.approx(brute_force(sizes, slope, intercept))


def test_a_verification_round_does_not_share_a_pass_with_a_prefill_chunk() -> None:
    # CPU worker: ~0.16 s per pass plus ~7 ms per token. Three 3-position rounds and a 256-token chunk.
    groups = plan_groups([256, 3, 3, 3], 0.007, 0.16)
    assert groups == [[1, 2, 3], [0]]
    # Without a fixed cost, every frame alone, shortest first.
    assert plan_groups([5, 1, 3], 0.01, 0.0) == [[1], [2], [0]]
    # A huge fixed cost: everything in one pass.
    assert plan_groups([5, 1, 3], 0.001, 100.0) == [[1, 2, 0]]


def test_forced_frames_run_first_and_the_token_cap_holds() -> None:
    groups = plan_groups([256, 3, 3], 0.007, 0.16, forced=[0])
    assert 0 in groups[0]
    groups = plan_groups([100, 100, 100, 3], 1e-6, 1.0, max_tokens=250)
    assert all(sum([100, 100, 100, 3][i] for i in g) <= 250 for g in groups)
    assert plan_groups([500], 0.01, 0.1, max_tokens=100) == [[0]]  # one larger frame still runs, alone
    assert plan_groups([], 0.01, 0.1) == []


def test_subchunk_budget_comes_from_g() -> None:
    # X = c2·(1 − ε)/(ε·c1): a CPU worker's g (0.16 s + 7 ms/token) at ε = 0.2 gives 92 tokens.
    bounds = {"min_tokens": 16, "max_tokens": 4096}
    assert subchunk_tokens(0.007, 0.16, overhead=0.2, **bounds) == 92
    assert subchunk_tokens(0.007, 0.16, overhead=0.5, **bounds) == 23
    assert subchunk_tokens(0.0, 0.16, overhead=0.2, **bounds) == 4096  # no slope yet: no basis for splitting
    assert subchunk_tokens(1.0, 0.001, overhead=0.2, **bounds) == 16
    assert subchunk_tokens(1e-9, 1.0, overhead=0.2, min_tokens=16, max_tokens=512) == 512
    with pytest.raises(ValueError):
        subchunk_tokens(0.01, 0.1, overhead=1.0, **bounds)
    for total, piece in [(1024, 92), (128, 64), (7, 100), (1, 1), (100, 33)]:
        parts = split_sizes(total, piece)
        assert sum(parts) == total and max(parts) <= piece and max(parts) - min(parts) <= 1
