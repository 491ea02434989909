"""The per-key admission rule (app/serving/limits.py) on this process's counters: the same rule the shared
store's function runs (tests/integration/test_fleet.py holds it across two replicas on a real server)."""

from __future__ import annotations

import calendar

from app.serving.limits import (
    ADMITTED,
    DEVICE_ONLY,
    HOLD_SECONDS,
    KeyLimits,
    LocalCounters,
    period_window,
    rate_headers,
    retry_after,
    to_micro,
)

NOW = calendar.timegm((2026, 3, 31, 23, 59, 30))


def test_micro_dollars_round_half_up_and_add_up_without_drift():
    assert to_micro(0.0000015) == 2 and to_micro(0.0000014) == 1 and to_micro(0) == 0
    assert sum(to_micro(0.1) for _ in range(10)) == to_micro(1.0)


def test_periods_are_calendar_windows_in_utc():
    assert period_window("month", NOW)[:2] == ("2026-03", 30.0)
    assert period_window("day", NOW)[1] == 30.0
    label, left, keep = period_window("minute", NOW)
    assert left == 30.0 and keep == 120 and period_window("minute", NOW + 31)[0] != label
    assert period_window("month", calendar.timegm((2026, 12, 15, 0, 0, 0)))[0] == "2026-12"


def test_a_cap_counts_spend_and_what_is_reserved_in_flight():
    key = KeyLimits("k", cap_usd=0.0001, at_cap="reject")
    counters = LocalCounters()
    first = counters.admit(key, "a", NOW, 60)
    assert first.status == ADMITTED and first.reserved_micro == 60
    refused = counters.admit(key, "b", NOW, 60)  # 60 held + 60 > 100
    assert refused.status == "cap" and refused.streams == 1
    counters.settle(key, "a", NOW, 30, tokens=10)  # it cost less than it reserved
    assert counters.admit(key, "b", NOW, 60).status == ADMITTED  # 30 spent + 60 = 90


def test_at_the_cap_a_device_key_is_admitted_on_the_device_reserving_nothing():
    key = KeyLimits("k", cap_usd=0.0001, at_cap="device")
    counters = LocalCounters()
    counters.settle(key, "earlier", NOW, 100, tokens=0)
    verdict = counters.admit(key, "a", NOW, 1)
    assert verdict.status == DEVICE_ONLY and verdict.reserved_micro == 0 and verdict.admitted


def test_rate_limits_count_this_minute_and_streams_in_flight():
    key = KeyLimits("k", rpm=2, max_streams=5)
    counters = LocalCounters()
    assert [counters.admit(key, str(i), NOW, 0).status for i in range(3)] == [ADMITTED, ADMITTED, "rpm"]
    assert counters.admit(key, "next", NOW + 60, 0).status == ADMITTED  # a new minute
    streams = KeyLimits("s", max_streams=1)
    assert counters.admit(streams, "x", NOW, 0).status == ADMITTED
    assert counters.admit(streams, "y", NOW, 0).status == "streams"
    counters.settle(streams, "x", NOW, 0, 0)
    assert counters.admit(streams, "y", NOW, 0).status == ADMITTED


def test_a_hold_nobody_settles_lapses():
    key = KeyLimits("k", max_streams=1)
    counters = LocalCounters()
    counters.admit(key, "lost", NOW, 0)  # its replica died before settling
    assert counters.admit(key, "b", NOW + HOLD_SECONDS + 1, 0).status == ADMITTED


def test_tokens_per_minute_refuse_once_spent():
    key = KeyLimits("k", tpm=100)
    counters = LocalCounters()
    counters.admit(key, "a", NOW, 0)
    counters.settle(key, "a", NOW, 0, tokens=100)
    assert counters.admit(key, "b", NOW, 0).status == "tpm"


def test_the_headers_name_only_the_limits_a_key_has():
    key = KeyLimits("k", rpm=10, cap_usd=1.0)
    verdict = LocalCounters().admit(key, "a", NOW, 250_000)
    headers = rate_headers(key, verdict, NOW)
    assert headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "30s",
        "x-tandem-budget-remaining-usd": "0.750000",
    }
    assert retry_after(key, "rpm", NOW) == 30 and retry_after(KeyLimits("m", period="month"), "cap", NOW) == 30


def test_a_keys_line_shows_its_period_spend_and_what_it_holds_in_flight():
    capped, plain = KeyLimits("team", cap_usd=1.0, rpm=10), KeyLimits("sha256-0123456789abcdef")
    assert capped.limited and not plain.limited
    counters = LocalCounters()
    counters.admit(capped, "a", NOW, 300)
    counters.admit(capped, "b", NOW, 200)
    line = counters.usage(capped, NOW)
    assert (line["reserved_usd"], line["streams"], line["requests_this_minute"]) == (0.0005, 2, 2)
    counters.settle(capped, "a", NOW, 120, 9)
    counters.settle(plain, "p", NOW, 7, 3)  # a key without limits: never admitted, settled all the same
    line = counters.usage(capped, NOW)
    assert (line["spent_micro"], line["reserved_usd"], line["streams"]) == (120, 0.0002, 1)
    assert line["tokens_this_minute"] == 9
    assert line["cap_usd"] == 1.0 and line["rpm"] == 10 and line["name"] == "team"
    mine = counters.usage(plain, NOW)
    assert (mine["spent_micro"], mine["tokens_this_minute"]) == (7, 3)
    assert mine["streams"] is None and mine["requests_this_minute"] is None  # counted at admission only
    # A new period starts from nothing; what a reservation held expires with it.
    later = counters.usage(capped, NOW + 86400)
    assert later["spent_micro"] == 0 and later["streams"] == 0
