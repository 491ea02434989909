"""Each routing policy declared once, and what the declarations say: which policies move answers for cost or
quality, which side a name constrains; and DiSCo's plan for a cloud that shares the device's hardware."""

from __future__ import annotations

import pytest

from app.config import ConfigError, embedded_default, load_settings
from app.serving.budget import BudgetSettings, BudgetValidationError, from_config, pinned_side
from policies.dispatch import (
    DECLARATIONS,
    POLICY_NAMES,
    Disco,
    DispatchPlan,
    StochS,
    canonical_name,
    declaration,
    make_policy,
    unshared,
)


def test_every_name_and_alias_resolves_to_one_declaration():
    keys = [k for d in DECLARATIONS for k in (d.name, *d.aliases)]
    assert len(keys) == len(set(keys)) == len(POLICY_NAMES)
    for d in DECLARATIONS:
        for key in (d.name, *d.aliases, f" {d.name.upper()} "):
            assert declaration(key) is d
            assert canonical_name(key) == d.name
    with pytest.raises(ValueError, match="quality"):
        declaration("best")


def test_only_disco_and_quality_migrate_for_cost():
    moves = {d.name for d in DECLARATIONS if d.cost_migration}
    assert moves == {"disco", "disco-s", "disco-d", "quality"}
    assert {d.name for d in DECLARATIONS if d.quality_migration} == {"quality"}
    # a repeated tool call is a fault wherever a cloud can take over; device-only delivers it
    assert {d.name for d in DECLARATIONS if not d.escapes_loops} == {"device-only"}
    assert all(d.escapes_loops == d.needs_cloud for d in DECLARATIONS)
    for baseline in ("server-only", "cloud", "device-only", "device", "stoch-s", "stoch-d"):
        d = declaration(baseline)
        assert not (d.cost_migration or d.quality_migration or d.by_disco), baseline


def test_the_declared_side_is_what_the_budget_enforces():
    assert {d.name: d.side for d in DECLARATIONS if d.side} == {
        "disco-s": "server",
        "disco-d": "device",
        "stoch-s": "server",
        "stoch-d": "device",
    }
    assert pinned_side("stoch-s", "auto") == "server"
    assert pinned_side("quality", "device") == "device"
    assert pinned_side("quality", "auto") is None
    with pytest.raises(BudgetValidationError) as err:
        BudgetSettings(policy="disco-d", constrained_side="server")
    assert err.value.field == "constrained_side"


def test_a_policy_makes_its_declared_dispatcher():
    assert isinstance(make_policy("quality"), Disco)
    assert isinstance(make_policy("Stoch-S"), StochS)
    assert not declaration("device").needs_cloud and declaration("quality").needs_cloud


def test_the_quality_threshold_is_a_validated_knob():
    assert BudgetSettings(quality_threshold=0).quality_threshold == 0.0
    assert BudgetSettings(quality_threshold=1).to_dict()["quality_threshold"] == 1.0
    for bad in (-0.1, 1.5, "0.5", True, None):
        with pytest.raises(BudgetValidationError) as err:
            BudgetSettings(quality_threshold=bad)
        assert err.value.field == "quality_threshold"


# --- a co-located cloud: never both endpoints at once -----------------------------------------------------------

RACE = DispatchPlan(True, True, 0.0, "disco-s", "race")
HEDGE = DispatchPlan(True, True, 0.4, "disco-d", "wait")


def test_a_co_located_race_keeps_the_endpoint_predicted_first():
    device_first = unshared(RACE, device_ttft=0.8, cloud_ttft=1.7)
    assert (device_first.start_device, device_first.start_cloud, device_first.device_delay) == (True, False, None)
    cloud_first = unshared(RACE, device_ttft=2.0, cloud_ttft=0.3)
    assert (cloud_first.start_device, cloud_first.start_cloud) == (False, True)
    assert "co-located" in cloud_first.reason and cloud_first.policy == "disco-s"


def test_an_unmeasured_co_located_cloud_leaves_the_race_to_the_device():
    plan = unshared(RACE, device_ttft=5.0, cloud_ttft=None)
    assert plan.start_device and not plan.start_cloud


def test_a_co_located_delayed_start_runs_the_cloud_alone():
    plan = unshared(HEDGE, device_ttft=0.1, cloud_ttft=3.0)
    assert plan.start_cloud and not plan.start_device


def test_single_endpoint_plans_are_untouched():
    for plan in (DispatchPlan(True, False, None, "p", "r"), DispatchPlan(False, True, None, "p", "r")):
        assert unshared(plan, device_ttft=1.0, cloud_ttft=0.1) is plan


# --- the config ---------------------------------------------------------------------------------------------------


def test_an_embedded_cloud_is_co_located_by_construction_and_a_declared_one_too(tmp_path):
    settings = load_settings(embedded_default())
    assert {n: c.shares_device for n, c in settings.clouds.items()} == {"cloud": True, "hat": True}
    path = tmp_path / "c.toml"
    path.write_text(
        '[clouds.cloud]\nbase_url = "http://10.0.0.2:8001/v1"\n'
        '[clouds.box]\nbase_url = "http://127.0.0.1:9000/v1"\nco_located = true\n'
        '[clouds.here]\nbase_url = "http://127.0.0.1:8001/v1"\nco_located = false\n[clouds.here.embedded]\nport = 0\n'
    )
    settings = load_settings(path)
    assert {n: c.shares_device for n, c in settings.clouds.items()} == {"cloud": False, "box": True, "here": False}


def test_a_bad_quality_threshold_in_the_config_names_its_field(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[disco]\nquality_threshold = 1.5\n[clouds.cloud]\n")
    with pytest.raises(ConfigError, match=r"disco\.quality_threshold"):
        load_settings(path)
    path.write_text('[gateway]\npolicy = "quality"\n[disco]\nquality_threshold = 0.3\n[clouds.cloud]\n')
    assert from_config(load_settings(path)).quality_threshold == 0.3
