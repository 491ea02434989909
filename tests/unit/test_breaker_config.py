"""[clouds.x]'s retry and breaker keys: defaults that need no configuration, and bad values named at start-up."""

from __future__ import annotations

import pytest

from app.config import ConfigError, load_settings
from app.serving.gateway import upstream_options
from policies.breaker import BreakerSettings, RetrySettings


def settings_of(tmp_path, cloud: str):
    path = tmp_path / "c.toml"
    path.write_text(f"[clouds.cloud]\nmodel = 'm'\n{cloud}")
    return load_settings(path)


def test_the_defaults_are_the_policies_own(tmp_path):
    options = upstream_options(settings_of(tmp_path, "").clouds["cloud"])
    assert options.retry == RetrySettings() and options.breaker == BreakerSettings()


def test_each_key_reaches_the_client(tmp_path):
    cloud = settings_of(
        tmp_path,
        "retries = 0\nretry_backoff_seconds = 0.5\nretry_budget_seconds = 9\n"
        "failures_to_open = 5\ncooldown_seconds = 2\nmax_cooldown_seconds = 20\n",
    ).clouds["cloud"]
    options = upstream_options(cloud)
    assert (options.retry.retries, options.retry.backoff_seconds, options.retry.budget_seconds) == (0, 0.5, 9)
    assert options.breaker == BreakerSettings(failures_to_open=5, cooldown_seconds=2, max_cooldown_seconds=20)


@pytest.mark.parametrize(
    ("line", "names"),
    [
        ("retries = -1", "clouds.cloud.retries"),
        ("retries = 11", "clouds.cloud.retries"),
        ("retry_budget_seconds = -1", "clouds.cloud.retry_budget_seconds"),
        ("failures_to_open = 0", "clouds.cloud.failures_to_open"),
        ("cooldown_seconds = 0", "clouds.cloud.cooldown_seconds"),
        ("cooldown_seconds = 90", "max_cooldown_seconds"),  # longer than the cap it doubles up to
    ],
)
def test_a_bad_value_is_named(tmp_path, line, names):
    with pytest.raises(ConfigError) as info:
        settings_of(tmp_path, line + "\n")
    assert names in str(info.value)
