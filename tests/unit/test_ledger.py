"""The ledger: validated budget settings that survive restarts, and spend accounting.

Why these tests: the ledger is the one source of truth for spend (a gateway that checks budgets in one place and
books spend in another can be bypassed), so a bad value must be refused with the field named, an accepted one
must outlive the process, a failed write must leave the old state intact, and the
realised budget ratio must follow the paper's definition (constrained endpoint's
share of input tokens, prompt counted once).
"""

from __future__ import annotations

import json
import math
import os

import pytest

import app.serving.ledger as ledger_mod
from app.serving.budget import BudgetSettings, BudgetValidationError, Price, from_config
from app.serving.disco import DiscoRuntime
from app.serving.ledger import Ledger, LedgerStateError
from policies.cost import QWEN2_5_0_5B, DeviceEnergy, TokenPrices, usd_per_pflop
from policies.dispatch import POLICY_NAMES, make_policy


def defaults(**kw) -> BudgetSettings:
    base = {"policy": "disco", "prices": {"cloud": Price(0.15, 0.60), "big": Price(2.5, 10.0)}}
    return BudgetSettings(**{**base, **kw})


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(None, defaults())


# ------------------------------------------------------------------ validation


def test_defaults_are_valid_and_documented_values():
    s = BudgetSettings()
    assert s.policy == "disco" and s.constrained_side == "auto"
    assert s.consumption_rate == 4.8 and s.migration is True
    assert 0 < s.alpha < 1 and 0 <= s.budget <= 1
    assert dict(s.prices) == {}


@pytest.mark.parametrize(
    ("patch", "field", "fragment"),
    [
        ({"budget": 1.5}, "budget", "budget must be in [0, 1], got 1.5"),
        ({"budget": -0.01}, "budget", "[0, 1]"),
        ({"budget": "0.5"}, "budget", "must be a number"),
        ({"budget": True}, "budget", "must be a number"),
        ({"budget": float("nan")}, "budget", "finite"),
        ({"alpha": 0}, "alpha", "(0, 1)"),
        ({"alpha": 1}, "alpha", "(0, 1)"),
        ({"alpha": 1.2}, "alpha", "(0, 1)"),
        ({"alpha": None}, "alpha", "must be a number"),
        ({"exchange_rate": -0.1}, "exchange_rate", "≥ 0"),
        ({"exchange_rate": float("inf")}, "exchange_rate", "finite"),
        ({"consumption_rate": 0}, "consumption_rate", "> 0"),
        ({"consumption_rate": -4.8}, "consumption_rate", "> 0"),
        ({"migration": "yes"}, "migration", "true or false"),
        ({"policy": "psychic"}, "policy", "unknown dispatch policy 'psychic'"),
        ({"policy": 3}, "policy", "must be a string"),
        ({"constrained_side": "moon"}, "constrained_side", "auto, server, device"),
        ({"policy": "disco-s", "constrained_side": "device"}, "constrained_side", "server-constrained"),
        ({"policy": "stoch-d", "constrained_side": "server"}, "constrained_side", "device-constrained"),
        ({"buget": 0.5}, "buget", "unknown field 'buget'"),
        ({"prices": {"nope": {"prefill": 1, "decode": 1}}}, "prices.nope", "unknown cloud backend 'nope'"),
        ({"prices": {"cloud": {"prefill": -1}}}, "prices.cloud.prefill", "≥ 0"),
        ({"prices": {"cloud": {"decode": "cheap"}}}, "prices.cloud.decode", "must be a number"),
        ({"prices": {"cloud": {"input": 1}}}, "prices.cloud.input", "unknown field"),
        ({"prices": {"cloud": 3}}, "prices.cloud", "must be an object"),
        ({"prices": [1, 2]}, "prices", "keyed by backend"),
    ],
)
def test_bad_values_are_refused_naming_the_field(ledger, patch, field, fragment):
    before = ledger.settings
    with pytest.raises(BudgetValidationError) as info:
        ledger.update(patch)
    assert info.value.field == field
    assert fragment in info.value.message
    assert field.split(".")[0] in info.value.message or field == "constrained_side"
    assert ledger.settings is before and ledger.version == 0


def test_unknown_policy_lists_the_known_ones(ledger):
    with pytest.raises(BudgetValidationError) as info:
        ledger.update({"policy": "psychic"})
    for name in POLICY_NAMES:
        assert name in info.value.message


def test_non_object_update_is_refused(ledger):
    with pytest.raises(BudgetValidationError) as info:
        ledger.update([("budget", 0.3)])  # type: ignore[arg-type]
    assert info.value.field is None


