"""Estimators: empirical CDF / inverse, line fit, residual answer length, moving averages, priors."""

from __future__ import annotations

import numpy as np
import pytest

from policies.estimate import (
    DeviceTTFTLine,
    EmpiricalTTFT,
    Estimators,
    MigrationTimes,
    MovingAverage,
    OutputLengths,
    PromptLengths,
    RingBuffer,
    inverse_cdf,
    lognormal_quantiles,
)


def test_inverse_cdf_is_the_smallest_sample_with_F_at_least_p():
    x = np.arange(1.0, 11.0)  # F(k) = k/10
    assert inverse_cdf(x, 0.9) == 9.0  # F(9) = 0.9 ≥ 0.9
    assert inverse_cdf(x, 0.91) == 10.0  # F(9) = 0.9 < 0.91
    assert inverse_cdf(x, 0.1) == 1.0
    assert inverse_cdf(x, 0.11) == 2.0
    assert inverse_cdf(x, 0.0) == 1.0
    assert inverse_cdf(x, 1.0) == 10.0
    # Budget property: the share strictly above F^{-1}(1 − q) is at most q.
    rng = np.random.default_rng(1)
    y = rng.lognormal(0, 1, 997)
    for q in (0.01, 0.05, 0.37):
        assert np.mean(y > inverse_cdf(y, 1 - q)) <= q
    with pytest.raises(ValueError):
        inverse_cdf(np.array([]), 0.5)


def test_empirical_ttft_prior_then_real_samples():
    est = EmpiricalTTFT(window=100, min_samples=20, prior_median=0.5, prior_sigma=0.6)
    assert est.count == 0
    prior = est.samples()
    assert len(prior) == 64 and np.median(prior) == pytest.approx(0.5, rel=0.05)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        est.add(v)
    assert len(est.samples()) == 69  # blended while fewer than min_samples
    for v in range(6, 21):
        est.add(float(v))
    s = est.samples()
    assert sorted(s.tolist()) == [float(v) for v in range(1, 21)]  # prior dropped at 20 real samples
    assert est.cdf(10.0) == 0.5
    assert est.cdf(0.5) == 0.0
    assert est.quantile(0.5) == 10.0
    assert est.inverse_cdf(0.95) == 19.0
    assert est.mean() == pytest.approx(10.5)


def test_rolling_window_evicts_oldest():
    est = EmpiricalTTFT(window=5, min_samples=1)
    for v in range(1, 9):
        est.add(float(v))
    assert sorted(est.samples().tolist()) == [4.0, 5.0, 6.0, 7.0, 8.0]
    assert est.quantile(0.2) == 4.0
    est.extend(np.array([100.0, 200.0]))
    assert sorted(est.samples().tolist()) == [6.0, 7.0, 8.0, 100.0, 200.0]
    with pytest.raises(ValueError):
        est.add(float("nan"))
    with pytest.raises(ValueError):
        est.extend([1.0, -2.0])


def test_ring_buffer_extend_longer_than_capacity_keeps_the_tail():
    rb = RingBuffer(4)
    rb.add(1)
    rb.extend(np.arange(10.0))
    assert sorted(rb.values().tolist()) == [6.0, 7.0, 8.0, 9.0]
    assert len(rb) == 4 and rb.capacity == 4


def test_empirical_quantiles_of_a_large_lognormal_sample():
    rng = np.random.default_rng(7)
    est = EmpiricalTTFT(window=50_000)
    est.extend(rng.lognormal(np.log(0.4), 0.3, 50_000))
    # log-normal quantiles: median 0.4, p99 = 0.4·e^{0.3·2.3263} = 0.8054
    assert est.quantile(0.5) == pytest.approx(0.4, rel=0.01)
    assert est.quantile(0.99) == pytest.approx(0.8054, rel=0.02)
    assert est.cdf(0.8054) == pytest.approx(0.99, abs=0.003)


def test_device_line_least_squares_recovers_k_and_c():
    lengths = [10, 50, 100, 200, 400]
    line = DeviceTTFTLine.fit(lengths, [0.0125 * x + 0.05 for x in lengths])
    assert line.k == pytest.approx(0.0125, rel=1e-6)
    assert line.c == pytest.approx(0.05, rel=1e-5)
    assert line.predict(80) == pytest.approx(1.05, rel=1e-6)
    assert line.q == pytest.approx(0.0, abs=1e-12)  # a straight line's samples: no attention term
    # Noisy points: the running fit equals numpy's least squares over (1, n, n(n+1)/2).
    rng = np.random.default_rng(3)
    ls = rng.integers(5, 500, 200).astype(float)
    ts = 0.02 * ls + 0.1 + rng.normal(0, 0.05, 200)
    c, k, q = np.linalg.lstsq(np.stack([np.ones_like(ls), ls, ls * (ls + 1) / 2], 1), ts, rcond=None)[0]
    fit = DeviceTTFTLine.fit(ls, ts)
    assert fit.k == pytest.approx(k, rel=1e-5) and fit.c == pytest.approx(c, rel=1e-4)
    assert fit.q == pytest.approx(q, rel=1e-4)


