"""Budget values bounded where they are set (app/serving/budget.py: a PUT, the config at start-up, a state file), and
bookings that saturate instead of overflowing (app/serving/limits.py's to_micro, the ledger): a price or rate of
1e308 is finite, yet what it prices overflowed the micro-dollar booking mid-answer."""

from __future__ import annotations

import json
import math

import pytest

from app.serving.budget import (
    CONSUMPTION_RATE_RANGE,
    MAX_EXCHANGE_RATE,
    MAX_PRICE,
    UNITS,
    BudgetSettings,
    BudgetValidationError,
    Price,
    apply_patch,
)
from app.serving.ledger import Ledger, LedgerStateError
from app.serving.limits import MAX_MICRO, MAX_USD, Admission, KeyLimits, LocalCounters, Verdict, to_micro


def settings() -> BudgetSettings:
    return BudgetSettings(prices={"cloud": Price(0.15, 0.6)})


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"prices": {"cloud": {"decode": 1e308}}}, "prices.cloud.decode"),
        ({"prices": {"cloud": {"prefill": MAX_PRICE * 1.01}}}, "prices.cloud.prefill"),
        ({"prices": {"cloud": {"cached": 1e308}}}, "prices.cloud.cached"),
        ({"prices": {"cloud": {"reasoning": 1e20}}}, "prices.cloud.reasoning"),
        ({"exchange_rate": 1e308}, "exchange_rate"),
        ({"exchange_rate": MAX_EXCHANGE_RATE * 10}, "exchange_rate"),
        ({"consumption_rate": 1e308}, "consumption_rate"),
        ({"consumption_rate": 1e-300}, "consumption_rate"),
    ],
)
def test_a_value_outside_its_range_is_refused_naming_the_field_and_the_range(patch, field):
    with pytest.raises(BudgetValidationError) as info:
        apply_patch(settings(), patch)
    assert info.value.field == field
    assert field in info.value.message and "at most" in info.value.message


def test_the_bounds_themselves_are_accepted_and_documented():
    low, high = CONSUMPTION_RATE_RANGE
    top = apply_patch(
        settings(),
        {"prices": {"cloud": {"prefill": MAX_PRICE, "decode": 0.0}}, "exchange_rate": MAX_EXCHANGE_RATE},
    )
    assert top.prices["cloud"].prefill == MAX_PRICE and top.exchange_rate == MAX_EXCHANGE_RATE
    assert apply_patch(settings(), {"consumption_rate": low}).consumption_rate == low
    assert apply_patch(settings(), {"consumption_rate": high}).consumption_rate == high
    assert f"{MAX_PRICE:g}" in UNITS["prices"] and f"{MAX_EXCHANGE_RATE:g}" in UNITS["exchange_rate"]
    assert f"{high:g}" in UNITS["consumption_rate"]


def test_a_config_price_outside_the_range_fails_start_up_naming_its_config_field():
    from app.config import Settings

    with pytest.raises(ValueError, match=r"clouds\.cloud\.decode.*at most"):
        Settings(clouds={"cloud": {"price": {"prefill_per_million": 1.0, "decode_per_million": 1e308}}})
    with pytest.raises(ValueError, match=r"disco\.exchange_rate.*at most"):
        Settings(disco={"exchange_rate": 1e308})


def test_a_state_file_with_an_absurd_value_is_an_error_naming_the_file_and_field(tmp_path):
    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"version": 1, "settings": {"exchange_rate": 1e308}}))
    with pytest.raises(LedgerStateError, match=r"invalid at exchange_rate"):
        Ledger(path, settings())


def test_micro_dollars_saturate_instead_of_overflowing():
    assert to_micro(float("inf")) == MAX_MICRO and to_micro(1e308) == MAX_MICRO
    assert to_micro(float("-inf")) == -MAX_MICRO
    assert to_micro(float("nan")) == MAX_MICRO  # a cost that is not a number counts as the most: a cap stops
    assert to_micro(0.0123) == 12300 and to_micro(MAX_USD) == MAX_MICRO


def test_the_ledger_books_an_infinite_or_absurd_cost_saturated_and_its_books_stay_json():
    ledger = Ledger(None, settings())
    ledger.record("r1", "cloud", 10, 5, float("inf"), constrained=True, prompt_tokens=10)
    ledger.record("r2", "cloud", 10, 5, 1e308, constrained=True, prompt_tokens=10)
    spend = ledger.snapshot()["spend"]
    assert spend["cost_micro"] == 2 * MAX_MICRO and spend["cost_usd"] == 2 * MAX_USD
    json.dumps(spend, allow_nan=False)


def test_a_keys_books_take_an_absurd_cost_without_raising():
    key = KeyLimits("k", cap_usd=1.0)
    counters = LocalCounters()
    verdict = counters.admit(key, "a", 0.0, to_micro(1e308))  # the reservation of a request priced absurdly
    assert verdict.status == "device" and math.isfinite(verdict.spent_micro)
    admission = Admission("b", key, 0, Verdict("ok", 0, 0, 0, 0, 0), 0.0, shared=False)
    assert admission.add(float("inf"), 3)
    counters.settle(key, "b", 0.0, *admission.remainder())
    assert counters.usage(key, 0.0)["spent_micro"] == MAX_MICRO