@pytest.mark.parametrize("b", [0, 0.0, 1, 1.0, 0.37])
def test_budget_boundaries_accepted(ledger, b):
    assert ledger.update({"budget": b}).budget == float(b)
    assert isinstance(ledger.settings.budget, float)


def test_exchange_rate_zero_accepted_and_alpha_accepts_what_dispatch_accepts(ledger):
    assert ledger.update({"exchange_rate": 0}).exchange_rate == 0.0
    for alpha in (1e-9, 0.05, 0.5, 1 - 1e-9):
        s = ledger.update({"alpha": alpha, "budget": 1})
        make_policy("stoch-s").recompute(budget=s.budget, alpha=s.alpha)  # must not raise


def test_policy_stored_canonical(ledger):
    assert ledger.update({"policy": " Cloud "}).policy == "server-only"
    assert ledger.update({"policy": "DISCO-D"}).policy == "disco-d"


def test_partial_update_keeps_other_fields(ledger):
    before = ledger.settings
    after = ledger.update({"budget": 0.2})
    assert after.budget == 0.2
    for name in ("policy", "constrained_side", "alpha", "exchange_rate", "consumption_rate", "migration", "prices"):
        assert getattr(after, name) == getattr(before, name)
    after = ledger.update({"prices": {"cloud": {"decode": 0.9}}})
    assert after.prices["cloud"] == Price(0.15, 0.9)  # prefill kept, decode changed
    assert after.prices["big"] == Price(2.5, 10.0)  # other backend untouched
    assert after.budget == 0.2


def test_version_bumps_only_on_change(ledger):
    ledger.update({})
    ledger.update({"budget": ledger.settings.budget})
    assert ledger.version == 0
    ledger.update({"budget": 0.1})
    assert ledger.version == 1


def test_settings_are_immutable(ledger):
    s = ledger.settings
    with pytest.raises(AttributeError):
        s.budget = 0.9  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.prices["cloud"] = Price(0, 0)  # type: ignore[index]


def test_invalid_defaults_fail_fast():
    with pytest.raises(BudgetValidationError) as info:
        BudgetSettings(budget=2)
    assert info.value.field == "budget"
    with pytest.raises(BudgetValidationError) as info:
        BudgetSettings(prices={"cloud": (0.1, -1)})
    assert info.value.field == "prices.cloud.decode"


# ------------------------------------------------------------------ cost model and side


def test_cost_model_uses_current_prices_and_lambda(ledger):
    energy = DeviceEnergy.from_arch(QWEN2_5_0_5B)
    ledger.update({"exchange_rate": 5.0, "prices": {"cloud": {"prefill": 1.0, "decode": 2.0}}})
    model = ledger.settings.cost_model("cloud", energy)
    assert model.server.prefill == pytest.approx(1e-6) and model.server.decode == pytest.approx(2e-6)
    assert model.lam == usd_per_pflop(5.0)
    with pytest.raises(KeyError, match="known: cloud, big"):
        ledger.settings.cost_model("nope", energy)


def test_constrained_side(ledger):
    """One place resolves the side (DiscoRuntime.side), from the ledger's settings and the request's policy."""
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B)
    ledger.update({"exchange_rate": 0.3})
    assert disco.side() == "server"  # λ·FLOPs cheaper than gpt-4o-mini
    ledger.update({"exchange_rate": 5.0})
    assert disco.side() == "device"
    ledger.update({"constrained_side": "server"})
    assert disco.side() == "server"  # operator pin wins
    ledger.update({"constrained_side": "auto", "policy": "disco-s"})
    assert disco.side() == "server"  # the policy name fixes it
    # A request's own policy fixes its side, whatever the configured one says.
    ledger.update({"exchange_rate": 0.3, "policy": "disco"})
    assert disco.side("cloud", "disco-d") == "device" and disco.side("cloud", "disco") == "server"


# ------------------------------------------------------------------ persistence


def test_settings_survive_a_restart(tmp_path):
    path = tmp_path / "state" / "budget.json"  # the directory does not exist yet
    first = Ledger(path, defaults())
    assert not path.exists()  # nothing written until something changes
    first.update({"budget": 0.25, "policy": "disco-d", "prices": {"big": {"decode": 12}}})
    second = Ledger(path, defaults())
    assert second.settings == first.settings
    assert second.settings.prices["big"] == Price(2.5, 12.0)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["settings"]["budget"] == 0.25


