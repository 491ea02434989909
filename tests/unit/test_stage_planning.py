"""The staged worker's planning glue on plain numbers: layer bounds from per-stage timings
(app/worker/layer_placement.py), sub-sequence plans after a cached context and the refit from observed passes
(prefill_cost.py), and the message header (stage_link.py)."""

from __future__ import annotations

import math

import pytest
import torch

from app.worker.layer_placement import CUDA_MEMORY_SHARE, GIB, layer_memory, plan_layers, stage_memory_caps
from app.worker.prefill_cost import PrefillCostFit, SubsequencePlanner, fit_stage_costs, profile_points
from app.worker.stage_link import HEADER, Cmd, header, sid_ints
from policies.layer_partition import InfeasiblePlan, partition_layers
from policies.sequence_partition import (
    ChunkCost,
    SequenceProfile,
    equal_lengths,
    paper_partition,
    plan_makespan,
    plan_sequence,
)


def test_a_stage_twice_as_fast_gets_twice_the_layers() -> None:
    layers = [1.0] * 12
    part = plan_layers([layers, [2.0] * 12], 2)  # stage 1 timed every layer at twice stage 0's time
    assert part.bounds == ((0, 8), (8, 12))
    assert plan_layers([layers, layers], 2).bounds == ((0, 6), (6, 12))


def test_each_stages_own_layer_times_place_the_layers_not_one_speed_number() -> None:
    """Stage 1 is fast on the first half of the layers and slow on the second (not a constant factor of stage 0):
    the plan uses every per-layer time — the slowest stage's real time equals brute force over all cuts, where one
    speed number per stage (stage 0's total over its own) would misplace the cut."""
    import random

    rng = random.Random(5)
    for _ in range(50):
        n = rng.randint(2, 12)
        times = [[rng.uniform(0.1, 2.0) for _ in range(n)] for _ in range(2)]
        best = min(max(sum(times[0][:c]), sum(times[1][c:])) for c in range(1, n))
        part = plan_layers(times, 2)
        (_, cut), _ = part.bounds
        assert max(sum(times[0][:cut]), sum(times[1][cut:])) == pytest.approx(best)
        assert part.stage_times == pytest.approx((sum(times[0][:cut]), sum(times[1][cut:])))
    # By totals stage 1 is 2.125x slower; per layer it is 4x faster on layers 0-3 and 4x slower on 4-7 (its part)
    times = [[1.0] * 8, [0.25] * 4 + [4.0] * 4]
    (_, cut), _ = plan_layers(times, 2).bounds
    assert cut == 7 and max(sum(times[0][:cut]), sum(times[1][cut:])) == 7.0
    speed = [1.0, sum(times[0]) / sum(times[1])]  # what one speed number per stage planned before
    (_, by_speed), _ = partition_layers(times[0], 2, speeds=speed).bounds
    assert by_speed == 6 and max(sum(times[0][:by_speed]), sum(times[1][by_speed:])) == 8.0


def test_a_memory_cap_moves_layers_to_the_other_stage_and_an_impossible_one_names_the_stages() -> None:
    layers = [1.0] * 12
    fast = [layers, [2.0] * 12]  # unconstrained: stage 0 takes 8 layers (see above)
    memory = [1.0 * GIB] * 12
    capped = plan_layers(fast, 2, layer_memory=memory, memory_caps=[6.5 * GIB, math.inf])
    assert capped.bounds == ((0, 6), (6, 12))  # stage 0 holds at most 6 layers; the split is still min-max
    assert capped.stage_memory == (6 * GIB, 6 * GIB)
    with pytest.raises(InfeasiblePlan) as err:
        plan_layers(fast, 2, layer_memory=memory, memory_caps=[4 * GIB, 4 * GIB])
    assert "stage 0 4.00 GiB" in str(err.value) and "stage 1 4.00 GiB" in str(err.value)
    assert "12.00 GiB in all" in str(err.value)


