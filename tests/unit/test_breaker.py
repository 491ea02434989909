"""policies/breaker.py: the retry schedule, Retry-After, and the circuit breaker's cool-down (time is an argument)."""

from __future__ import annotations

import email.utils

import pytest

from policies.breaker import BreakerSettings, CircuitBreaker, RetrySettings, parse_retry_after, retry_wait

WALL = 1_700_000_000.0  # Unix time at monotonic 0, for what the breaker shows


# -- retry schedule ---------------------------------------------------------------------------------------------------
def test_backoff_doubles_and_jitter_spreads_it():
    settings = RetrySettings(retries=3, backoff_seconds=0.5, jitter=0.5, budget_seconds=100)
    assert retry_wait(settings, 0, 0.0, None, 0.5) == pytest.approx(0.5)  # the middle of the jitter: the backoff
    assert retry_wait(settings, 1, 0.0, None, 0.5) == pytest.approx(1.0)
    assert retry_wait(settings, 2, 0.0, None, 0.5) == pytest.approx(2.0)
    assert retry_wait(settings, 1, 0.0, None, 0.0) == pytest.approx(0.5)  # 1.0 × (1 − 0.5)
    assert retry_wait(settings, 1, 0.0, None, 0.999) == pytest.approx(1.5, abs=1e-2)  # 1.0 × (1 + 0.5)


def test_retries_are_bounded_in_count_and_by_the_budget():
    settings = RetrySettings(retries=2, backoff_seconds=1.0, jitter=0.0, budget_seconds=1.5)
    assert retry_wait(settings, 2, 0.0, None, 0.5) is None  # two retries were the most
    assert retry_wait(settings, 1, 1.0, None, 0.5) == pytest.approx(0.5)  # 2 s of backoff cut to the 0.5 s left
    assert retry_wait(settings, 1, 1.5, None, 0.5) is None  # nothing left to wait
    assert retry_wait(RetrySettings(retries=0), 0, 0.0, None, 0.5) is None


def test_retry_after_replaces_the_backoff_or_means_fall_back_now():
    settings = RetrySettings(retries=2, backoff_seconds=0.1, jitter=0.5, budget_seconds=4.0)
    assert retry_wait(settings, 0, 0.0, 3.0, 0.9) == 3.0  # no jitter on what the upstream asked for
    assert retry_wait(settings, 0, 0.0, 5.0, 0.9) is None  # longer than the budget: do not wait
    assert retry_wait(settings, 1, 2.0, 3.0, 0.9) is None  # longer than what is left of it


def test_retry_after_in_seconds_or_as_an_http_date():
    now = 1_700_000_000.0
    assert parse_retry_after("7", now) == 7.0
    assert parse_retry_after(" 1.5 ", now) == 1.5
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now) == pytest.approx(30.0)
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now) == 0.0  # a date past: at once
    assert parse_retry_after("-3", now) == 0.0
    assert parse_retry_after(None, now) is None
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after("inf", now) is None


# -- circuit breaker --------------------------------------------------------------------------------------------------
def test_consecutive_failures_open_it_and_a_success_closes_it():
    b = CircuitBreaker(BreakerSettings(failures_to_open=3, cooldown_seconds=2.0))
    now = 100.0
    assert not b.failed("503", now) and not b.failed("503", now)
    assert not b.is_open(now) and b.cooling(now, WALL + now) is None
    assert b.failed("answered 503", now)
    assert b.is_open(now)
    assert b.cooling(now, WALL + now) == "cooling until 22:15:02 UTC (2.0 s more)"  # WALL + 102 s
    shown = b.describe(now, WALL + now)
    assert shown["state"] == "open" and shown["last_error"] == "answered 503" and shown["cooling_seconds"] == 2.0
    now += 2.0
    assert not b.is_open(now)  # cooled: the next request is the probe
    b.succeeded()
    assert b.failures == 0 and b.describe(now, WALL + now)["state"] == "closed"
    assert not b.failed("503", now)  # counting starts again from zero


def test_the_cool_down_doubles_with_each_opening_up_to_the_cap():
    b = CircuitBreaker(BreakerSettings(failures_to_open=1, cooldown_seconds=1.0, max_cooldown_seconds=5.0))
    now = 0.0
    lengths = []
    for _ in range(5):
        assert b.failed("refused", now)
        lengths.append(b.open_until - now)
        now = b.open_until  # the probe after the cool-down fails again
    assert lengths == [1.0, 2.0, 4.0, 5.0, 5.0]
    b.succeeded()
    b.failed("refused", now)
    assert b.open_until - now == 1.0  # a success reset the doubling


def test_retry_after_opens_it_at_once_for_that_long():
    b = CircuitBreaker(BreakerSettings(failures_to_open=3, cooldown_seconds=1.0))
    now = 50.0
    assert b.failed("429", now, retry_after=30.0)
    shown = b.describe(now, WALL + now)
    assert shown["cooling_seconds"] == 30.0 and shown["cooling_until"] == pytest.approx(WALL + now + 30.0)
    assert b.is_open(now + 29.9)
    assert not b.is_open(now + 30.0)
    b.failed("429", now, retry_after=5.0)
    assert b.open_until == now + 30.0  # a shorter Retry-After does not cut a cool-down short


def test_it_tells_each_opening():
    b = CircuitBreaker(BreakerSettings(failures_to_open=2))
    openings = []
    b.on_open = lambda: openings.append(1)
    b.failed("x", 0.0)
    assert openings == []
    b.failed("x", 0.0)
    b.failed("x", 0.0, retry_after=1.0)
    assert len(openings) == 2