def test_state_file_wins_over_defaults_but_drops_removed_backends(tmp_path):
    path = tmp_path / "budget.json"
    Ledger(path, defaults()).update({"budget": 0.9, "prices": {"big": {"prefill": 3}}})
    only_cloud = BudgetSettings(prices={"cloud": Price(0.2, 0.2)}, budget=0.1)
    restarted = Ledger(path, only_cloud)
    assert restarted.settings.budget == 0.9
    assert dict(restarted.settings.prices) == {"cloud": Price(0.15, 0.6)}


def test_no_temp_files_left(tmp_path):
    path = tmp_path / "budget.json"
    ledger = Ledger(path, defaults())
    for b in (0.1, 0.2, 0.3):
        ledger.update({"budget": b})
    assert sorted(os.listdir(tmp_path)) == ["budget.json"]


def test_failed_write_leaves_old_file_and_memory_intact(tmp_path, monkeypatch):
    path = tmp_path / "budget.json"
    ledger = Ledger(path, defaults())
    ledger.update({"budget": 0.3})
    old = path.read_bytes()

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_mod.os, "replace", crash)
    with pytest.raises(LedgerStateError, match=str(path)):
        ledger.update({"budget": 0.7})
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["budget.json"]  # temp file cleaned up
    assert ledger.settings.budget == 0.3 and ledger.version == 1  # memory agrees with disk
    assert Ledger(path, defaults()).settings.budget == 0.3


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "corrupt"),
        ("", "corrupt"),
        ("[1, 2]", "not a version-1"),
        ('{"version": 99, "settings": {}}', "not a version-1"),
        ('{"version": 1, "settings": {"budget": 7}}', "invalid at budget"),
        ('{"version": 1, "settings": {"colour": "red"}}', "invalid at colour"),
    ],
)
def test_corrupt_state_file_is_an_error_naming_the_file(tmp_path, content, fragment):
    path = tmp_path / "budget.json"
    path.write_text(content)
    with pytest.raises(LedgerStateError) as info:
        Ledger(path, defaults())
    assert str(path) in str(info.value) and fragment in str(info.value)
    assert path.read_text() == content  # not reset


# ------------------------------------------------------------------ spend


def test_per_endpoint_totals(ledger):
    ledger.record("r1", "cloud", 100, 20, 0.002, constrained=True, prompt_tokens=100)
    ledger.record("r2", "device", 50, 10, 0.0001, constrained=False, prompt_tokens=50)
    # a race: both prefilled, the device won, the cloud was cancelled after its prefill
    ledger.record("r3", "cloud", 80, 0, 0.001, constrained=True, prompt_tokens=80)
    ledger.record("r3", "device", 80, 30, 0.0003, constrained=False, prompt_tokens=80)
    spend = ledger.snapshot()["spend"]
    assert spend["requests"] == 3
    assert spend["endpoints"]["cloud"] == {
        "requests": 2,
        "prefill_tokens": 180,
        "decode_tokens": 20,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "cost_usd": pytest.approx(0.003),
        "cost_micro": 3000,  # integer micro-dollars, each booking rounded: what a shared store adds up
    }
    assert spend["endpoints"]["device"]["requests"] == 2
    assert spend["endpoints"]["device"]["decode_tokens"] == 40
    assert spend["cost_usd"] == pytest.approx(0.0034) and spend["cost_micro"] == 3400


def test_realised_ratio_counts_each_prompt_once(ledger):
    assert ledger.realised_budget() is None  # nothing yet
    assert math.isnan(ledger.realised_ratio())  # a gauge needs a float
    ledger.record("short", "device", 20, 5, 0, constrained=False, prompt_tokens=20)
    ledger.record("race", "cloud", 80, 0, 0, constrained=True, prompt_tokens=80)
    ledger.record("race", "device", 80, 9, 0, constrained=False, prompt_tokens=80)
    # the server processed 80 of 100 input tokens (the race counts its prompt once, not twice)
    assert ledger.realised_budget() == pytest.approx(0.8)
    assert ledger.realised_ratio() == pytest.approx(0.8)
    # a migration target re-prefills prompt + delivered tokens; the prompt still counts once
    ledger.record("mig", "device", 100, 10, 0, constrained=False, prompt_tokens=100)
    ledger.record("mig", "cloud", 110, 50, 0, constrained=True, prompt_tokens=100)
    window = ledger.snapshot()["spend"]["window"]
    assert window["input_tokens"] == 200 and window["constrained_input_tokens"] == 180
    assert window["realised_budget"] == pytest.approx(0.9)


def test_without_prompt_tokens_the_largest_prefill_stands_in(ledger):
    ledger.record("race", "cloud", 60, 0, 0, constrained=True)
    ledger.record("race", "device", 60, 9, 0, constrained=False)
    ledger.record("dev", "device", 40, 9, 0, constrained=False)
    assert ledger.realised_budget() == pytest.approx(60 / 100)


