"""The drafting station's pure decisions: which streams draft together (exact, on fitted T(b, F); Alg. 1 as the
baseline) and which work runs next (group barriers, straggler waits, no starvation)."""

from __future__ import annotations

import math
import random

import pytest

from clients.hat.station_schedule import Pending, equal_groups, next_unit
from policies.cost import QWEN2_5_0_5B
from policies.sd_edge import Runtime, contiguous_partitions
from policies.stream_groups import (
    alg1_stream_groups,
    attention_span,
    min_heaviest,
    plan_stream_groups,
    round_period,
    stream_work,
)

# --- which streams draft together ---------------------------------------------------------------------------------


def covers_once(groups: list[list[int]], k: int) -> bool:
    flat = [i for g in groups for i in g]
    return sorted(flat) == list(range(k))


def set_partitions(items: list[int]) -> list[list[list[int]]]:
    """Every partition of `items` into non-empty groups (Bell(k) of them)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for p in set_partitions(rest):
        out.append([[first], *p])
        for g in range(len(p)):
            out.append([*p[:g], [first, *p[g]], *p[g + 1 :]])
    return out


def test_the_period_of_a_free_running_station() -> None:
    """One group: d + v. Two equal groups: 2·max(d, v) — not Alg. 1's barrier d + max(d, v) + v."""
    device, verify = Runtime(c1=0.01, c2=0.05), Runtime(c1=0.0, c2=0.2)
    work = [2.0, 2.0]
    assert math.isclose(round_period([[0, 1]], work, device, verify), (0.01 * 4 + 0.05) + 0.2)
    assert math.isclose(round_period([[0], [1]], work, device, verify), 2 * max(0.01 * 2 + 0.05, 0.2))


def test_a_flat_costly_verify_stage_keeps_every_stream_in_one_group() -> None:
    # A CPU worker: a pass costs ~170 ms whatever its rows, the device's batched step has a sizeable fixed cost:
    # every extra group adds a worker pass to the period, so one group.
    device, verify = Runtime(c1=0.004, c2=0.05), Runtime(c1=0.001, c2=0.17)
    assert plan_stream_groups([40, 300, 90, 120], device, verify, rows_per_stream=2.5) == [[0, 2, 3, 1]]


def test_balanced_stages_growing_with_rows_split_streams_into_pipelined_groups() -> None:
    device, verify = Runtime(c1=0.02, c2=0.001), Runtime(c1=0.02, c2=0.002)
    groups = plan_stream_groups([10, 20, 30, 40], device, verify, rows_per_stream=3)
    assert len(groups) == 2 and covers_once(groups, 4)
    work = stream_work([10, 20, 30, 40], 3)
    assert round_period(groups, work, device, verify) < round_period([[0, 1, 2, 3]], work, device, verify)


def test_context_weighs_a_streams_work() -> None:
    span = attention_span(QWEN2_5_0_5B)
    assert 1_000 < span < 100_000  # a row's attention matches its weights' FLOPs somewhere in the thousands
    work = stream_work([0, span], 2.0, span)
    assert sum(work) == pytest.approx(4.0) and work[1] == pytest.approx(2 * work[0])
    assert stream_work([10, 5000], 2.0) == [2.0, 2.0]  # span inf: context ignored
    # a long stream alone, three short ones together (balanced work), rather than two and two by count
    device, verify = Runtime(c1=0.02, c2=0.001), Runtime(c1=0.02, c2=0.002)
    groups = plan_stream_groups([100, 100, 100, 3 * span], device, verify, 2.0, span)
    assert sorted(map(sorted, groups)) == [[0, 1, 2], [3]]


@pytest.mark.parametrize("seed", range(3))
def test_the_grouping_is_the_exact_optimum_on_random_instances(seed: int) -> None:
    """Brute force over every set partition (Bell(k), k <= 7): the plan's period equals the least one, on random
    stage times, row counts and contexts (context weighing the work)."""
    rng = random.Random(seed)
    for _ in range(100):
        k = rng.randint(1, 7)
        contexts = [rng.randint(10, 4000) for _ in range(k)]
        device = Runtime(c1=rng.uniform(0, 0.03), c2=rng.uniform(0, 0.08))
        verify = Runtime(c1=rng.uniform(0, 0.03), c2=rng.uniform(0, 0.2))
        rows, span = rng.uniform(1, 5), rng.choice([math.inf, 2000.0, 8000.0])
        groups = plan_stream_groups(contexts, device, verify, rows, span)
        assert covers_once(groups, k)
        work = stream_work(contexts, rows, span)
        best = min(round_period(p, work, device, verify) for p in set_partitions(list(range(k))))
        assert round_period(groups, work, device, verify) == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_least_heaviest_group_by_branch_and_bound() -> None:
    work = [1.0, 2.0, 3.0, 4.0]  # contiguous splits give 6 at best; {1, 4}, {2, 3} gives 5
    groups = min_heaviest(work, 2)
    assert max(sum(work[i] for i in g) for g in groups) == 5.0
    work = [3.0, 3.0, 2.0, 2.0, 2.0]  # longest-processing-time first gives 7 ({3, 2, 2}, {3, 2}); best 6
    assert max(sum(work[i] for i in g) for g in min_heaviest(work, 2)) == 6.0


def test_alg1_stays_as_the_papers_baseline() -> None:
    """Alg. 1 (the step-barrier model over contiguous context-sorted groups) is what `grouping = "alg1"` runs; on
    random instances it is never better than the exact plan under the station's period, and often worse."""
    rng = random.Random(11)
    worse = 0
    for _ in range(200):
        k = rng.randint(1, 8)
        contexts = [rng.randint(10, 2000) for _ in range(k)]
        device = Runtime(c1=rng.uniform(0, 0.03), c2=rng.uniform(0, 0.08))
        verify = Runtime(c1=rng.uniform(0, 0.03), c2=rng.uniform(0, 0.2))
        rows = rng.uniform(1, 5)
        alg1 = alg1_stream_groups(contexts, device, verify, rows)
        assert covers_once(alg1, k)
        assert [i for g in alg1 for i in g] == sorted(range(k), key=lambda i: contexts[i])  # contiguous, sorted
        assert any(alg1 == [[p[i] for i in g] for g in q] for p in [sorted(range(k), key=lambda i: contexts[i])]
                   for q in contiguous_partitions(k))  # fmt: skip
        work = stream_work(contexts, rows)
        exact = round_period(plan_stream_groups(contexts, device, verify, rows), work, device, verify)
        mine = round_period(alg1, work, device, verify)
        assert exact <= mine * (1 + 1e-12)
        worse += mine > exact * 1.001
    assert worse > 0


def test_no_streams_no_groups() -> None:
    assert plan_stream_groups([], Runtime(1, 1), Runtime(1, 1), 2) == []
    assert alg1_stream_groups([], Runtime(1, 1), Runtime(1, 1), 2) == []


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
