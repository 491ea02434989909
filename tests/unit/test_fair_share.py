"""Deficit round robin over a worker's sessions (policies/fair_share.py), on plain numbers."""

from __future__ import annotations

import pytest

from policies.fair_share import Pending, fair_shares


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
