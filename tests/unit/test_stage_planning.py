"""The staged worker's planning glue (app/worker/stages.py) on plain numbers: layer bounds from per-stage timings,
sub-sequence plans after a cached context, the refit from observed passes, and the message header."""

from __future__ import annotations

import pytest
import torch

from app.worker.stages import HEADER, Cmd, SubsequencePlanner, header, plan_layers, sid_ints
from policies.jupiter import ChunkCost, SequenceProfile, equal_lengths, plan_makespan, plan_sequence


def test_a_stage_twice_as_fast_gets_twice_the_layers() -> None:
    layers = [1.0] * 12
    part = plan_layers([layers, [2.0] * 12], 2)  # stage 1 timed every layer at twice stage 0's time
    assert part.bounds == ((0, 8), (8, 12))
    assert plan_layers([layers, layers], 2).bounds == ((0, 6), (6, 12))


def test_a_piece_after_context_is_planned_with_the_context_folded_into_b() -> None:
    costs = (ChunkCost(0.01, 1e-3, 2e-6, 1e-6), ChunkCost(0.02, 8e-4, 3e-6))
    planner = SubsequencePlanner(costs, context_step=64)
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
    assert SubsequencePlanner(costs, mode="off").lengths(1000, 0) == [1000]
    assert SubsequencePlanner(costs).lengths(20, 0) == [20]  # shorter than two minimum pieces: not split
    equal = SubsequencePlanner(costs, mode="equal").lengths(512, 0)
    best = min((equal_lengths(512, k, 16) for k in range(1, 33)), key=lambda lengths: plan_makespan(costs, lengths))
    assert equal == best and len(set(equal)) == 1
    dp = SubsequencePlanner(costs).lengths(512, 0)
    assert plan_makespan(costs, dp) <= plan_makespan(costs, equal) + 1e-12


def test_observed_passes_refit_tau_and_drop_old_plans() -> None:
    true = (ChunkCost(0.005, 2e-3, 1e-6), ChunkCost(0.004, 1e-3, 2e-6))
    planner = SubsequencePlanner((ChunkCost(1.0, 0.0), ChunkCost(1.0, 0.0)), refit_every=8)
    planner.lengths(256, 0)
    assert len(planner.cache) == 1
    planner.observe(8, 0, [1.0, 1.0])  # shorter than min_len: a decode-sized piece is not a prefill sample
    assert not planner.points
    for i, (x, y) in enumerate([(16, 0), (64, 0), (128, 64), (32, 256), (96, 128), (48, 32), (160, 0), (80, 300)]):
        planner.observe(x, y, [float(c(x, y)) for c in true])
        assert len(planner.cache) == (1 if i < 7 else 0)
    for got, want in zip(planner.costs, true, strict=True):
        assert got(100, 200) == pytest.approx(want(100, 200), rel=1e-6)


def test_header_and_session_ids() -> None:
    sid = bytes(range(16))
    hi, lo = sid_ints(sid)
    assert hi.to_bytes(8, "little", signed=True) + lo.to_bytes(8, "little", signed=True) == sid
    h = header(Cmd.CROP, 0, 0, 0, 0, 0, hi, lo, 7)
    assert h.dtype == torch.int64 and h.shape == (HEADER,) and h.tolist()[6:9] == [hi, lo, 7]
    with pytest.raises(ValueError):
        header(Cmd.FORWARD, *range(HEADER))
