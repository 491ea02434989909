"""Deficit round robin over a worker's sessions (policies/fair_share.py), on plain numbers: the rows each session
runs in a pass, priced in seconds by the rows and the context they attend over (in rows with ROW_COUNT)."""

from __future__ import annotations

import random

import pytest

from policies.fair_share import ROW_COUNT, Pending, RowCost, anticipation, fair_shares


def test_frames_within_the_quantum_run_whole_and_keep_no_credit() -> None:
    assert fair_shares([Pending(3, True), Pending(96, False)], [0.0, 10.0], quantum=96) == ([3, 96], [0.0, 0.0])


def test_a_large_splittable_frame_runs_a_piece_of_its_credit_in_equal_pieces() -> None:
    runs, kept = fair_shares([Pending(200, True), Pending(3, True)], [0.0, 0.0], quantum=96)
    assert runs == [67, 3] and kept == [29.0, 0.0]  # 200 = 67 + 67 + 66, not 96 + 96 + 8
    runs, kept = fair_shares([Pending(133, True)], kept[:1], quantum=96)
    assert runs == [67] and kept == [58.0]


def test_an_unsplittable_frame_waits_for_its_credit_and_the_pass_is_never_empty() -> None:
    assert fair_shares([Pending(150, False), Pending(3, True)], [0.0, 0.0], quantum=96) == ([0, 3], [96.0, 0.0])
    assert fair_shares([Pending(150, False), Pending(3, True)], [96.0, 0.0], quantum=96) == ([150, 3], [0.0, 0.0])
    # every frame waits: the one with the most credit runs whole
    assert fair_shares([Pending(300, False), Pending(500, False)], [100.0, 0.0], quantum=96) == (
        [300, 0],
        [0.0, 96.0],
    )


def test_over_many_passes_each_session_gets_the_same_rows() -> None:
    pending, credits, done = [Pending(10_000, True), Pending(10_000, True)], [0.0, 0.0], [0, 0]
    for _ in range(50):
        runs, credits = fair_shares(pending, credits, quantum=64, min_piece=16)
        done = [d + r for d, r in zip(done, runs, strict=True)]
    assert done == [3200, 3200]


def test_a_piece_is_at_least_min_piece_rows() -> None:
    assert fair_shares([Pending(100, True)], [0.0], quantum=8, min_piece=16) == ([16], [0.0])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="quantum"):
        fair_shares([Pending(1, True)], [0.0], quantum=0)
    with pytest.raises(ValueError, match="credits"):
        fair_shares([Pending(1, True)], [], quantum=8)
    with pytest.raises(ValueError, match="at least one row"):
        fair_shares([Pending(0, True)], [0.0], quantum=8)


def test_a_long_context_piece_gets_fewer_rows_than_a_short_context_one_at_the_same_budget() -> None:
    """A row late in a long context attends over all of it: the same credit buys fewer of them (τ less its fixed
    cost: 1 ms a row, 1 µs a row per cached position)."""
    cost = RowCost(per_row=1e-3, per_context=1e-6)
    flood = [Pending(455, True, context=0), Pending(455, True, context=4000)]
    runs, kept = fair_shares(flood, [0.0, 0.0], quantum=0.096, min_piece=4, cost=cost)
    # after no context 0.096 s buys 96 rows (455 = 5 pieces of 91); after 4000 positions a row costs 5 ms: 19 rows
    # (455 = 24 pieces of 19)
    assert runs == [91, 19]
    assert cost(runs[1], 4000) <= 0.096 < cost(20, 4000)
    assert kept == pytest.approx([0.096 - cost(91, 0), 0.096 - cost(19, 4000)])


def test_with_row_count_pricing_the_share_is_deficit_round_robin_over_rows() -> None:
    assert ROW_COUNT(96, 4000) == 96.0
    by_rows = fair_shares([Pending(200, True, context=4000)], [0.0], quantum=96)
    assert by_rows == ([67], [29.0])  # the context is not priced: 200 = 67 + 67 + 66 as without it


