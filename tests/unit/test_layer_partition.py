"""Jupiter's layer partition (policies/layer_partition.py): the DP against brute force, unequal stages, memory caps
and the plans no partition satisfies."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from policies.layer_partition import InfeasiblePlan, partition_layers


def brute_layers(times, stages, speeds, mem, caps, allow_empty):
    n, best = len(times), math.inf
    for cuts in itertools.combinations_with_replacement(range(n + 1), stages - 1):
        edges = [0, *cuts, n]
        spans = list(itertools.pairwise(edges))
        if not allow_empty and any(e <= s for s, e in spans):
            continue
        if any(sum(mem[s:e]) > caps[k] + 1e-9 for k, (s, e) in enumerate(spans)):
            continue
        best = min(best, max(sum(times[s:e]) / speeds[k] for k, (s, e) in enumerate(spans)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_layer_partition_equals_brute_force_and_respects_memory(seed: int) -> None:
    rng = random.Random(seed)
    n, stages = rng.randint(1, 9), rng.randint(1, 4)
    allow_empty = rng.random() < 0.3
    times = [rng.uniform(0.1, 3.0) for _ in range(n)]
    speeds = [rng.choice([0.5, 1.0, 1.0, 2.0, 3.0]) for _ in range(stages)]
    mem = [rng.uniform(1.0, 2.0) for _ in range(n)]
    caps = [rng.uniform(2.0, 2.0 + 2 * n / stages) for _ in range(stages)]
    expected = brute_layers(times, stages, speeds, mem, caps, allow_empty)
    kw = {"speeds": speeds, "layer_memory": mem, "memory_caps": caps, "allow_empty": allow_empty}
    if expected == math.inf:
        with pytest.raises(InfeasiblePlan):
            partition_layers(times, stages, **kw)
        return
    plan = partition_layers(times, stages, **kw)
    assert plan.bottleneck == pytest.approx(expected)
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(plan.bounds))  # contiguous, in stage order
    assert all(m <= c + 1e-9 for m, c in zip(plan.stage_memory, caps, strict=True))
    if not allow_empty:
        assert all(e > s for s, e in plan.bounds)


def test_layer_partition_unequal_stages_and_infeasible_caps() -> None:
    # Eight equal layers, a stage twice as fast as the other: it gets twice the layers.
    plan = partition_layers([1.0] * 9, 2, speeds=[2.0, 1.0])
    assert plan.bounds == ((0, 6), (6, 9)) and plan.bottleneck == pytest.approx(3.0)
    # The same, but the fast stage can hold only four layers.
    plan = partition_layers([1.0] * 9, 2, speeds=[2.0, 1.0], layer_memory=[1.0] * 9, memory_caps=[4.0, 9.0])
    assert plan.bounds == ((0, 4), (4, 9)) and plan.bottleneck == pytest.approx(5.0)
    with pytest.raises(InfeasiblePlan, match="layer 2 needs 5"):
        partition_layers([1.0] * 4, 2, layer_memory=[1, 1, 5, 1], memory_caps=4.0)
    with pytest.raises(InfeasiblePlan, match="fits the memory caps"):
        partition_layers([1.0] * 4, 2, layer_memory=[1.0] * 4, memory_caps=1.5)
    with pytest.raises(InfeasiblePlan):
        partition_layers([1.0] * 2, 3)
    # A very slow device is left out when empty stages are allowed.
    plan = partition_layers([1.0] * 4, 3, speeds=[1.0, 0.01, 1.0], allow_empty=True)
    assert plan.bounds[1][0] == plan.bounds[1][1] and plan.bottleneck == pytest.approx(2.0)
    assert partition_layers([2.0, 1.0], 1).bounds == ((0, 2),)
