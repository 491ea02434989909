"""Streams booked as they go (docs/fleet.md, "A replica crash"): the ledger's bookings of running work as changes
against its tally (app/serving/ledger.py), a key's partial settlements (app/serving/limits.py's Admission), and the
holds as leases its replica renews (LocalCounters; the store's `tandem_progress` does the same on a real server:
tests/integration/test_replica_crash.py). The pure arithmetic: the bookings of a request add up to exactly what one
booking at its end would be."""

from __future__ import annotations

import calendar

import pytest

from app.serving.budget import BudgetSettings, Price
from app.serving.ledger import Booking, Ledger, Tally
from app.serving.limits import ADMITTED, HOLD_SECONDS, UNLIMITED, Admission, KeyLimits, LocalCounters, to_micro

NOW = calendar.timegm((2026, 3, 31, 12, 0, 0))


def ledger() -> tuple[Ledger, list[Booking]]:
    told: list[Booking] = []
    book = Ledger(None, BudgetSettings(prices={"cloud": Price(150.0, 600.0)}))
    book.on_booking(told.append)
    return book, told


def spend(book: Ledger) -> dict:
    return book.snapshot()["spend"]


def test_bookings_as_it_goes_add_up_to_exactly_one_booking_at_the_end():
    whole, _ = ledger()
    whole.record("r", "cloud", 35, 60, 35 * 1.5e-4 + 60 * 6e-4, constrained=True, prompt_tokens=35)
    parts, told = ledger()
    tally = Tally()
    for decoded in (0, 7, 7, 19, 41, 60):  # the same work booked as it went (twice with nothing new)
        cost = 35 * 1.5e-4 + decoded * 6e-4
        parts.record("r", "cloud", 35, decoded, cost, constrained=True, prompt_tokens=35, tally=tally)
    a, b = spend(whole), spend(parts)
    assert b["cost_micro"] == a["cost_micro"] == 35 * 150 + 60 * 600
    assert b["endpoints"]["cloud"]["cost_usd"] == a["endpoints"]["cloud"]["cost_usd"]
    for field in ("requests", "prefill_tokens", "decode_tokens"):
        assert b["endpoints"]["cloud"][field] == a["endpoints"]["cloud"][field], field
    assert b["requests"] == 1 and b["window"] == a["window"]
    # What a shared store is told: one booking per change (none for the repeat), adding up to the same.
    assert len(told) == 5 and [t.new_request for t in told] == [True, False, False, False, False]
    assert sum(t.decode_tokens for t in told) == 60 and sum(t.prefill_tokens for t in told) == 35
    assert sum(t.cost_micro for t in told) == a["cost_micro"]
    assert all(t.input_tokens == 35 and t.constrained_input == 35 for t in told)


def test_micro_dollars_are_rounded_once_over_the_whole_not_per_booking():
    book, told = ledger()
    tally = Tally()
    for n in range(1, 8):  # 0.4 micro-dollars a token: rounding each part alone would book 0 seven times
        book.record("r", "cloud", 0, n, n * 4e-7, constrained=False, tally=tally)
    assert spend(book)["cost_micro"] == to_micro(7 * 4e-7) == 3
    assert sum(t.cost_micro for t in told) == 3


def test_a_cloud_usage_report_below_our_counts_books_a_negative_correction():
    book, told = ledger()
    tally = Tally()
    book.record("r", "cloud", 40, 20, 40 * 1.5e-4 + 20 * 6e-4, constrained=True, prompt_tokens=40, tally=tally)
    # Its report at the end: its tokenizer counted 36 prompt tokens (10 of them cached at no cost) and 18 answer
    # tokens: the final booking corrects ours, and the books hold exactly the report's.
    book.record(
        "r", "cloud", 36, 18, 26 * 1.5e-4 + 18 * 6e-4, constrained=True, prompt_tokens=40, cached_tokens=10, tally=tally
    )
    cloud = spend(book)["endpoints"]["cloud"]
    assert (cloud["prefill_tokens"], cloud["cached_tokens"], cloud["decode_tokens"]) == (36, 10, 18)
    assert cloud["cost_micro"] == 26 * 150 + 18 * 600 and cloud["requests"] == 1
    assert (told[-1].prefill_tokens, told[-1].decode_tokens) == (-4, -2)
    assert spend(book)["window"]["constrained_input_tokens"] == 36


def test_a_keys_partial_settlements_and_the_remainder_add_up_to_one_settlement():
    key = KeyLimits("k", max_streams=2)
    admission = Admission("q", key, 0, UNLIMITED, NOW, shared=False, choices=2)  # n = 2: two choices share the hold
    assert admission.progress("q-0", 0.001, 10) == (1000, 10)
    assert admission.progress("q-1", 0.002, 12) == (2000, 12)
    assert admission.progress("q-0", 0.0015, 15) == (500, 5)
    assert not admission.add(0.0016, 16, "q-0")  # choice 0 ends; choice 1 runs on
    assert admission.progress("q-1", 0.0025, 20) == (600, 9)
    assert admission.add(0.0024, 19, "q-1")  # the last one: due to settle, a correction downwards included
    assert admission.remainder() == (-100, -1)
    assert (admission.settled_micro, admission.settled_tokens) == (to_micro(0.0016) + to_micro(0.0024), 35)


def test_a_renewed_hold_outlives_its_lease_and_one_its_replica_stopped_renewing_lapses():
    key = KeyLimits("k", max_streams=2)
    counters = LocalCounters(hold_seconds=20.0)
    assert counters.admit(key, "alive", NOW, 0).status == ADMITTED
    assert counters.admit(key, "dead", NOW, 0).status == ADMITTED
    for t in range(2, 60, 2):  # "alive" renewed every 2 s, with what it booked since; "dead" never again
        counters.progress(key, "alive", NOW, NOW + t, 100, 3)
    line = counters.usage(key, NOW + 58)
    assert line["streams"] == 1 and line["spent_micro"] == 29 * 100  # partial settlements counted as they came
    assert counters.admit(key, "next", NOW + 58, 0).status == ADMITTED  # the dead one's stream is free again
    assert counters.admit(key, "more", NOW + 58, 0).status == "streams"  # the live one's is not
    counters.settle(key, "alive", NOW, 50, 1)  # the remainder, and its hold freed
    assert counters.usage(key, NOW + 58)["spent_micro"] == 29 * 100 + 50
    assert counters.usage(key, NOW + 58)["streams"] == 1


def test_a_lapsed_hold_is_not_brought_back_by_a_late_renewal():
    key = KeyLimits("k", max_streams=1)
    counters = LocalCounters()
    counters.admit(key, "late", NOW, 0)
    counters.progress(key, "late", NOW, NOW + HOLD_SECONDS + 1, 0, 0)  # its replica stalled past the lease
    assert counters.usage(key, NOW + HOLD_SECONDS + 1)["streams"] == 0
    assert counters.admit(key, "other", NOW + HOLD_SECONDS + 1, 0).status == ADMITTED


def test_the_settle_interval_and_the_lease_are_validated_where_they_are_set():
    from app.config import StateSettings

    state = StateSettings()
    assert (state.settle_seconds, state.hold_seconds) == (2.0, HOLD_SECONDS)
    with pytest.raises(ValueError, match=r"hold_seconds \(5\) must be at least 3 × state\.settle_seconds \(2\)"):
        StateSettings(hold_seconds=5)
    for bad in ({"settle_seconds": 0}, {"settle_seconds": 61, "hold_seconds": 600}, {"hold_seconds": 3601}):
        with pytest.raises(ValueError, match=r"settle_seconds|hold_seconds"):
            StateSettings(**bad)
