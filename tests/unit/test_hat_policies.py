"""HAT chunking (Eq. 3), drafting (Eqs. 1-2, 5, 6) and speculation length (Eq. 7): pure arithmetic."""

from __future__ import annotations

import math

import pytest

from policies.chunking import as_delay_fn, chunk_bounds, chunk_size, split_prompt
from policies.drafting import (
    AcceptanceEstimator,
    DelayPredictor,
    DraftLengthController,
    DraftStopRule,
    LinkState,
    argmax_draft_length,
    best_draft_length,
    expected_tokens_per_verification,
    parallel_draft_steps,
    should_stop_drafting,
)
from policies.estimate import MovingAverage

A = 896 * 4  # bytes of one Qwen 0.5B fp32 hidden state


def _residual(x: int, *, beta: float, g, mu: float, p: int) -> float:
    fn = as_delay_fn(g)
    return x * A / beta - (fn(mu) + fn(mu + x)) / p


def test_chunk_size_solves_eq3_linear_closed_form() -> None:
    g = (0.0005, 0.05)  # 0.5 ms per token + 50 ms fixed
    beta = 5e6  # 5 MB/s: 0.72 ms per token upload
    x = chunk_size(token_bytes=A, beta_up=beta, g=g, mu=100, pipeline=1, min_chunk=1, max_chunk=100_000)
    # closed form: X = 2 g(mu) / (P A/beta - slope)
    expected = 2 * (0.0005 * 100 + 0.05) / (A / beta - 0.0005)
    assert x == round(expected)
    assert abs(_residual(x, beta=beta, g=g, mu=100, p=1)) < A / beta  # balanced to within one token's upload


def test_chunk_size_callable_matches_linear_and_handles_nonlinear() -> None:
    g = (0.0005, 0.05)
    kw = dict(token_bytes=A, beta_up=5e6, mu=100, pipeline=2, min_chunk=1, max_chunk=100_000)
    lin = chunk_size(g=g, **kw)
    call = chunk_size(g=lambda n: 0.0005 * n + 0.05, **kw)
    assert abs(lin - call) <= 1

    sqrt_g = lambda n: 0.01 * math.sqrt(n)  # noqa: E731 - sublinear compute
    x = chunk_size(g=sqrt_g, **kw)
    assert _residual(x - 1, beta=5e6, g=sqrt_g, mu=100, p=2) < 0 < _residual(x + 1, beta=5e6, g=sqrt_g, mu=100, p=2)


def test_chunk_size_clamps_and_reacts_to_inputs() -> None:
    base = dict(token_bytes=A, g=(0.0005, 0.05), mu=100, pipeline=1, min_chunk=16, max_chunk=1024)
    # Very slow uplink: uploading dominates at any size -> smallest chunk.
    assert chunk_size(beta_up=1e3, **base) == 16
    # Uplink so fast that compute always dominates -> no point chunking: largest chunk.
    assert chunk_size(beta_up=1e12, **base) == 1024
    # Faster uplink -> bigger chunks; busier cloud (larger mu) -> bigger chunks; more stages -> smaller chunks.
    assert chunk_size(beta_up=4e6, **base) < chunk_size(beta_up=6e6, **base)
    assert chunk_size(beta_up=5e6, **{**base, "mu": 10}) < chunk_size(beta_up=5e6, **{**base, "mu": 200})
    assert chunk_size(beta_up=5e6, **{**base, "pipeline": 4}) < chunk_size(beta_up=5e6, **base)
    with pytest.raises(ValueError):
        chunk_size(beta_up=0, **base)
    with pytest.raises(ValueError):
        chunk_size(beta_up=1e6, **{**base, "min_chunk": 10, "max_chunk": 5})


def test_split_prompt_and_bounds() -> None:
    assert split_prompt(10, 4) == [4, 4, 2]
    assert split_prompt(8, 4) == [4, 4]
    assert split_prompt(0, 4) == []
    assert chunk_bounds([4, 4, 2]) == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ValueError):
        split_prompt(5, 0)


def test_moving_average_eq1() -> None:
    mu = MovingAverage()
    assert mu.get(3.0) == 3.0
    assert mu.update(10) == 10  # first sample initialises
    assert mu.update(20) == pytest.approx(0.8 * 10 + 0.2 * 20)
    assert mu.update(20) == pytest.approx(0.8 * 12 + 0.2 * 20)
    assert mu.count == 3
    with pytest.raises(ValueError):
        MovingAverage(alpha=1.5)


def test_delay_predictor_eq2_at_one_size_and_linear_fit() -> None:
    g = DelayPredictor(prior_slope=0.001)
    assert g.coefficients() == (0.001, 0.0)
    for eta in (0.10, 0.20, 0.20):
        g.update(64, eta)
    # Eq. 2 recursion (initialised with the first sample): 0.1 -> 0.12 -> 0.136
    assert g(64) == pytest.approx(0.136, rel=1e-9)
    assert g.coefficients()[0] == 0.001  # one batch size seen: slope from the prior
    assert g(164) == pytest.approx(0.136 + 0.1)

    lin = DelayPredictor()
    for n in (8, 64, 16, 128, 32):
        lin.update(n, 0.002 * n + 0.05)
    slope, intercept = lin.coefficients()
    assert slope == pytest.approx(0.002) and intercept == pytest.approx(0.05)
    assert lin(1000) == pytest.approx(2.05)

    # Forgetting: after the cloud gets slower, predictions move toward the new regime.
    for _ in range(30):
        lin.update(64, 0.5)
    assert lin(64) == pytest.approx(0.5, rel=0.01)