def test_memory_caps_from_the_setting_and_each_stages_free_gpu_memory() -> None:
    assert stage_memory_caps(None, [0, 0], [0, 0]) is None  # CPU stages, nothing configured: no caps
    assert stage_memory_caps([2.0, 1.5], [0, 0], [0, 0]) == [2 * GIB, 1.5 * GIB]
    # stage 0 alone on GPU a; stages 1 and 2 share GPU b (each gets half of it); stage 3 on the CPU
    free = [10 * GIB, 8 * GIB, 8 * GIB, 0]
    caps = stage_memory_caps(None, free, [11, 22, 22, 0])
    assert caps == pytest.approx([CUDA_MEMORY_SHARE * 10 * GIB, CUDA_MEMORY_SHARE * 4 * GIB,
                                  CUDA_MEMORY_SHARE * 4 * GIB, math.inf])  # fmt: skip
    both = stage_memory_caps([1.0, 100.0, 100.0, 3.0], free, [11, 22, 22, 0])
    assert both == pytest.approx([GIB, CUDA_MEMORY_SHARE * 4 * GIB, CUDA_MEMORY_SHARE * 4 * GIB, 3 * GIB])


def test_layer_memory_is_the_parameters_plus_the_kv_reserve(tiny) -> None:
    # tiny: hidden 32, 2 KV heads of width 8 -> keys and values 32 floats per position per layer
    got = layer_memory(tiny, 1, 3, kv_positions=100)
    params = sum(p.numel() * 4 for p in tiny.model.layers[1].parameters())
    assert got == [params + 100 * 32 * 4] * 2
    assert layer_memory(tiny, 0, 4, kv_positions=0) == [params] * 4


def test_a_piece_after_context_is_planned_with_the_context_folded_into_b() -> None:
    costs = (ChunkCost(0.01, 1e-3, 2e-6, 1e-6), ChunkCost(0.02, 8e-4, 3e-6))
    planner = SubsequencePlanner(PrefillCostFit(2, costs), context_step=64)
    got = planner.lengths(512, 256)
    # the same as planning tokens 256..768 of one prompt: τ_s(x | 256 + y) = τ'_s(x | y) with b' = b + c·256
    direct = plan_sequence(SequenceProfile(stages=planner.profile(256).stages, min_len=16, granularity=16), 512)
    assert got == list(direct.lengths) and sum(got) == 512
    shifted = planner.profile(256).stages[0]
    assert shifted(100, 10) == pytest.approx(costs[0](100, 266))
    assert planner.lengths(512, 250) == got  # contexts round to the step: one cached plan
    assert planner.cache.hits >= 1


def test_modes_off_equal_and_short_pieces() -> None:
    costs = (ChunkCost(1e-3, 1e-3), ChunkCost(1e-3, 1e-3))
    fit = PrefillCostFit(2, costs)
    assert SubsequencePlanner(fit, mode="off").lengths(1000, 0) == [1000]
    assert SubsequencePlanner(fit).lengths(20, 0) == [20]  # shorter than two minimum pieces: not split
    assert SubsequencePlanner(PrefillCostFit(2)).lengths(1000, 0) == [1000]  # τ not determined yet: one piece
    equal = SubsequencePlanner(fit, mode="equal").lengths(512, 0)
    best = min((equal_lengths(512, k, 16) for k in range(1, 33)), key=lambda lengths: plan_makespan(costs, lengths))
    assert equal == best and len(set(equal)) == 1
    dp = SubsequencePlanner(fit).lengths(512, 0)
    assert plan_makespan(costs, dp) <= plan_makespan(costs, equal) + 1e-12
    paper_planner = SubsequencePlanner(fit, mode="paper")  # the paper's own rule, the live baseline
    paper = paper_planner.lengths(512, 0)
    assert paper == paper_partition(paper_planner.profile(0), 512) and sum(paper) == 512
    assert plan_makespan(costs, dp) <= plan_makespan(costs, paper) + 1e-12


