"""Migration control (Eqs. 4-6): trigger, buffer, consumption clock, delayed tokens."""

from __future__ import annotations

import random

import pytest

from policies.migration import (
    READING_RATE,
    buffer_tokens,
    deadline,
    delayed_tokens,
    lead,
    should_migrate,
)


def _check(**kw):
    base = dict(
        source="cloud",
        target="device",
        source_decode_price=0.60e-6,
        target_decode_price=0.30e-6,
        target_prefill_price=0.20e-6,
        prompt_tokens=50,
        delivered_tokens=10,
        expected_remaining=100.0,
    )
    base.update(kw)
    return should_migrate(**base)


def test_eq5_hand_example_pays():
    # Δc = 0.60 − 0.30 = 0.30 $/M; saving = 0.30e-6 · 100 = 3.0e-5.
    # overhead = target prefill 0.20e-6 · (50 prompt + 10 delivered) = 1.2e-5 < saving → migrate.
    d = _check()
    assert d.migrate
    assert d.saving == pytest.approx(3.0e-5)
    assert d.overhead == pytest.approx(1.2e-5)
    assert not d.start_now  # no lead / buffer given: it pays, but the gateway must wait for the buffer


def test_eq5_hand_example_does_not_pay():
    # remaining 30: saving 0.30e-6 · 30 = 9e-6 < overhead 1.2e-5 → stay.
    d = _check(expected_remaining=30.0)
    assert not d.migrate and not d.start_now
    # The fixed part of the overhead counts too: 3e-5 saving vs 1.2e-5 + 2e-5.
    assert not _check(fixed_overhead=2e-5).migrate


def test_cached_prefix_of_the_target_is_not_overhead():
    # The device lost the race with the 50-token prompt prefilled: only the 10 delivered tokens are new.
    # remaining 30: saving 9e-6; overhead 0.20e-6 · (60 − 50) = 2e-6 → now it pays (without the cache it did not).
    d = _check(expected_remaining=30.0, cached_tokens=50)
    assert d.migrate and d.overhead == pytest.approx(2e-6)
    assert _check(cached_tokens=500).overhead == 0.0  # never negative


def test_exact_break_even_does_not_migrate():
    # saving == overhead: Eq. 4 is strict (">"). Exact binary numbers: Δc = 3 − 1 = 2, saving 2·30 = 60,
    # overhead 1·(50 + 10) = 60.
    d = _check(source_decode_price=3.0, target_decode_price=1.0, target_prefill_price=1.0, expected_remaining=30.0)
    assert d.saving == d.overhead == 60.0
    assert not d.migrate
    assert _check(source_decode_price=3.0, target_decode_price=1.0, target_prefill_price=1.0,
                  expected_remaining=30.5).migrate  # fmt: skip


def test_never_from_the_cheaper_decoder():
    d = _check(source_decode_price=0.30e-6, target_decode_price=0.60e-6, expected_remaining=1e9)
    assert not d.migrate and "dearer" in d.reason
    assert not _check(source_decode_price=0.5e-6, target_decode_price=0.5e-6, expected_remaining=1e9).migrate


def test_start_only_when_the_lead_reaches_the_buffer():
    b = buffer_tokens(READING_RATE, 2.0)  # 4.5 tok/s · 2 s = 9 tokens
    assert b == pytest.approx(9.0)
    assert not _check(client_lead=8.9, buffer=b).start_now
    d = _check(client_lead=9.0, buffer=b)
    assert d.migrate and d.start_now and d.buffer_tokens == b and d.lead == 9.0
    # A full buffer never makes an unprofitable migration start.
    assert not _check(expected_remaining=30.0, client_lead=100.0, buffer=b).start_now


def test_migration_never_fires_when_eq5_says_it_does_not_pay():
    rng = random.Random(5)
    fired = 0
    for _ in range(20_000):
        src, tgt = rng.uniform(0, 5e-6), rng.uniform(0, 5e-6)
        prefill = rng.uniform(0, 5e-6)
        prompt, delivered = rng.randint(1, 2000), rng.randint(0, 500)
        remaining = rng.uniform(0, 1000)
        fixed = rng.choice([0.0, rng.uniform(0, 1e-4)])
        d = should_migrate(
            source="a",
            target="b",
            source_decode_price=src,
            target_decode_price=tgt,
            target_prefill_price=prefill,
            prompt_tokens=prompt,
            delivered_tokens=delivered,
            expected_remaining=remaining,
            fixed_overhead=fixed,
            client_lead=rng.uniform(-5, 20),
            buffer=rng.uniform(0, 10),
        )
        pays = (src - tgt) * remaining > prefill * (prompt + delivered) + fixed
        assert d.migrate == (pays and src > tgt)
        assert not d.start_now or d.migrate
        fired += d.start_now
    assert fired > 1000  # the sweep does exercise firing


def test_consumption_clock_and_lead():
    # Token i is due at t_first + i/r_c: with r_c = 4 tok/s, token 8 is due 2 s after the first.
    assert deadline(0, 10.0, 4.0) == 10.0
    assert deadline(8, 10.0, 4.0) == 12.0
    # 12 tokens delivered by t_first + 2 s; the reader has taken 4·2 = 8 of them: 4 ahead.
    assert lead(12, now=12.0, t_first=10.0, r_c=4.0) == 4.0
    assert lead(3, now=12.0, t_first=10.0, r_c=4.0) == -5.0  # stream behind the reader
    with pytest.raises(ValueError):
        buffer_tokens(0.0, 1.0)


def test_delayed_tokens_counts_deliveries_after_their_deadline():
    # r_c = 2 tok/s from t_first = 1: deadlines 1.0, 1.5, 2.0, 2.5, 3.0.
    times = [1.0, 1.4, 2.1, 2.5, 3.2]  # third (2.1 > 2.0) and fifth (3.2 > 3.0) are late
    assert delayed_tokens(times, t_first=1.0, r_c=2.0) == 2
    assert delayed_tokens([1.0, 1.5, 2.0], t_first=1.0, r_c=2.0) == 0  # exactly on time is on time
    assert delayed_tokens([], t_first=0.0, r_c=2.0) == 0
