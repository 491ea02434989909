"""The drafting station's pure decisions: which streams draft together (Alg. 1 on fitted T(b, F)) and which work
runs next (group barriers, straggler waits, no starvation)."""

from __future__ import annotations

import math
import random

import pytest

from clients.hat.station_schedule import Pending, equal_groups, next_unit
from policies.sd_edge import Runtime, contiguous_partitions, plan_stream_groups, stream_groups_latency

# --- Alg. 1 over streams ----------------------------------------------------------------------------------------


def covers_once(groups: list[list[int]], k: int) -> bool:
    flat = [i for g in groups for i in g]
    return sorted(flat) == list(range(k))


def test_a_flat_costly_verify_stage_keeps_every_stream_in_one_group() -> None:
    # A CPU worker: a pass costs ~170 ms whatever its rows, the device's batched step has a sizeable fixed cost:
    # every extra group only adds a worker pass and a device fixed cost, so Alg. 1 keeps one group.
    device, verify = Runtime(c1=0.004, c2=0.05), Runtime(c1=0.001, c2=0.17)
    groups = plan_stream_groups([40, 300, 90, 120], device, verify, rows_per_stream=2.5)
    assert groups == [[0, 2, 3, 1]]  # sorted by context, one group


def test_a_verify_stage_growing_with_rows_splits_streams_into_pipelined_groups() -> None:
    # A fast device with little fixed cost and a verify stage that grows with the rows: drafting group m+1 while
    # group m is verified pays off (Eq. 20), so Alg. 1 splits.
    device, verify = Runtime(c1=0.01, c2=0.001), Runtime(c1=0.02, c2=0.002)
    groups = plan_stream_groups([10, 20, 30, 40], device, verify, rows_per_stream=3)
    assert len(groups) > 1 and covers_once(groups, 4)
    one = stream_groups_latency([[0, 1, 2, 3]], device, verify, 3)
    assert stream_groups_latency(groups, device, verify, 3) < one


def test_stream_groups_against_brute_force_and_every_stream_covered_once() -> None:
    """Alg. 1 is a heuristic (one completion state per prefix): on random stage times it is optimal on most
    instances and close on average, and its plan is always a contiguous cover in context order."""
    rng = random.Random(7)
    gaps = []
    for _ in range(200):
        k = rng.randint(1, 8)
        contexts = [rng.randint(10, 2000) for _ in range(k)]
        device = Runtime(c1=rng.uniform(0, 0.03), c2=rng.uniform(0, 0.08))
        verify = Runtime(c1=rng.uniform(0, 0.03), c2=rng.uniform(0, 0.2))
        rows = rng.uniform(1, 5)
        groups = plan_stream_groups(contexts, device, verify, rows)
        assert covers_once(groups, k)
        order = sorted(range(k), key=lambda i: contexts[i])
        assert [i for g in groups for i in g] == order  # contiguous in context order
        best = min(stream_groups_latency(p, device, verify, rows) for p in contiguous_partitions(k))
        gaps.append(stream_groups_latency(groups, device, verify, rows) / best - 1)
    assert min(gaps) >= -1e-9
    assert sum(g < 1e-9 for g in gaps) >= 0.75 * len(gaps)
    assert sum(gaps) / len(gaps) <= 0.03 and max(gaps) <= 0.3


def test_no_streams_no_groups() -> None:
    assert plan_stream_groups([], Runtime(1, 1), Runtime(1, 1), 2) == []


def test_equal_groups() -> None:
    assert equal_groups([5, 6, 7], 2) == [[5, 6], [7]]
    assert equal_groups([1, 2, 3, 4], 4) == [[1], [2], [3], [4]]
    assert equal_groups([1, 2], 5) == [[1], [2]]
    assert equal_groups([1, 2, 3], 0) == [[1, 2, 3]]


# --- which work runs next ------------------------------------------------------------------------------------------

W, S = 0.02, 1.0  # max_wait (between rounds), sync_wait (at the worker)


def test_a_group_drafts_together_once_every_decoding_member_is_pending() -> None:
    pending = {1: Pending("draft", 10.0), 2: Pending("draft", 10.005)}
    assert next_unit([[1, 2]], pending, {}, 10.01, W, S) == ("draft", [1, 2])


def test_a_member_between_rounds_is_waited_for_briefly_then_left_behind() -> None:
    pending = {1: Pending("draft", 10.0)}
    away = {2: ("verified", 10.0)}  # its verification just ended: its next draft is due at once
    assert next_unit([[1, 2]], pending, away, 10.01, W, S) == pytest.approx(10.02)
    assert next_unit([[1, 2]], pending, away, 10.03, W, S) == ("draft", [1])


def test_a_member_at_the_worker_is_waited_for_up_to_the_sync_wait() -> None:
    # out of step: 1 wants to draft while 2's draft is still at the worker; 1 waits (up to 1 s) so both go together
    pending = {1: Pending("draft", 10.0)}
    away = {2: ("drafted", 9.9)}
    assert next_unit([[1, 2]], pending, away, 10.5, W, S) == pytest.approx(11.0)
    assert next_unit([[1, 2]], pending, away, 11.0, W, S) == ("draft", [1])


def test_a_group_verifies_before_it_drafts() -> None:
    pending = {1: Pending("draft", 10.0), 2: Pending("verify", 10.2)}
    assert next_unit([[1, 2]], pending, {}, 10.3, W, S) == ("verify", [2])


def test_groups_run_in_the_order_they_became_ready_and_prefill_is_not_starved() -> None:
    pending = {
        1: Pending("draft", 10.0),
        2: Pending("draft", 10.1),  # group [1, 2] ready at 10.1
        3: Pending("verify", 10.05),  # group [3] ready at 10.05
        9: Pending("prefill", 10.02),  # not in a decode group yet
    }
    groups = [[1, 2], [3]]
    assert next_unit(groups, pending, {}, 10.2, W, S) == ("prefill", [9])
    del pending[9]
    assert next_unit(groups, pending, {}, 10.2, W, S) == ("verify", [3])
    del pending[3]
    assert next_unit(groups, pending, {}, 10.2, W, S) == ("draft", [1, 2])


def test_a_stream_that_joined_after_the_plan_still_runs_and_nothing_pending_is_none() -> None:
    assert next_unit([[1]], {4: Pending("draft", 3.0)}, {1: ("drafted", 2.0)}, 3.0, W, S) == ("draft", [4])
    assert next_unit([[1, 2]], {}, {1: ("drafted", 2.0)}, 3.0, W, S) is None


def test_pipeline_latency_of_one_group_is_device_plus_verify() -> None:
    device, verify = Runtime(c1=0.01, c2=0.05), Runtime(c1=0.0, c2=0.2)
    assert math.isclose(stream_groups_latency([[0, 1]], device, verify, 2), (0.01 * 4 + 0.05) + 0.2)
