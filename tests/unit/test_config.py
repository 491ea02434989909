"""Bad configuration fails at start-up with a message naming the field."""

from __future__ import annotations

import sys

import pytest

from app.cli import embedded_default
from app.config import ConfigError, load_settings


def write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_embedded_default_is_valid():
    s = load_settings(embedded_default())
    assert s.device.model == "qwen2.5-coder-0.5b-instruct"
    assert s.clouds["cloud"].embedded is not None
    assert s.gateway.port == 8000


@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ("[gateway]\nport = 70000", "gateway.port"),
        ("[gateway]\npolicy = 'psychic'", "gateway.policy"),
        ("[device]\nn_ctx = -1", "device.n_ctx"),
        ("[device]\nkind = 'onnx'", "device.kind"),
        ("[gateway]\nprot = 1", "gateway.prot"),
        ("[clouds.c]\nbase_url = 'ftp://x'", "clouds.c.base_url"),
        ("[clouds.c]\ntokenizer = 'tiktoken'\ncontinuation = 'completions'", "clouds.c"),
        (
            "[clouds.c]\ntokenizer = 'device'\ncontinuation = 'completions'\nstructured_output = 'native'",
            "clouds.c",
        ),
        ("[clouds.c]\nstructured_output = 'grammar'", "clouds.c.structured_output"),
        ("[gateway]\ncloud = 'nope'\n[clouds.c]\nmodel = 'm'", "gateway.cloud"),
        ("[clouds.h]\nkind = 'hat'\ndraft_length = 'eq8'", "clouds.h.draft_length"),
        ("[clouds.h]\nkind = 'hat'\nmax_draft = 0", "clouds.h.max_draft"),
        ("[disco]\nbudget = 1.5", "disco.budget"),  # the budget knobs' rules: BudgetSettings', checked at load
        ("[disco]\nside = 'moon'", "disco.side"),
        ("[gateway]\npolicy = 'disco-s'\n[disco]\nside = 'device'", "disco.side"),
    ],
)
def test_bad_field_is_named(tmp_path, toml, names):
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml))
    assert names in str(info.value)


def test_env_overrides_file(tmp_path, monkeypatch):
    path = write(tmp_path, "[gateway]\nport = 9000\npolicy = 'device'\n[clouds.cloud]\nmodel = 'm'")
    monkeypatch.setenv("TANDEM_GATEWAY__POLICY", "cloud")
    monkeypatch.setenv("TANDEM_CLOUDS__CLOUD__API_KEY", "sk-secret")
    s = load_settings(path)
    assert s.gateway.policy == "cloud"
    assert s.gateway.port == 9000
    assert s.clouds["cloud"].api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(s)  # secrets never end up in logs through repr


def test_bad_env_value_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_GATEWAY__PORT", "eighty")
    with pytest.raises(ConfigError, match=r"gateway\.port"):
        load_settings(write(tmp_path, ""))


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(write(tmp_path, "[gateway\n"))


def test_hat_draft_length_settings(tmp_path):
    s = load_settings(
        write(tmp_path, "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'\ndraft_length = 'eq7+eta'\nmax_draft = 12")
    )
    assert (s.clouds["h"].draft_length, s.clouds["h"].max_draft) == ("eq7+eta", 12)
    s = load_settings(write(tmp_path, "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'"))
    assert (s.clouds["h"].draft_length, s.clouds["h"].max_draft) == ("eta", 8)


def test_hat_profile_setting_reaches_the_embedded_worker(tmp_path):
    from app.embedded import EmbeddedWorker

    text = "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'\nprofile = 'var/p.json'\n[clouds.h.embedded]\nport = 0"
    cloud = load_settings(write(tmp_path, text)).clouds["h"]
    assert cloud.profile == "var/p.json"
    worker = EmbeddedWorker(cloud.embedded, cloud.model, cloud.m, None, profile=cloud.profile)
    cmd = worker.command()
    assert cmd[cmd.index("--profile") + 1] == "var/p.json"
    assert "--profile" not in EmbeddedWorker(cloud.embedded, cloud.model, cloud.m, None).command()
    assert load_settings(write(tmp_path, "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'")).clouds["h"].profile == ""


@pytest.mark.parametrize(("setting", "flag"), [("true", "--prefill-profile"), ("false", "--no-prefill-profile")])
def test_prefill_profile_setting_reaches_the_embedded_worker(tmp_path, monkeypatch, setting, flag):
    import app.worker.server
    from app.cli import main
    from app.config import EmbeddedWorkerSettings
    from app.embedded import EmbeddedWorker

    text = f"[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'\n[clouds.h.embedded]\nprefill_profile = {setting}"
    cloud = load_settings(write(tmp_path, text)).clouds["h"]
    cmd = EmbeddedWorker(cloud.embedded, cloud.model, cloud.m, None).command()
    assert flag in cmd and cmd[:3] == [sys.executable, "-m", "app.cli"]
    started = []
    monkeypatch.setattr(app.worker.server, "serve_worker", started.append)
    assert main(cmd[3:]) == 0  # the worker's own command line, parsed as `tandem worker` parses it
    assert started[0].prefill_profile is (setting == "true")
    unset = EmbeddedWorker(EmbeddedWorkerSettings(), cloud.model, cloud.m, None).command()
    assert not any("prefill-profile" in arg for arg in unset)  # the worker's default: staged workers only


def test_the_remote_cloud_example_loads_with_the_users_url_key_and_model(monkeypatch):
    """README's real-provider command: deploy/remote-cloud.toml plus three environment variables."""
    from pathlib import Path

    example = Path(embedded_default()).with_name("remote-cloud.toml")
    with pytest.raises(ConfigError) as info:
        load_settings(example)  # nothing filled in: refused, naming what is missing
    assert "clouds.cloud.base_url" in str(info.value) and "clouds.cloud.model" in str(info.value)
    monkeypatch.setenv("TANDEM_CLOUDS__CLOUD__BASE_URL", "https://provider.test/v1")
    monkeypatch.setenv("TANDEM_CLOUDS__CLOUD__API_KEY", "sk-user")
    monkeypatch.setenv("TANDEM_CLOUDS__CLOUD__MODEL", "provider-model-7b")
    cloud = load_settings(example).clouds["cloud"]
    assert (cloud.base_url, cloud.model, cloud.api_key.get_secret_value()) == (
        "https://provider.test/v1",
        "provider-model-7b",
        "sk-user",
    )
    assert (cloud.tokenizer, cloud.continuation) == ("tiktoken", "chat")


def test_an_embedded_worker_and_a_worker_url_are_refused_together(tmp_path):
    hat = "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'\n"
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, hat + "worker_url = 'ws://gpu-box:8100'\n[clouds.h.embedded]\nport = 0"))
    assert "clouds.h" in str(info.value) and "contradict" in str(info.value)
    assert load_settings(write(tmp_path, hat + "worker_url = 'ws://gpu-box:8100'")).clouds["h"].embedded is None
    assert load_settings(write(tmp_path, hat + "[clouds.h.embedded]\nport = 0")).clouds["h"].embedded is not None


def test_max_defer_is_a_worker_setting():
    from app.worker.settings import EngineLimits, WorkerSettings

    assert isinstance(WorkerSettings(), EngineLimits)  # the engine takes the worker's section as its limits
    assert WorkerSettings(max_defer=1).max_defer == 1
    assert WorkerSettings().max_defer == 0
