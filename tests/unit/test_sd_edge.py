"""SD-edge's model (sd-edge-pipeline.txt Eqs. 17-22, Alg. 1, Eq. 33) against independent references."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from policies.cost import flops_breakdown
from policies.sd_edge import (
    LLAMA_1_1B,
    LLAMA_7B,
    LLAMA_13B,
    LLAMA_68M,
    Pair,
    PassFlops,
    Runtime,
    Task,
    backtrack,
    best_spec_len,
    brute_force_contiguous,
    fit_runtime,
    num_steps,
    pipeline_latency,
    plan_batches,
    plan_latency,
    step_times,
)

PAIRS = [Pair(LLAMA_68M, LLAMA_7B), Pair(LLAMA_1_1B, LLAMA_7B), Pair(LLAMA_1_1B, LLAMA_13B)]


def simulate(draft: list[np.ndarray], verify: list[np.ndarray]) -> float:
    """A discrete-event simulation of two nodes: per decoding step (barrier between steps), the draft node runs the
    active batches in order; the verify node takes each batch once its draft is done and the node is free."""
    total = 0.0
    for n in range(max(len(d) for d in draft)):
        active = [m for m in range(len(draft)) if len(draft[m]) > n]
        events: list[tuple[float, int, str, int]] = []  # (time, tiebreak, kind, position in `active`)
        tie = 0
        waiting: list[int] = []
        verify_busy = False
        end = 0.0

        def push(t: float, kind: str, pos: int, events: list = events) -> None:
            nonlocal tie
            tie += 1
            heapq.heappush(events, (t, tie, kind, pos))

        push(draft[active[0]][n], "drafted", 0)
        while events:
            t, _, kind, pos = heapq.heappop(events)
            if kind == "drafted":
                if pos + 1 < len(active):
                    push(t + draft[active[pos + 1]][n], "drafted", pos + 1)
                waiting.append(pos)
            else:
                verify_busy = False
                end = max(end, t)
            if not verify_busy and waiting:
                nxt = waiting.pop(0)
                verify_busy = True
                push(t + verify[active[nxt]][n], "verified", nxt)
        total += end
    return total


def test_pipeline_recursion_equals_a_discrete_event_simulation() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        m = int(rng.integers(1, 8))
        steps = [int(rng.integers(1, 6)) for _ in range(m)]
        draft = [rng.exponential(1.0, s) for s in steps]
        verify = [rng.exponential(rng.choice([0.2, 1.0, 5.0]), s) for s in steps]
        assert pipeline_latency(draft, verify) == pytest.approx(simulate(draft, verify), rel=1e-12)
        # Without the pipeline every batch's two phases run back to back.
        seq = sum(float(d.sum() + v.sum()) for d, v in zip(draft, verify, strict=True))
        assert pipeline_latency(draft, verify, pipelined=False) == pytest.approx(seq)
        assert pipeline_latency(draft, verify) <= seq + 1e-9


def test_pass_flops_match_the_cost_model() -> None:
    for arch in (LLAMA_68M, LLAMA_1_1B, LLAMA_7B):
        f = PassFlops.of(arch)
        assert f(37, 500) == pytest.approx(sum(flops_breakdown(arch, 37, 500, 0).values()))
    # Gated FFN: three d×i matrices, so the per-token FFN term is 1.5× the paper's two-matrix Eq. 3.
    ffn = flops_breakdown(LLAMA_7B, 1, 0, 0)["ffn"]
    assert ffn == pytest.approx(1.5 * LLAMA_7B.n_layers * 4 * LLAMA_7B.hidden * LLAMA_7B.intermediate)


def test_step_times_sum_the_individual_passes() -> None:
    pair = PAIRS[1]
    b, inp, spec, alpha, steps = 3, 40, 4, 0.7, 5
    td, tv = step_times(pair, b, inp, spec, alpha, steps)
    fd, fv = pair.draft_flops, pair.verify_flops
    big_l = (1 - alpha ** (spec + 1)) / (1 - alpha)
    for n in range(1, steps + 1):
        want_d = 0.0
        for i in range(1, spec + 1):
            if n == 1 and i == 1:
                flops = fd(inp, inp * (inp + 1) / 2)
            else:
                kv = inp + ((n - 1) * big_l - 1) + i - 1  # Eq. 13's I^kv
                flops = fd(1, kv + 1)
            want_d += pair.draft_runtime(b, flops)
        if n == 1:
            fl = fv(inp + spec, (inp + spec) * (inp + spec + 1) / 2)
        else:
            kv = inp + (n - 1) * big_l - 1
            fl = fv(spec + 1, sum(kv + r for r in range(1, spec + 2)))
        assert td[n - 1] == pytest.approx(want_d)
        assert tv[n - 1] == pytest.approx(pair.verify_runtime(b, fl))


def _instance(seed: int) -> tuple[list[int], Pair, int, int]:
    rng = random.Random(seed)
    k = rng.randint(3, 10)
    return [rng.randint(1, 512) for _ in range(k)], rng.choice(PAIRS), rng.randint(1, 10), rng.choice([512, 2048])


@pytest.mark.parametrize("seed", range(12))
def test_corrected_alg1_is_within_5_percent_of_brute_force(seed: int) -> None:
    lengths, pair, spec, om = _instance(seed)
    plan = plan_batches(lengths, pair, spec, 0.8, om)
    tasks = [Task(x, om) for x in lengths]
    got = plan_latency(plan.batches, tasks, pair, spec, 0.8, max_output=om)
    assert got == pytest.approx(plan.planned, rel=1e-9)  # the DP's own total is the plan's latency
    best, _ = brute_force_contiguous(lengths, pair, spec, 0.8, om)
    assert best <= got * (1 + 1e-12)
    assert got <= 1.05 * best
    # And never worse than the two trivial plans.
    order = sorted(range(len(lengths)), key=lambda t: lengths[t])
    one = plan_latency([order], tasks, pair, spec, 0.8, max_output=om)
    each = plan_latency([[t] for t in order], tasks, pair, spec, 0.8, max_output=om)
    assert got <= min(one, each) * (1 + 1e-12)


def test_printed_eq29_picks_a_plan_at_least_10_percent_worse() -> None:
    """Regression case: Eq. 29 as printed adds T^d to the verify node's clock and chooses a much worse split."""
    lengths, pair, spec, om = [104, 336, 174, 28], PAIRS[1], 7, 256
    tasks = [Task(x, om) for x in lengths]
    corrected = plan_batches(lengths, pair, spec, 0.8, om)
    printed = plan_batches(lengths, pair, spec, 0.8, om, variant="printed")
    good = plan_latency(corrected.batches, tasks, pair, spec, 0.8, max_output=om)
    bad = plan_latency(printed.batches, tasks, pair, spec, 0.8, max_output=om)
    assert bad >= 1.10 * good