def test_a_piece_whose_credit_cannot_buy_min_piece_rows_waits_beside_others_and_catches_up() -> None:
    """A long-context flood whose quantum buys fewer than min_piece rows waits (keeping its credit) while another
    session's frame runs, then runs min_piece rows once its credit covers them: its pieces never cost more than its
    credit, so the other session's passes are not made longer than the quantum."""
    cost = RowCost(per_row=1e-3, per_context=1e-6)  # 5 ms a row after 4000 positions: 16 rows cost 80 ms
    pending = [Pending(455, True, context=4000), Pending(3, True)]
    runs, kept = fair_shares(pending, [0.0, 0.0], quantum=0.032, min_piece=16, cost=cost)
    assert runs == [0, 3] and kept == [0.032, 0.0]  # 6 rows' worth
    runs, kept = fair_shares(pending, kept, quantum=0.032, min_piece=16, cost=cost)
    assert runs == [0, 3] and kept == pytest.approx([0.064, 0.0])  # 12 rows' worth
    runs, kept = fair_shares(pending, kept, quantum=0.032, min_piece=16, cost=cost)
    assert runs == [19, 3] and kept == pytest.approx([0.096 - 0.095, 0.0])  # 19 rows' worth, 455 = 24 × ~19
    # alone in the pass it runs anyway (a pass is never empty), its credit not below 0
    assert fair_shares(pending[:1], [0.0], quantum=0.032, min_piece=16, cost=cost) == ([16], [0.0])


def test_rows_within_is_the_most_rows_the_seconds_buy() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        cost = RowCost(rng.choice([0.0, rng.uniform(1e-4, 1e-2)]), rng.uniform(0, 1e-5), rng.choice([0.0, 1e-6]))
        if not (cost.per_row or cost.per_context or cost.per_pair):
            continue
        context, limit, seconds = rng.randrange(0, 5000), rng.randrange(1, 600), rng.uniform(-0.01, 0.5)
        best = max((x for x in range(limit + 1) if cost(x, context) <= seconds), default=0)
        assert cost.rows_within(seconds, context, limit) == best, (cost, context, limit, seconds)


def test_the_invariants_of_a_pass_on_random_sessions() -> None:
    """Brute force over random sessions, credits and costs: what each session runs is its whole frame, a piece of
    at least min_piece rows its credit covers (no smaller than half what the credit could buy: no small remainder
    left), or nothing; a tree is never cut; credit is kept only by a piece or a frame that waits; the pass is never
    empty, and at most one session (the one with the most credit, when all would wait) overspends."""
    rng = random.Random(11)
    for _ in range(3000):
        cost = RowCost(rng.uniform(1e-4, 2e-3), rng.choice([0.0, rng.uniform(1e-7, 1e-6)]), rng.choice([0.0, 1e-6]))
        quantum, min_piece = rng.uniform(0.005, 0.3), rng.choice([1, 4, 16])
        n = rng.randrange(1, 5)
        pending = [Pending(rng.randrange(1, 500), rng.random() < 0.7, rng.randrange(0, 4096)) for _ in range(n)]
        credits = [rng.uniform(0, 0.3) for _ in range(n)]
        runs, kept = fair_shares(pending, credits, quantum, min_piece, cost)
        assert any(runs) and all(k >= 0 for k in kept)
        overspent = 0
        for frame, credit, run, keep in zip(pending, credits, runs, kept, strict=True):
            earned, price = credit + quantum, cost(run, frame.context)
            assert 0 <= run <= frame.rows
            if not frame.splittable:
                assert run in (0, frame.rows)
            if run == 0:
                assert keep == earned
                continue
            if price > earned + 1e-12:
                overspent += 1
                assert earned == max(c + quantum for c in credits)  # the never-empty rule's choice
                assert run == frame.rows or run == min_piece
            if run == frame.rows:
                assert keep == 0.0
            elif price <= earned:
                affordable = cost.rows_within(earned, frame.context, frame.rows)
                assert min_piece <= run <= affordable and 2 * run >= affordable, (frame, earned, run)
                assert keep == pytest.approx(earned - price)
        assert overspent <= 1


def test_over_many_passes_two_backlogged_sessions_get_the_same_time_not_the_same_rows() -> None:
    """One flood after no context, one after 3000 positions, both backlogged: each pass each earns the quantum and
    spends it, so over 200 passes their work differs by less than a quantum, while the long-context one ran far
    fewer rows."""
    cost = RowCost(per_row=1e-3, per_context=1e-6, per_pair=1e-7)
    contexts, credits, rows, seconds = [0, 3000], [0.0, 0.0], [0, 0], [0.0, 0.0]
    for _ in range(200):
        pending = [Pending(455, True, c) for c in contexts]
        runs, credits = fair_shares(pending, credits, quantum=0.05, min_piece=4, cost=cost)
        for i, run in enumerate(runs):
            rows[i] += run
            seconds[i] += cost(run, contexts[i])
    assert abs(seconds[0] - seconds[1]) < 0.05
    assert rows[0] > 3 * rows[1]