def test_device_line_prices_a_warm_prefills_tokens_at_their_position():
    """Prefill time grows with the context each new token attends to: the 0.5B device on 2 cores (its measured
    prefills of 1k, 4k and 12k tokens, docs/bench/context-windows.md) costs ~4.4 ms a token plus ~1.5 µs an attention
    pair. Fitted on cold prompts alone, the line predicts a warm turn's 200 new tokens after 14,800 held ones at
    their position's price (~5.3 s), not at the start's (~0.8 s), nor at a cold prompt's average."""
    line = DeviceTTFTLine.fit([1024, 4096, 12288], [5.17, 30.39, 167.0])
    assert line.k == pytest.approx(4.36e-3, rel=0.01) and line.q == pytest.approx(1.50e-6, rel=0.01)
    assert line.predict(15_000) == pytest.approx(234.5, rel=0.01)  # cold: about four minutes
    warm = line.predict(200, held=14_800)
    assert warm == pytest.approx(0.79 + 1.5e-6 * (200 * 14_800 + 200 * 201 / 2), rel=0.02)
    assert 4.5 < warm < 6.0 and line.predict(200) < 1.0
    # Samples that say where they started are fitted as such: a warm sample and a cold one of the same new tokens.
    both = DeviceTTFTLine.fit([200, 200, 4096, 1024], [warm, line.predict(200), 30.39, 5.17], held=[14_800, 0, 0, 0])
    assert both.predict(200, held=14_800) == pytest.approx(warm, rel=0.01)


def test_device_line_starts_at_prior_and_refines_online():
    line = DeviceTTFTLine(k=0.01, c=0.05, decay=1.0)
    assert line.count == 0
    assert line.predict(100) == pytest.approx(1.05)  # prior alone
    for x in range(10, 500, 5):
        line.add(x, 0.02 * x + 0.2)  # a slower device than the prior says
    # Without forgetting the prior stays one pseudo-observation strong: a small pull.
    assert line.k == pytest.approx(0.02, rel=0.03)
    assert line.c == pytest.approx(0.2, abs=0.06)
    aging = DeviceTTFTLine(k=0.01, c=0.05)  # default decay: the prior ages with the data
    for x in range(10, 500, 5):
        aging.add(x, 0.02 * x + 0.2)
    assert abs(aging.k - 0.02) < abs(line.k - 0.02) and abs(aging.c - 0.2) < abs(line.c - 0.2)
    assert aging.k == pytest.approx(0.02, rel=0.02)


def test_device_line_forgets_old_speed():
    line = DeviceTTFTLine(decay=0.95)
    for x in range(10, 410, 4):
        line.add(x, 0.01 * x + 0.05)
    for x in range(10, 410, 4):
        line.add(x, 0.03 * x + 0.05)  # throttled
    assert line.k == pytest.approx(0.03, rel=0.05)


def test_device_line_single_length_stays_defined():
    line = DeviceTTFTLine(k=0.01, c=0.05)
    for _ in range(50):
        line.add(100, 2.0)
    assert line.predict(100) == pytest.approx(2.0, rel=0.05)
    assert line.predict(0) >= 0.0
    assert line.predict(500) > line.predict(100)  # the prior's slope holds where no sample was
    with pytest.raises(ValueError):
        line.add(-1, 1.0)
    with pytest.raises(ValueError):
        line.add(10, 1.0, held=-1)


def test_prompt_lengths_prior_is_integer_and_positive():
    p = PromptLengths()
    s = p.samples()
    assert s.dtype.kind == "i" and s.min() >= 1
    assert np.median(s) == pytest.approx(48, rel=0.1)
    for v in range(1, 30):
        p.add(v)
    assert sorted(p.samples().tolist()) == list(range(1, 30))


def test_output_expected_remaining_is_the_mean_residual():
    out = OutputLengths(min_samples=1)
    for v in (10, 20, 30, 40):
        out.add(v)
    assert out.expected_remaining(0) == 25.0  # mean(10, 20, 30, 40)
    assert out.expected_remaining(15) == 15.0  # mean(20, 30, 40) − 15
    assert out.expected_remaining(20) == 15.0  # L > 20: mean(30, 40) − 20
    assert out.expected_remaining(39) == 1.0
    assert out.expected_remaining(40) == 0.0  # nothing observed that long: no expected gain
    assert out.expected_remaining(25, max_tokens=30) == 5.0  # min(mean(30, 40) − 25 = 10, 30 − 25)
    out.add(100)  # cache refreshes on new data
    assert out.expected_remaining(40) == 60.0


def test_output_lengths_prior_before_samples():
    out = OutputLengths()
    assert out.mean() == pytest.approx(np.mean(np.rint(lognormal_quantiles(100, 0.7))), rel=1e-6)
    assert out.expected_remaining(0) > 90


def test_moving_average_and_migration_times():
    ma = MovingAverage(alpha=0.5, value=1.0)  # the prior 1.0 weighs like one sample
    ma.update(3.0)
    assert ma.value == 2.0
    ma.update(2.0)
    assert ma.value == 2.0 and ma.count == 2
    mt = MigrationTimes(prior=1.0, weight=0.5)
    assert mt.estimate("cloud") == 1.0
    assert mt.estimate("device", prior=0.3) == 0.3
    mt.add("cloud", 3.0)
    assert mt.estimate("cloud") == 2.0
    assert mt.estimate("cloud", prior=9.0) == 2.0  # observations beat the prior
    with pytest.raises(ValueError):
        MovingAverage(alpha=1.0)  # all history, no sample: it would never learn


def test_estimators_keep_one_ttft_distribution_per_backend():
    est = Estimators(window=10)
    a, b = est.server("a"), est.server("b")
    assert a is est.server("a") and a is not b
    a.add(1.0)
    assert a.count == 1 and b.count == 0
