"""Privacy levels: what each allows, and how the gateway's, the key's and the request's levels combine."""

from __future__ import annotations

import pytest

from policies.privacy import LEVELS, allows, effective_level


@pytest.mark.parametrize(
    ("level", "allowed"),
    [("device", {"device"}), ("split", {"device", "split"}), ("any", {"device", "split", "cloud"})],
)
def test_a_level_allows_localities_up_to_its_own(level, allowed):
    assert {loc for loc in ("device", "split", "cloud") if allows(level, loc)} == allowed


@pytest.mark.parametrize(
    ("gateway", "key", "requested", "expected"),
    [
        ("any", None, None, "any"),
        ("split", None, None, "split"),
        ("split", None, "any", "any"),  # the gateway's level is a default a request may change
        ("any", "device", None, "device"),
        ("any", "device", "any", "device"),  # a key's level is a floor: a request cannot loosen it
        ("any", "split", "device", "device"),  # ... but can tighten it
        ("device", "any", None, "any"),  # a key's own level replaces the gateway default
    ],
)
def test_effective_level(gateway, key, requested, expected):
    assert effective_level(gateway, key, requested) == expected
    assert expected in LEVELS