def test_a_flood_only_pass_is_held_for_a_session_answered_a_moment_ago_until_it_is_due() -> None:
    # answered 2 ms ago, its next frame usually 40 ms after a reply: hold 58 ms (due at 1.5 × 40 = 60 ms)
    assert anticipation([(0.002, 0.04)], cap=0.3) == pytest.approx(0.058)
    # a turn of a few ms: held at least a tenth of the cap after the reply (its jitter is as large as the turn)
    assert anticipation([(0.002, 0.004)], cap=0.3) == pytest.approx(0.028)
    # the soonest of several; one overdue (answered 1 s ago, usually back in 10 ms) holds nothing
    assert anticipation([(1.0, 0.01), (0.001, 0.04), (0.0, 0.1)], cap=0.3) == pytest.approx(0.059)
    assert anticipation([(1.0, 0.01)], cap=0.3) == 0.0 and anticipation([], cap=0.3) == 0.0
    # never past the cap after the reply: a slow device is not waited for longer than a flood piece takes
    assert anticipation([(0.05, 1.0)], cap=0.3) == pytest.approx(0.25)
    assert anticipation([(0.3, 1.0)], cap=0.3) == 0.0


def test_bound_bulk_gives_the_bulk_frames_what_the_others_pass_costs_shared_equally() -> None:
    """Beside a 3-row round (3 ms) in a pass of fixed cost 50 ms, two floods share (2 − 1)·53 ms: 26.5 ms each, 26
    rows at 1 ms a row; the quantum (96 rows) would have given each 96."""
    cost = RowCost(per_row=1e-3)
    pending = [Pending(455, True, bulk=True), Pending(3, True), Pending(455, True, bulk=True)]
    assert fair_shares(pending, [0.0] * 3, quantum=0.096, cost=cost)[0] == [91, 3, 91]
    runs, kept = fair_shares(pending, [0.0] * 3, quantum=0.096, cost=cost, fixed=0.05, slowdown=2.0)
    assert runs == [26, 3, 26]
    assert kept == pytest.approx([0.07, 0.0, 0.07])  # credit less the piece, never above a quantum
    shared = 0.05 + cost(3, 0) + 2 * cost(26, 0)
    assert shared <= 2 * (0.05 + cost(3, 0)) < shared + 2 * cost(1, 0)


def test_bound_bulk_leaves_a_pass_without_other_frames_and_frames_that_are_not_bulk_to_the_quantum() -> None:
    cost = RowCost(per_row=1e-3)
    alone = fair_shares([Pending(455, True, bulk=True)], [0.0], quantum=0.096, cost=cost, fixed=0.05, slowdown=2.0)
    assert alone == ([91], [0.096 - cost(91, 0)])
    # a large first frame (not bulk: nothing behind it, nothing run yet) is cut by the quantum alone, and is not a
    # round the bulk frames are bounded by
    first = [Pending(455, True), Pending(455, True, bulk=True)]
    assert fair_shares(first, [0.0, 0.0], quantum=0.096, cost=cost, fixed=0.05, slowdown=2.0)[0] == [91, 91]
    # a bulk token tree may not be cut: its quantum and credit decide, as without the bound
    tree = [Pending(150, False, bulk=True), Pending(3, True)]
    assert fair_shares(tree, [0.1, 0.0], quantum=0.096, cost=cost, fixed=0.05, slowdown=2.0)[0] == [150, 3]


def test_bound_bulk_late_in_a_long_context_a_flood_may_wait_for_a_pass_without_the_others() -> None:
    """5 ms a row after 4000 positions and an allowance of 4 ms: not one row fits, so the flood waits beside the
    round (keeping at most a quantum of credit) and runs its quantum's worth in a pass of its own."""
    cost = RowCost(per_row=1e-3, per_context=1e-6)
    pending = [Pending(455, True, context=4000, bulk=True), Pending(3, True)]
    runs, kept = fair_shares(pending, [0.0, 0.0], quantum=0.096, cost=cost, fixed=0.001, slowdown=2.0)
    assert runs == [0, 3] and kept == [0.096, 0.0]
    runs, _ = fair_shares(pending[:1], kept[:1], quantum=0.096, cost=cost, fixed=0.001, slowdown=2.0)
    assert runs == [38]  # 0.192 s of credit at 5 ms a row


def test_bound_bulk_refuses_a_slowdown_that_bounds_nothing() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        fair_shares([Pending(3, True), Pending(9, True, bulk=True)], [0.0, 0.0], quantum=8, fixed=1.0, slowdown=1.0)