def test_window_rolls():
    ledger = Ledger(None, defaults(policy="disco-d"), window=3)
    ledger.record("a", "device", 100, 1, 0, constrained=True, prompt_tokens=100)
    for rid in ("b", "c", "d"):
        ledger.record(rid, "cloud", 100, 1, 0, constrained=False, prompt_tokens=100)
    window = ledger.snapshot()["spend"]["window"]
    assert window == {
        "size": 3,
        "requests": 3,
        "input_tokens": 300,
        "constrained_input_tokens": 0,
        "realised_budget": 0.0,
    }
    assert ledger.snapshot()["spend"]["requests"] == 4  # totals are not windowed
    assert ledger.snapshot()["spend"]["endpoints"]["device"]["prefill_tokens"] == 100


def test_repeat_booking_of_an_endpoint_counts_one_request(ledger):
    ledger.record("r", "device", 60, 40, 0.0, constrained=True, prompt_tokens=60)
    ledger.record("r", "device", 0, 5, 0.0, constrained=True, prompt_tokens=60)  # late top-up
    spend = ledger.snapshot()["spend"]
    assert spend["requests"] == 1 and spend["window"]["requests"] == 1
    assert spend["endpoints"]["device"]["requests"] == 1
    assert spend["endpoints"]["device"]["decode_tokens"] == 45
    assert spend["window"]["input_tokens"] == 60 and spend["window"]["realised_budget"] == 1.0


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("r", "cloud", -1, 1, 0.0), {}),
        (("r", "cloud", 1, 1.5, 0.0), {}),
        (("r", "cloud", True, 1, 0.0), {}),
        (("r", "cloud", 1, 1, float("nan")), {}),
        (("r", "cloud", 1, 1, -0.1), {}),
        (("r", "cloud", 1, 1, "0.1"), {}),
        (("r", "cloud", 1, 1, 0.0), {"prompt_tokens": -5}),
    ],
)
def test_bad_bookings_refused_and_change_nothing(ledger, args, kwargs):
    with pytest.raises(ValueError):
        ledger.record(*args, constrained=True, **kwargs)
    spend = ledger.snapshot()["spend"]
    assert spend["requests"] == 0 and spend["endpoints"] == {} and spend["window"]["requests"] == 0


def test_snapshot_keys_and_json(ledger):
    snap = ledger.snapshot()
    assert set(snap) == {
        "policy",
        "constrained_side",
        "budget",
        "alpha",
        "exchange_rate",
        "consumption_rate",
        "migration",
        "quality_threshold",
        "prices",
        "settings_source",
        "primary_cloud",
        "known_policies",
        "units",
        "version",
        "spend",
    }
    assert snap["prices"] == {"cloud": {"prefill": 0.15, "decode": 0.6}, "big": {"prefill": 2.5, "decode": 10.0}}
    assert snap["primary_cloud"] == "cloud"
    json.dumps(snap, allow_nan=False)  # plain data only


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        Ledger(None, window=0)


# ------------------------------------------------------------------ wiring into the gateway


def config(tmp_path, **sections):
    from app.config import Settings

    base = {
        "gateway": {"state_file": str(tmp_path / "budget.json"), "policy": "disco", "cloud": "cloud"},
        "clouds": {
            "cloud": {"price": {"prefill_per_million": 1.0, "decode_per_million": 2.0}},
            "spare": {"price": {"prefill_per_million": 3.0, "decode_per_million": 4.0}},
        },
        "disco": {"budget": 0.3, "alpha": 0.1, "exchange_rate": 5.0, "consumption_rate": 4.0, "side": "device"},
    }
    for name, section in sections.items():
        base[name] = {**base[name], **section}
    return Settings(**base)


def test_from_settings_takes_config_defaults_and_state_file(tmp_path):
    ledger = Ledger.from_settings(config(tmp_path))
    s = ledger.settings
    assert (s.policy, s.constrained_side, s.budget, s.alpha, s.exchange_rate, s.consumption_rate) == (
        "disco",
        "device",
        0.3,
        0.1,
        5.0,
        4.0,
    )
    assert dict(s.prices) == {"cloud": Price(1.0, 2.0), "spare": Price(3.0, 4.0)}
    assert ledger.primary_cloud == "cloud"
    ledger.update({"budget": 0.6})
    assert Ledger.from_settings(config(tmp_path)).settings.budget == 0.6  # the state file wins


