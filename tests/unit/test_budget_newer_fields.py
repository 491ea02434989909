"""Budget settings a newer release wrote to the shared store: its added fields are read past with a warning
(app/serving/valkey_state.py keeps them in the store), while a client's PUT naming a field this release does not
know stays a 400 naming it."""

from __future__ import annotations

import logging

import pytest

from app.serving.budget import BudgetSettings, BudgetValidationError, Price, apply_patch

BASE = BudgetSettings(prices={"cloud": Price(1.0, 2.0)})


def test_a_field_a_newer_release_added_is_read_past_with_a_warning_naming_it(caplog):
    caplog.set_level(logging.WARNING, logger="app.serving.budget")
    blob = {**BASE.to_dict(), "budget": 0.25, "surge": {"multiplier": 2}}
    settings = apply_patch(BASE, blob, unknown_backends="drop", unknown_fields="ignore")
    assert settings == BudgetSettings(budget=0.25, prices={"cloud": Price(1.0, 2.0)})
    assert any("surge" in r.getMessage() for r in caplog.records)


def test_a_client_naming_an_unknown_field_is_refused_with_the_field_named():
    with pytest.raises(BudgetValidationError) as caught:
        apply_patch(BASE, {"budget": 0.25, "surge": 2})
    assert caught.value.field == "surge" and "unknown field 'surge'" in caught.value.message


def test_a_known_field_with_a_value_this_release_refuses_is_still_unreadable():
    with pytest.raises(BudgetValidationError) as caught:
        apply_patch(BASE, {**BASE.to_dict(), "policy": "disco-next"}, unknown_fields="ignore")
    assert caught.value.field == "policy"
