"""The device half's per-round profile (clients/hat/options.py: HATStats.add_round, round_profile; the link's modelled
share): its parts sum to the round, the wait splits into link and worker, and the bottleneck is the largest part."""

from __future__ import annotations

import pytest

from clients.hat.link_model import LinkModel
from clients.hat.options import PROFILE_PARTS, HATStats, round_profile
from policies.estimate import MovingAverage


def link(latency: float = 0.01) -> LinkModel:
    return LinkModel(up=MovingAverage(value=1e6), down=MovingAverage(value=2e6), state_bytes=1000, latency=latency)


def test_the_link_share_is_two_latencies_and_both_transfers() -> None:
    assert link().round_trip_seconds(3) == pytest.approx(0.02 + 3 * 1000 / 1e6 + 3 * 1000 / 2e6)
    assert link(0.0).round_trip_seconds(0) == 0.0


def accounted(rounds: list[tuple[float, float, float, float, float, float, int]], model: LinkModel) -> HATStats:
    """HATStats after rounds (t0, t1, t2, t3, input_s, head_s, rows), accounted as DecodeRounds does."""
    stats = HATStats()
    for t0, t1, t2, t3, input_s, head_s, rows in rounds:
        stats.rounds += 1
        stats.add_round(t1 - t0, t2 - t1, t3 - t2, input_s, head_s, model.round_trip_seconds(rows))
    return stats


def test_parts_sum_to_the_round_and_the_wait_splits_into_link_and_worker() -> None:
    # round 1: drafting 0..0.05 (0.03 in the input layers), wait 0.05..0.25, verification 0.25..0.30 (head 0.04)
    # round 2: the same shape, twice as long a wait
    model = link()
    stats = accounted([(0.0, 0.05, 0.25, 0.30, 0.03, 0.04, 3), (1.0, 1.05, 1.45, 1.50, 0.03, 0.04, 3)], model)
    p = round_profile(stats)
    share = 1e3 * model.round_trip_seconds(3)
    assert p["input"] == pytest.approx(30.0) and p["drafts"] == pytest.approx(20.0)
    assert p["head"] == pytest.approx(40.0) and p["other"] == pytest.approx(10.0)
    assert p["link"] == pytest.approx(share)
    assert p["worker"] == pytest.approx((200 + 400) / 2 - share)
    assert sum(p[k] for k in PROFILE_PARTS) == pytest.approx(stats.summary()["ms_per_round"])
    assert p["device"] == pytest.approx(30 + 20 + 40 + 10)
    assert p["bottleneck"] == "worker"
    assert stats.summary()["profile_ms_per_round"] == p


def test_the_link_share_never_exceeds_the_wait() -> None:
    """A round answered faster than the link model says (a loopback worker, a stale estimate): all of it is link,
    none is worker — never a negative worker time."""
    stats = accounted([(0.0, 0.01, 0.015, 0.02, 0.0, 0.004, 8)], link(latency=0.05))
    p = round_profile(stats)
    assert p["link"] == pytest.approx(5.0) and p["worker"] == pytest.approx(0.0)


def test_a_fast_worker_makes_the_device_the_bottleneck_and_no_rounds_names_none() -> None:
    stats = accounted([(0.0, 0.06, 0.08, 0.16, 0.02, 0.075, 2)], link(latency=0.0))
    assert round_profile(stats)["bottleneck"] == "head"
    assert round_profile(HATStats())["bottleneck"] == ""
    stats.ahead_seconds = 0.012
    assert round_profile(stats)["ahead"] == pytest.approx(12.0)
