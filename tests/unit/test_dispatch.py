"""Dispatch policies pinned to the paper: Eq. 3 / Alg. 3 threshold, Alg. 2 wait times, baselines."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from policies.dispatch import (
    DECLARATIONS,
    POLICY_NAMES,
    DeviceOnly,
    Disco,
    DiscoD,
    DiscoS,
    DispatchPlan,
    ServerOnly,
    StochD,
    StochS,
    canonical_name,
    length_histogram,
    make_policy,
    variant_for_side,
)
from policies.estimate import Estimators

# A small p(l): lengths 10, 20, 30, 40 once each. Σ l = 100, E[l] = 25, p(l) = 1/4.
LENGTHS = np.array([10, 20, 30, 40])
# 20 server TTFTs 0.05, 0.10, …, 1.00 s: F(0.05·k) = k/20.
TTFTS = np.round(np.arange(1, 21) * 0.05, 10)


def disco_s(b: float, lengths: np.ndarray = LENGTHS) -> DiscoS:
    p = DiscoS(random.Random(0))
    p.recompute(prompt_lengths=lengths, server_ttft=None, budget=b)
    return p


def disco_d(b: float, alpha: float = 0.1) -> DiscoD:
    p = DiscoD(random.Random(0))
    p.recompute(prompt_lengths=LENGTHS, server_ttft=TTFTS, budget=b, alpha=alpha)
    return p


# --------------------------------------------------------------------------- DiSCo-S (Eq. 3, Alg. 3)


def test_disco_s_threshold_hand_computed_exact_atom():
    # b = 0.7: Eq. 3 wants Σ_{l<l_th} l·p(l) = (1 − 0.7)·E[l], i.e. 30 of the 100 tokens on the device only.
    # Cumulative tokens by length: 10, 30, 60, 100 → the first reaching 30 is l = 20, exactly (tie_fraction 1):
    # lengths 10 and 20 run on the device only; 30 and 40 race. Server share = (30 + 40)/100 = 0.7 = b.
    p = disco_s(0.7)
    assert p.threshold == 20 and p.tie_fraction == pytest.approx(1.0)
    assert p.decide(10).start_device and not p.decide(10).start_cloud
    assert not p.decide(20, u=0.999).start_cloud
    for length in (30, 40, 35, 10_000):
        plan = p.decide(length)
        assert plan.race and plan.device_delay == 0.0
    assert p.decide(5).reason.startswith("disco-s")


def test_disco_s_threshold_hand_computed_split_atom():
    # b = 0.6: device-only target (1 − 0.6)·100 = 40 tokens. Cumulative 10, 30, 60 → l* = 30 with 30 tokens
    # below it; 10 more of its 30 tokens go to the device: tie_fraction = (40 − 30)/30 = 1/3.
    # Expected server share = (30·2/3 + 40)/100 = 0.6 exactly (the paper's strict threshold would give 0.7).
    p = disco_s(0.6)
    assert p.threshold == 30 and p.tie_fraction == pytest.approx(1 / 3)
    assert not p.decide(30, u=0.30).start_cloud  # u < 1/3 → device
    assert p.decide(30, u=0.34).race
    assert not p.decide(20).start_cloud and p.decide(40).race


def test_disco_s_budget_extremes():
    nothing = disco_s(0.0)
    assert all(not nothing.decide(x).start_cloud for x in (1, 40, 10**6))  # no server budget at all
    everything = disco_s(1.0)
    assert all(everything.decide(x).race for x in (0, 1, 40))


def test_disco_s_expected_server_share_equals_b_on_its_samples():
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, np.rint(rng.lognormal(np.log(48), 0.6, 5000))).astype(np.int64)
    total = lengths.sum()
    for b in (0.05, 0.2, 0.37, 0.5, 0.8, 0.95):
        p = disco_s(b, lengths)
        above = lengths[lengths > p.threshold].sum()
        at = lengths[lengths == p.threshold].sum()
        share = (above + (1 - p.tie_fraction) * at) / total
        assert share == pytest.approx(b, abs=1e-9)
        # Eq. 3 on the discrete p(l): device-only mass below l_th never exceeds (1 − b)·E[l].
        assert lengths[lengths < p.threshold].sum() <= (1 - b) * total + 1e-9


# --------------------------------------------------------------------------- DiSCo-D (Alg. 2)


def test_disco_d_wait_times_when_budget_below_alpha():
    # b = 0.05 ≤ α = 0.1 → every length waits w_tail = F^{-1}(1 − min(α, b)) = F^{-1}(0.95).
    # F(0.95) = 19/20 = 0.95 ≥ 0.95 and F(0.90) = 0.90 < 0.95 → w_tail = 0.95 s: P(T > 0.95) = 1/20 = b.
    p = disco_d(0.05)
    assert p.w_tail == pytest.approx(0.95)
    assert p.tail_share == pytest.approx(0.05)
    for length in (10, 20, 30, 40, 1000):
        plan = p.decide(length)
        assert plan.start_cloud and plan.start_device and plan.device_delay == pytest.approx(0.95)
        assert p.wait(length) == pytest.approx(0.95)


def test_disco_d_wait_times_hand_computed_phase_2():
    # b = 0.5, α = 0.1. Phase 1: w_tail = F^{-1}(0.9) = 0.90 s, P(T > 0.90) = 2/20 = 0.1.
    # Phase 2 budget 0.5 − 0.1 = 0.4. Starting the device at once for length l costs p(l)·l·(1 − α)/E[l]:
    #   l = 10: 0.25·10·0.9/25 = 0.09  (cum 0.09 ≤ 0.4 → w = 0)
    #   l = 20: 0.25·20·0.9/25 = 0.18  (cum 0.27 ≤ 0.4 → w = 0)
    #   l = 30: 0.25·30·0.9/25 = 0.27  (cum 0.54 > 0.4 → partial)
    # For l = 30 the remaining 0.13 buys P(T > w*) = 0.1 + 0.13·25/(0.25·30) = 0.5333;
    # w* = F^{-1}(1 − 0.5333) = F^{-1}(0.4667) = 0.50 s (F(0.50) = 0.5, F(0.45) = 0.45), P(T > 0.5) = 0.5.
    # l = 40 keeps w_tail. Expected device share = (10 + 20 + 30·0.5 + 40·0.1)/100 = 0.49 ≤ b.
    p = disco_d(0.5)
    assert p.w_tail == pytest.approx(0.90)
    assert p.partial_length == 30
    assert p.w_partial == pytest.approx(0.50)
    assert [p.wait(x) for x in (10, 20, 30, 40)] == pytest.approx([0.0, 0.0, 0.5, 0.9])
    assert p.decide(10).race and p.decide(25).race  # unseen lengths below the boundary start at once
    assert p.decide(30).device_delay == pytest.approx(0.5)
    assert p.decide(40).device_delay == pytest.approx(0.9) and p.decide(400).device_delay == pytest.approx(0.9)
    share = sum(x * np.mean(TTFTS > p.wait(x)) for x in LENGTHS) / LENGTHS.sum()
    assert share == pytest.approx(0.49)


def test_disco_d_budget_extremes():
    none = disco_d(0.0)
    assert math.isinf(none.w_tail)
    plan = none.decide(10)
    assert plan.start_cloud and not plan.start_device  # no device budget: the device never starts
    full = disco_d(1.0)
    assert all(full.decide(x).race for x in (10, 40, 500))


def test_disco_d_expected_device_share_tracks_b():
    rng = np.random.default_rng(1)
    lengths = np.maximum(1, np.rint(rng.lognormal(np.log(48), 0.6, 20_000))).astype(np.int64)
    ttft = rng.lognormal(np.log(0.4), 0.3, 20_000)
    for b in (0.02, 0.05, 0.2, 0.5, 0.8):
        p = DiscoD()
        p.recompute(prompt_lengths=lengths, server_ttft=ttft, budget=b, alpha=0.05)
        waits = np.array([p.wait(x) for x in range(lengths.max() + 1)])
        started = ttft > waits[lengths]  # each sample's own TTFT against its length's wait (same-sample check)
        share = (lengths * started).sum() / lengths.sum()
        assert share == pytest.approx(b, abs=0.01)


def _realised_share(policy, lengths, ttft, us, side):
    used = 0
    for x, t, u in zip(lengths.tolist(), ttft.tolist(), us.tolist(), strict=True):
        plan = policy.decide(x, u)
        if side == "server":
            used += x if plan.start_cloud else 0
        else:
            used += x if plan.start_device and (plan.device_delay is None or t > plan.device_delay) else 0
    return used / lengths.sum()


@pytest.mark.parametrize("b", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_realised_budget_on_fresh_requests_within_3_percent(b):
    # Policies fit on one sample, judged on 10,000 new requests from the same distribution.
    rng = np.random.default_rng(int(b * 100))
    fit_l = np.maximum(1, np.rint(rng.lognormal(np.log(48), 0.6, 5000))).astype(np.int64)
    fit_t = rng.lognormal(np.log(0.4), 0.3, 5000)
    new_l = np.maximum(1, np.rint(rng.lognormal(np.log(48), 0.6, 10_000))).astype(np.int64)
    new_t = rng.lognormal(np.log(0.4), 0.3, 10_000)
    us = rng.random(10_000)
    s, d = DiscoS(), DiscoD()
    s.recompute(prompt_lengths=fit_l, server_ttft=fit_t, budget=b)
    d.recompute(prompt_lengths=fit_l, server_ttft=fit_t, budget=b)
    assert _realised_share(s, new_l, new_t, us, "server") == pytest.approx(b, abs=0.03)
    assert _realised_share(d, new_l, new_t, us, "device") == pytest.approx(b, abs=0.03)


# --------------------------------------------------------------------------- baselines, registry, plan


def test_stochastic_baselines_route_by_the_uniform_draw():
    s = StochS()
    s.recompute(budget=0.3)
    assert s.decide(50, u=0.29).start_cloud and not s.decide(50, u=0.29).start_device
    assert s.decide(50, u=0.31).start_device and not s.decide(50, u=0.31).start_cloud
    d = StochD()
    d.recompute(budget=0.3)
    assert d.decide(50, u=0.29).start_device and not d.decide(50, u=0.29).start_cloud
    assert d.decide(50, u=0.31).start_cloud and not d.decide(50, u=0.31).start_device
    race = StochS(race=True)
    race.recompute(budget=0.3)
    assert race.decide(50, u=0.1).race


def test_stochastic_baselines_use_the_injected_rng():
    a, b = StochD(random.Random(42)), StochD(random.Random(42))
    a.recompute(budget=0.4)
    b.recompute(budget=0.4)
    seq_a = [a.decide(10).start_device for _ in range(10_000)]
    seq_b = [b.decide(10).start_device for _ in range(10_000)]
    assert seq_a == seq_b
    assert np.mean(seq_a) == pytest.approx(0.4, abs=0.02)


def test_server_only_and_device_only():
    assert ServerOnly().decide(10) == DispatchPlan(True, False, None, "server-only", "server-only policy")
    plan = DeviceOnly().decide(10)
    assert plan.start_device and not plan.start_cloud and plan.device_delay is None


def test_registry_names_and_aliases():
    assert set(POLICY_NAMES) == {
        "disco", "disco-s", "disco-d", "quality", "server-only", "device-only", "stoch-s", "stoch-d", "cloud", "device",
    }  # fmt: skip
    assert {a: d.name for d in DECLARATIONS for a in d.aliases} == {"cloud": "server-only", "device": "device-only"}
    assert isinstance(make_policy("cloud"), ServerOnly)
    assert isinstance(make_policy("Device"), DeviceOnly)
    assert isinstance(make_policy("disco-d"), DiscoD)
    assert canonical_name(" STOCH-S ") == "stoch-s"
    with pytest.raises(ValueError, match="disco-s"):
        make_policy("random")
    assert variant_for_side("server") == "disco-s" and variant_for_side("device") == "disco-d"


def test_disco_auto_picks_the_variant_by_constrained_side():
    p = make_policy("disco")
    assert isinstance(p, Disco)
    with pytest.raises(RuntimeError):
        p.decide(10)  # not computed yet
    with pytest.raises(ValueError, match="side"):
        p.recompute(prompt_lengths=LENGTHS, server_ttft=TTFTS, budget=0.5)
    p.recompute(prompt_lengths=LENGTHS, server_ttft=TTFTS, budget=0.6, side="server")
    assert p.active is p.s and not p.decide(10).start_cloud and p.describe()["variant"] == "disco-s"
    p.recompute(prompt_lengths=LENGTHS, server_ttft=TTFTS, budget=0.5, alpha=0.1, side="device")
    assert p.active is p.d and p.decide(40).device_delay == pytest.approx(0.9)


def test_recompute_validates_inputs():
    with pytest.raises(ValueError, match="budget"):
        DiscoS().recompute(prompt_lengths=LENGTHS, budget=1.5)
    with pytest.raises(ValueError, match="alpha"):
        DiscoD().recompute(prompt_lengths=LENGTHS, server_ttft=TTFTS, budget=0.5, alpha=0.0)
    with pytest.raises(ValueError):
        DiscoS().recompute(prompt_lengths=None, budget=0.5)
    with pytest.raises(ValueError):
        DiscoD().recompute(prompt_lengths=LENGTHS, server_ttft=np.array([]), budget=0.5)
    with pytest.raises(ValueError):
        length_histogram(np.array([-1, 3]))


def test_plan_invariants():
    with pytest.raises(ValueError):
        DispatchPlan(False, False, None, "x", "")
    with pytest.raises(ValueError):
        DispatchPlan(True, False, 0.5, "x", "")
    assert not DispatchPlan(True, True, 0.3, "x", "").race


def test_recompute_from_live_estimators_works_before_any_sample():
    est = Estimators()
    s = make_policy("disco-s")
    s.recompute_from(est, "cloud", budget=0.5)  # priors only: a threshold inside the prior's lengths
    assert 1 < s.threshold < 10_000 and 0.0 <= s.tie_fraction <= 1.0
    assert not s.decide(1).start_cloud and s.decide(10_000).race
    d = make_policy("disco-d")
    d.recompute_from(est, "cloud", budget=0.5)  # the cloud always starts, the device of a long prompt after w_tail
    assert math.isfinite(d.w_tail) and d.w_tail > 0
    assert all(d.decide(x).start_cloud for x in (1, 48, 10_000))
    assert d.decide(10_000).device_delay == pytest.approx(d.w_tail)
    d = DiscoD()
    d.recompute_from(est, "cloud", budget=0.03)
    # Prior TTFT log-normal(median 0.5, σ 0.6): w_tail = its ~97th percentile ≈ 0.5·e^{0.6·1.88} ≈ 1.5 s.
    assert 1.0 < d.w_tail < 2.2


def test_length_histogram_matches_unique():
    x = np.array([5, 3, 5, 9, 3, 3])
    vals, cnt = length_histogram(x)
    assert vals.tolist() == [3, 5, 9] and cnt.tolist() == [3, 2, 1]
    vals, cnt = length_histogram(np.array([2.0, 2.2, 7.9]))
    assert vals.tolist() == [2, 8] and cnt.tolist() == [2, 1]
    vals, cnt = length_histogram(np.array([1 << 23, 1]))
    assert vals.tolist() == [1, 1 << 23]