def test_draft_stop_rule_eq5() -> None:
    rule = DraftStopRule(eta=0.6, max_draft=4)
    assert rule.decide(0.9, 0) == (True, False)
    assert rule.decide(0.59, 1) == (True, True)  # low-confidence token is the last draft (HAT)
    assert DraftStopRule(include_low_confidence=False).decide(0.5, 1) == (False, True)
    assert rule.decide(0.99, 3) == (True, True)  # reaches max_draft
    assert rule.decide(0.99, 4) == (False, True)
    assert should_stop_drafting(0.5, 1) and not should_stop_drafting(0.7, 1) and should_stop_drafting(0.7, 8)
    with pytest.raises(ValueError):
        DraftStopRule(eta=2)


def test_parallel_draft_steps_eq6() -> None:
    # 4 drafts, 3584 B each, 5 MB/s up, 10 MB/s down, cloud 100 ms, 20 ms per draft step
    window = 4 * A / 5e6 + 0.1 + 4 * A / 10e6
    assert parallel_draft_steps(draft_len=4, token_bytes=A, beta_up=5e6, beta_down=10e6, g_mu=0.1, gamma=0.02) == (
        math.floor(window / 0.02)
    )
    assert (
        parallel_draft_steps(draft_len=4, token_bytes=A, beta_up=5e6, beta_down=1e7, g_mu=0.1, gamma=0.02, max_steps=3)
        == 3
    )
    assert parallel_draft_steps(draft_len=0, token_bytes=A, beta_up=1, beta_down=1, g_mu=0.03, gamma=0.01) == 3
    with pytest.raises(ValueError):
        parallel_draft_steps(draft_len=1, token_bytes=A, beta_up=1, beta_down=1, g_mu=0.1, gamma=0)