def test_observed_passes_refit_tau_and_drop_old_plans() -> None:
    true = (ChunkCost(0.005, 2e-3, 1e-6), ChunkCost(0.004, 1e-3, 2e-6))
    planner = SubsequencePlanner(PrefillCostFit(2, (ChunkCost(1.0, 0.0), ChunkCost(1.0, 0.0)), refit_every=8))
    planner.lengths(256, 0)
    assert len(planner.cache) == 1
    planner.observe(8, 0, [1.0, 1.0])  # shorter than min_len: a decode-sized piece is not a prefill sample
    assert not planner.fit.points
    for i, (x, y) in enumerate([(16, 0), (64, 0), (128, 64), (32, 256), (96, 128), (48, 32), (160, 0), (80, 300)]):
        planner.observe(x, y, [float(c(x, y)) for c in true])
        assert planner.fit.version == (0 if i < 7 else 1)
    for got, want in zip(planner.costs, true, strict=True):
        assert got(100, 200) == pytest.approx(want(100, 200), rel=1e-6)
    old = planner.cache
    planner.lengths(256, 0)
    assert planner.cache is not old and planner.cache.misses == 1  # the old fit's plans were dropped, planned anew


def test_an_unprofiled_fit_is_determined_by_the_first_points_that_pin_it_down() -> None:
    # unprofiled, τ is fitted with d tied to c/2 (a piece's own causal attention at the context's per-pair cost)
    true = ChunkCost(0.01, 2e-3, 1e-6, 5e-7)
    fit = PrefillCostFit(1, refit_every=100)
    assert fit.wire() is None
    # one length only: τ is not determined, whatever the count
    for _ in range(3):
        assert not fit.observe(64, 0, [float(true(64, 0))])
    assert fit.costs is None
    assert not fit.observe(32, 0, [float(true(32, 0))])
    assert fit.observe(128, 256, [float(true(128, 256))])  # now it is (without waiting for refit_every points)
    assert fit.version == 1 and fit.costs is not None
    (wire,) = fit.wire()  # type: ignore[misc]
    assert wire == pytest.approx([true.a, true.b, true.c, true.d], rel=1e-6)
    # without a profile, every new point refits until refit_every points were seen; then every refit_every points
    small = PrefillCostFit(1, refit_every=8)
    grid = [(16, 0), (48, 0), (96, 0), (32, 128), (64, 64), (80, 32), (24, 256), (40, 16), (56, 8), (72, 100)]
    refits = [small.observe(x, y, [float(true(x, y))]) for x, y in grid]
    assert refits == [False, False, True, True, True, True, True, True, False, False]
    # with a profile (a fit that stands on its own), only every refit_every points
    profiled = PrefillCostFit(1, fit.costs, profiled=[(x, y, [float(true(x, y))]) for x, y in grid[:4]], refit_every=3)
    assert [profiled.observe(x, y, [float(true(x, y))]) for x, y in grid[4:]] == [
        False,
        False,
        True,
        False,
        False,
        True,
    ]


def test_fits_are_clamped_non_negative_and_the_profile_takes_the_least_of_its_runs() -> None:
    # times falling with x: an unclamped fit would give a negative slope
    points = [(16, 0, [0.3]), (64, 0, [0.2]), (192, 0, [0.1]), (64, 256, [0.2])]
    (cost,) = fit_stage_costs(points, 1)  # type: ignore[misc]
    assert min(cost.a, cost.b, cost.c, cost.d) >= 0.0
    assert fit_stage_costs(points[:2], 1) is None
    runs: list[tuple[int, int]] = []
    noise = iter([0.5, 0.1] * 6)

    def session(y: int):
        def run(x: int) -> list[float]:
            runs.append((x, y))
            return [x * 1e-3 + next(noise)]

        return run

    got = profile_points(session, xs=(16, 64, 192), ys=(0, 256), reps=2)
    assert [(x, y) for x, y, _ in got] == [(16, 0), (64, 0), (192, 0), (16, 256), (64, 256), (192, 256)]
    assert [t for _, _, (t,) in got] == pytest.approx([x * 1e-3 + 0.1 for x, _, _ in got])
    assert len(runs) == 12


def test_header_and_session_ids() -> None:
    sid = bytes(range(16))
    hi, lo = sid_ints(sid)
    assert hi.to_bytes(8, "little", signed=True) + lo.to_bytes(8, "little", signed=True) == sid
    h = header(Cmd.CROP, 0, 0, 0, 0, 0, hi, lo, 7)
    assert h.dtype == torch.int64 and h.shape == (HEADER,) and h.tolist()[6:9] == [hi, lo, 7]
    with pytest.raises(ValueError):
        header(Cmd.FORWARD, *range(HEADER))