def test_backtracking_covers_every_task_exactly_once() -> None:
    rng = random.Random(3)
    for _ in range(300):
        k = rng.randint(1, 30)
        choice = [0]
        for i in range(1, k + 1):
            choice.append(rng.randint(1, i))
        batches = backtrack(choice)
        flat = [t for b in batches for t in b]
        assert flat == list(range(k))  # each sorted position once, in order, in contiguous batches
        assert all(b == list(range(b[0], b[-1] + 1)) for b in batches)
    for seed in range(6):
        lengths, pair, spec, om = _instance(seed)
        plan = plan_batches(lengths, pair, spec, 0.8, om)
        assert sorted(t for b in plan.batches for t in b) == list(range(len(lengths)))
    with pytest.raises(ValueError):
        backtrack([0, 0])  # Alg. 1 as printed leaves S[i] = 0 when j* = 1


def test_fit_runtime_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(1)
    true = Runtime(c1=2.08e-14, c2=1.28e-2)
    pts = []
    for _ in range(60):
        b, f = int(rng.integers(1, 64)), float(rng.uniform(1e9, 4e11))
        pts.append((b, f, float(true(b, f)) * (1 + rng.normal(0, 0.01))))
    fit = fit_runtime(pts)
    assert fit.c1 == pytest.approx(true.c1, rel=0.03)
    assert fit.c2 == pytest.approx(true.c2, rel=0.2)
    exact = fit_runtime([(b, f, float(true(b, f))) for b, f, _ in pts])
    assert exact.c1 == pytest.approx(true.c1, rel=1e-9) and exact.c2 == pytest.approx(true.c2, rel=1e-6)
    with pytest.raises(ValueError):
        fit_runtime([(1, 1e9, 0.1), (1, 1e9, 0.2)])


def test_speculation_length_search_and_steps() -> None:
    assert num_steps(2048, 0.8, 1) == 1138  # ceil(2048 / 1.8)
    lengths = [random.Random(5).randint(1, 512) for _ in range(12)]
    plan = best_spec_len(lengths, PAIRS[1], 0.8, 2048, max_spec=10)
    assert set(plan.per_l) == set(range(1, 11))
    assert plan.planned == min(plan.per_l.values()) and plan.per_l[plan.spec_len] == plan.planned
    # Cheap drafts and a strong acceptance make longer drafts pay.
    cheap = Pair(LLAMA_68M, LLAMA_13B, draft_runtime=Runtime(1e-15, 1e-5))
    assert best_spec_len(lengths, cheap, 0.95, 2048).spec_len > 1


def test_alg1s_memory_limit_changes_the_plan_and_every_batch_fits() -> None:
    """Γ_s binds: unlimited, Alg. 1 packs all ten tasks into one batch; with room for at most three tasks' KV on
    the draft node's longest input every batch fits (at its own longest input) and the plan splits; with room for
    none it refuses."""
    from policies.sd_edge import draft_memory_bytes

    rng = random.Random(3)
    lengths = [rng.randint(100, 1500) for _ in range(10)]
    pair = Pair(LLAMA_68M, LLAMA_7B)
    assert [len(b) for b in plan_batches(lengths, pair, 4, 0.7, 256).batches] == [10]
    cap = draft_memory_bytes(LLAMA_68M, 3, max(lengths), 256)
    plan = plan_batches(lengths, pair, 4, 0.7, 256, memory=cap)
    assert sorted(i for b in plan.batches for i in b) == list(range(10)) and len(plan.batches) >= 2
    for b in plan.batches:
        assert draft_memory_bytes(LLAMA_68M, len(b), max(lengths[i] for i in b), 256) <= cap
    with pytest.raises(ValueError, match="fits in memory"):
        plan_batches(lengths, pair, 4, 0.7, 256, memory=draft_memory_bytes(LLAMA_68M, 1, 50, 256))


def test_max_batch_size_is_the_largest_batch_that_fits() -> None:
    from policies.sd_edge import draft_memory_bytes, fixed_size_batches, max_batch_size

    tasks = [Task(200 + 100 * i, 256) for i in range(8)]
    for b in (1, 3, 5, 8):
        cap = draft_memory_bytes(LLAMA_68M, b, 900, 256) + 1.0  # room for b tasks at the longest input, not b + 1
        assert max_batch_size(tasks, LLAMA_68M, cap, 256) == b
        assert max(len(g) for g in fixed_size_batches(list(range(8)), b)) == b  # what the max-batching baseline runs