def test_expected_tokens_eq7() -> None:
    assert expected_tokens_per_verification(0.0, 5) == 1.0
    assert expected_tokens_per_verification(1.0, 5) == 6.0
    assert expected_tokens_per_verification(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert expected_tokens_per_verification(0.5, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens_per_verification(1.2, 3)


def test_best_draft_length() -> None:
    # Free drafting and free verification of any length: longest draft wins when acceptance is high.
    assert best_draft_length(0.95, draft_step=0.0, verify_time=1.0, max_len=8) == 8
    # Expensive drafts and poor acceptance: one draft token.
    assert best_draft_length(0.2, draft_step=1.0, verify_time=0.1, max_len=8) == 1
    # Brute force agrees on a realistic CPU profile (verify cost grows with length).
    verify = lambda n: 0.11 + 0.02 * n  # noqa: E731
    best = max(range(1, 9), key=lambda n: expected_tokens_per_verification(0.8, n) / (0.045 * n + verify(n)))
    assert best_draft_length(0.8, 0.045, verify, max_len=8) == best


def test_acceptance_estimator() -> None:
    est = AcceptanceEstimator(prior_accepted=0, prior_rejections=0)
    est.update(3, 4)  # 3 accepted, then a rejection
    est.update(4, 4)  # whole draft accepted: no rejection
    assert est.alpha == pytest.approx(7 / 8)
    with pytest.raises(ValueError):
        est.update(5, 4)
    assert 0 < AcceptanceEstimator().alpha < 1


# --- draft length at run time (Eq. 7 over the measured round time) ---------------------------------------------


def test_argmax_draft_length_brute_force_and_ties() -> None:
    cost = lambda n: 0.04 + 0.01 * n  # noqa: E731
    for alpha in (0.1, 0.5, 0.8, 0.95):
        best = max(range(1, 9), key=lambda n: (expected_tokens_per_verification(alpha, n) / cost(n), -n))
        assert argmax_draft_length(alpha, cost, 8) == best
    # alpha = 0: every length yields 1 token; with a flat cost every l ties -> the smallest.
    assert argmax_draft_length(0.0, lambda n: 1.0, 8) == 1
    # An exact tie between two lengths goes to the smaller: L(1)=1.5, L(2)=1.75 at alpha 0.5; cost 1.5 vs 1.75.
    assert argmax_draft_length(0.5, {1: 1.5, 2: 1.75, 3: 100.0}.__getitem__, 3) == 1
    assert argmax_draft_length(0.5, lambda n: 1.0, 6, min_len=3) == 6
    with pytest.raises(ValueError):
        argmax_draft_length(0.5, cost, 0)


LINK = LinkState(token_bytes=A, beta_up=10e6, beta_down=20e6, mu=2.0, g=(0.001, 0.01))


def test_round_time_is_assembled_from_its_parts() -> None:
    c = DraftLengthController(mode="eq7", max_len=8)
    c.step, c.head_row, c.rtt = 0.004, 0.002, 0.04
    c.pooled = AcceptanceEstimator(prior_accepted=3, prior_rejections=1)  # alpha 0.75
    t = c.round_time(3, LINK)
    assert t.draft == pytest.approx(4 * 0.004)  # l drafts = l + 1 feeds (the last accepted token first)
    assert t.upload == pytest.approx(4 * A / 10e6)
    assert t.worker == pytest.approx(0.001 * (2.0 + 4) + 0.01)  # g(mu + l + 1)
    assert t.download == pytest.approx(4 * A / 20e6)
    assert t.head == pytest.approx(0.002 * (1 + 0.75 * 3))  # row 0, then the rest when draft 0 was accepted
    assert t.rtt == 0.04
    assert t.total == pytest.approx(t.draft + t.upload + t.worker + t.download + t.head + t.rtt)
    # The plan is the brute-force argmax of L / T_round over 1..max_len.
    rate = lambda n: expected_tokens_per_verification(0.75, n) / c.round_time(n, LINK).total  # noqa: E731
    assert c.plan(LINK) == max(range(1, 9), key=lambda n: (rate(n), -n))


def test_plan_follows_latency_and_acceptance() -> None:
    c = DraftLengthController(mode="eq7", max_len=8)
    c.step, c.head_row, c.rtt = 0.01, 0.001, 0.0
    c.pooled = AcceptanceEstimator(prior_accepted=8, prior_rejections=2)  # 0.8
    short = c.plan(LINK)
    c.rtt = 0.2  # a slow link makes each verification dear: draft longer
    assert c.plan(LINK) > short
    c.pooled = AcceptanceEstimator(prior_accepted=1, prior_rejections=9)  # 0.1: hardly anything is accepted
    c.rtt = 0.0
    assert c.plan(LINK) == 1
    assert DraftLengthController(mode="eta", max_len=5).plan(LINK) == 5  # no planning under "eta"
    with pytest.raises(ValueError, match="draft_length"):
        DraftLengthController(mode="eq8")


def test_observe_updates_alpha_hat_and_the_measured_parts() -> None:
    c = DraftLengthController(mode="eq7", max_len=8)
    a0 = c.alpha
    c.observe(drafted=4, accepted=4, draft_s=0.05, head_s=0.01, wait_s=0.1, link=LINK)
    assert c.alpha > a0  # a fully accepted draft: no rejection
    assert c.step == pytest.approx(0.05 / 5) and c.head_row == pytest.approx(0.01 / 5)
    modelled = c.round_time(4, LINK)
    assert c.rtt == pytest.approx(0.1 - modelled.upload - modelled.worker - modelled.download)
    a1 = c.alpha
    c.observe(drafted=3, accepted=0, draft_s=0.04, head_s=0.002, wait_s=0.0, link=LINK)
    assert c.alpha < a1
    assert c.head_row == pytest.approx(0.8 * 0.01 / 5 + 0.2 * 0.002)  # one head row when draft 0 was rejected
    assert c.rtt < 0.1 and c.rtt >= 0.0  # the residual is clamped at 0, then averaged
    assert c.pooled.accepted == 4 and c.pooled.rejections == 1
    c.observe(drafted=2, accepted=1)  # timings optional (a prepared draft): only acceptance moves
    assert c.step == pytest.approx(0.8 * 0.01 + 0.2 * 0.04 / 4)
    with pytest.raises(ValueError):
        c.observe(drafted=2, accepted=3)
    with pytest.raises(ValueError):
        c.observe(drafted=2, accepted=1, confident=[True])


def test_eq7_eta_plans_with_the_acceptance_of_confident_drafts() -> None:
    """Under the eta stop the last draft is the unsure one and usually rejected; the cap only binds on all-confident
    rounds, so "eq7+eta" plans with the confident drafts' acceptance, "eq7" with everything it drafted."""
    for mode in ("eq7+eta", "eq7"):
        c = DraftLengthController(mode=mode, max_len=8)
        for _ in range(20):  # 3 confident drafts accepted, then an unsure one rejected
            c.observe(drafted=4, accepted=3, confident=[True, True, True, False])
        pooled = c.pooled.alpha
        assert pooled == pytest.approx((60 + 4) / (60 + 4 + 20 + 1))
        assert c.confident.alpha == pytest.approx((60 + 4) / (60 + 4 + 1))  # no confident draft was rejected
        assert c.alpha == (c.confident.alpha if mode == "eq7+eta" else pooled)
    c = DraftLengthController(mode="eq7+eta")
    c.observe(drafted=3, accepted=1, confident=[True, True, False])  # rejected at a confident draft
    assert (c.confident.accepted, c.confident.rejections) == (1, 1)
    c.observe(drafted=2, accepted=0, confident=[False, True])  # rejected at an unsure one: not a confident trial
    assert (c.confident.accepted, c.confident.rejections) == (1, 1)