def test_from_settings_empty_state_file_means_in_memory(tmp_path):
    ledger = Ledger.from_settings(config(tmp_path, gateway={"state_file": ""}))
    assert ledger.state_file is None
    ledger.update({"budget": 0.9})
    assert os.listdir(tmp_path) == []


def test_from_settings_names_the_config_field(tmp_path):
    # Each field is valid alone; the pair contradicts itself (DiSCo-S is for a constrained server). BudgetSettings'
    # rules refuse it as soon as the settings load, naming the config field.
    with pytest.raises(ValueError, match=r"disco\.side: policy 'disco-s' is server-constrained"):
        config(tmp_path, gateway={"policy": "disco-s"})
    with pytest.raises(BudgetValidationError) as info:
        from_config(
            config(tmp_path).model_copy(
                update={"gateway": config(tmp_path).gateway.model_copy(update={"policy": "disco-s"})}
            )
        )
    assert info.value.field == "disco.side"


def test_state_file_path_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Ledger("~/x/budget.json").state_file == tmp_path / "x" / "budget.json"


def test_disco_runtime_reads_the_ledgers_settings(tmp_path):
    ledger = Ledger.from_settings(config(tmp_path))
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B)
    ledger.update({"prices": {"cloud": {"decode": 8.0}}, "migration": False})
    s = disco.settings
    assert s.policy == "disco" and s.constrained_side == "device" and s.budget == 0.3
    assert s.exchange_rate == 5.0 and s.consumption_rate == 4.0 and s.migration is False
    assert disco.cost("cloud").server == TokenPrices.per_million(1.0, 8.0)
    assert disco.cost("spare").server == TokenPrices.per_million(3.0, 4.0)
    assert disco.cost("cloud").lam == usd_per_pflop(5.0)


def test_on_change_listeners(ledger):
    seen = []
    ledger.on_change(lambda: seen.append(ledger.settings.budget))
    ledger.update({"budget": 0.4})
    ledger.update({"budget": 0.4})  # no change, no call
    with pytest.raises(BudgetValidationError):
        ledger.update({"budget": 4})
    assert seen == [0.4]


def test_failing_listener_is_reported_after_commit_and_others_still_run(tmp_path):
    path = tmp_path / "budget.json"
    ledger = Ledger(path, defaults())
    seen = []

    def boom():
        raise RuntimeError("recompute failed")

    ledger.on_change(boom)
    ledger.on_change(lambda: seen.append(ledger.settings.budget))
    with pytest.raises(RuntimeError, match="recompute failed"):
        ledger.update({"budget": 0.2})
    assert seen == [0.2] and ledger.settings.budget == 0.2
    assert Ledger(path, defaults()).settings.budget == 0.2


def test_an_answer_moved_to_another_cloud_is_booked_at_that_clouds_prices() -> None:
    """A request dispatched against "cloud" whose answer migrated to "big" (a fault's third endpoint): the device
    part at the device's energy price, the big cloud's part at the big cloud's prices, not the request cloud's."""
    from app.serving.accounting import Accounting
    from app.serving.job import Attempt, Job
    from app.serving.metrics import Metrics
    from clients.base import GenerationRequest

    ledger = Ledger(None, defaults())
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B)
    job = Job(id="moved", gen=GenerationRequest(prompt_text="hi"), prompt_tokens=100, policy="disco", cloud="cloud")
    device = Attempt("device", "device", 0.0, 100, decode_tokens=10)
    big = Attempt("cloud", "big", 0.0, 110, migration=True, decode_tokens=20)
    job.attempts += [device, big]
    Accounting(disco, ledger, Metrics()).book(job, 30, None)
    expected = disco.cost("big").server_cost(110, 20) + disco.cost("cloud").device_cost(100, 10)
    assert job.cost == pytest.approx(expected)
    assert disco.cost("big").server_cost(110, 20) > 4 * disco.cost("cloud").server_cost(110, 20)  # it matters


def test_a_state_file_that_overrides_the_config_says_so_at_start(tmp_path, caplog):
    path = tmp_path / "budget.json"
    config = BudgetSettings(policy="cloud", budget=0.5, prices={"cloud": Price(0.15, 0.6)})
    Ledger(path, config).update({"policy": "disco", "budget": 0.2})
    with caplog.at_level("WARNING", logger="app.serving.ledger"):
        restarted = Ledger(path, config)
    assert restarted.settings.policy == "disco" and restarted.settings_source == f"state file {path}"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "policy = 'disco' (config: 'server-only')" in warning and "budget = 0.2 (config: 0.5)" in warning
    assert "DELETE /v1/budget" in warning and "--reset-budget" in warning
    restarted.reset()
    assert restarted.settings == config and restarted.settings_source == "config" and not path.exists()
