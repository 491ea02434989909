"""Bad configuration fails at start-up with a message naming the field."""

from __future__ import annotations

import os
import sys

import pydantic
import pytest

from app.config import ConfigError, embedded_default, load_settings


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
        ("[device]\nstall_timeout = 0", "device.stall_timeout"),
        ("[clouds.c]\nstall_timeout = -1", "clouds.c.stall_timeout"),
        ("[gateway]\ncloud = 'nope'\n[clouds.c]\nmodel = 'm'", "gateway.cloud"),
        ("[clouds.h]\nkind = 'hat'\ndraft_length = 'eq8'", "clouds.h.draft_length"),
        ("[clouds.h]\nkind = 'hat'\nmax_draft = 0", "clouds.h.max_draft"),
        ("[clouds.h]\nkind = 'hat'\nlink = 'latency=fast'", "clouds.h.link"),  # parsed at load (HATOptions' rule)
        ("[clouds.h]\nkind = 'hat'\ntree_width = 2", "clouds.h.tree_width"),
        ("[clouds.h]\nkind = 'hat'\nworker_url = 'ftp://x'", "clouds.h.worker_url"),
        ("[clouds.h]\nkind = 'hat'\nchunk_size = 0", "clouds.h.chunk_size"),
        ("[clouds.h]\nkind = 'hat'\narca = true", "clouds.h"),  # ARCA's choice is read from a profile
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


def test_a_hat_clouds_settings_are_its_backends_options(tmp_path):
    """No hand copy: a HAT cloud's settings are HATOptions (the device half's knobs, with their defaults and rules),
    handed to the backend as they are; it reads every knob from them, device-only ones included."""
    from clients.hat.device import HATBackend
    from clients.hat.link import LinkProfile
    from clients.hat.options import HATOptions

    text = (
        "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'\nworker_url = 'http://gpu-box:8100/'\n"
        "auth_token = 's3cret-tok'\neta = 0.5\nmax_draft = 5\nlink = 'latency=5ms,up=1MB/s'\n"
        "round_timeout = 7.5\nchunk_size = 32\n"
    )
    cloud = load_settings(write(tmp_path, text)).clouds["h"]
    assert isinstance(cloud, HATOptions)
    assert cloud.link == LinkProfile.parse("latency=5ms,up=1MB/s") and cloud.link.latency == 0.005
    assert "s3cret-tok" not in repr(cloud)
    backend = HATBackend(cloud, name="h", model=object(), tokenizer=object())
    assert backend.options is cloud and backend.pool.workers[0].address.http_base == "http://gpu-box:8100"
    link = backend.link_options
    assert (link.name, link.auth_token, link.profile, link.round_timeout) == ("h", "s3cret-tok", cloud.link, 7.5)
    assert (backend.rule.eta, backend.rule.max_draft) == (0.5, 5)
    assert backend.link_model.up.value == 1e6  # the emulated link's bandwidth is the first estimate
    defaults = load_settings(write(tmp_path, "[gateway]\ncloud = 'h'\n[clouds.h]\nkind = 'hat'")).clouds["h"]
    assert defaults.model_dump(include=set(HATOptions.model_fields)) == HATOptions().model_dump()


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


def test_the_fleet_profile_configures_a_replica_and_its_workers_in_one_file(worker_env):
    """deploy/fleet.toml (README, 'Several gateways, one store'): the gateway reads its tables and leaves [worker]
    to `tandem worker`, which reads only that one."""
    from pathlib import Path

    from app.config import load_worker_settings

    profile = Path(embedded_default()).with_name("fleet.toml")
    s = load_settings(profile)
    assert (s.state.backend, s.clouds["hat"].worker_registry) == ("valkey", s.state.url)
    worker = load_worker_settings(profile, {})
    assert (worker.registry_url, worker.registry_prefix) == (s.state.url, s.clouds["hat"].worker_registry_prefix)
    assert worker.model == s.clouds["hat"].model and worker.drain_timeout == 30


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


# --- the worker's settings (`tandem worker`): file, environment, flags --------------------------------------------


@pytest.fixture
def worker_env(monkeypatch):
    """No TANDEM_WORKER* variable from the shell running the tests; the test sets its own."""
    for name in [n for n in os.environ if n.startswith("TANDEM_WORKER")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_environment_variables_reach_the_worker_settings(worker_env):
    from app.config import load_worker_settings

    worker_env.setenv("TANDEM_WORKER__MAX_SESSIONS", "32")
    worker_env.setenv("TANDEM_WORKER__BATCHING", "greedy")
    worker_env.setenv("TANDEM_WORKER__STAGES", "2")
    worker_env.setenv("TANDEM_WORKER__STAGE_THREADS", "[2, 1]")
    worker_env.setenv("TANDEM_WORKER__PREFILL_PROFILE", "false")
    s = load_worker_settings()
    assert (s.max_sessions, s.batching, s.stages, s.stage_threads, s.prefill_profile) == (
        32,
        "greedy",
        2,
        [2, 1],
        False,
    )
    worker_env.setenv("TANDEM_GATEWAY__PORT", "9000")  # the gateway's variables are not the worker's business
    assert load_worker_settings().port == 8100


def test_a_flag_beats_the_environment_which_beats_the_file(tmp_path, worker_env):
    from app.config import load_worker_settings

    path = write(tmp_path, "[worker]\nmax_sessions = 4\nm = 3\nport = 9001\n[gateway]\nport = 1")
    worker_env.setenv("TANDEM_WORKER__M", "5")
    worker_env.setenv("TANDEM_WORKER__PORT", "9002")
    s = load_worker_settings(path, {"port": 9003, "host": None})
    assert (s.max_sessions, s.m, s.port, s.host) == (4, 5, 9003, "127.0.0.1")
    # Validated once, merged: a flag may make valid what the environment alone is not.
    worker_env.setenv("TANDEM_WORKER__STAGE_THREADS", "[1, 1]")
    assert load_worker_settings(path, {"stages": 2}).stage_threads == [1, 1]


def test_tandem_worker_reads_the_flags_over_the_environment(tmp_path, worker_env):
    import app.worker.server
    from app.cli import main

    started = []
    worker_env.setattr(app.worker.server, "serve_worker", started.append)
    worker_env.setenv("TANDEM_WORKER__PORT", "9002")
    worker_env.setenv("TANDEM_WORKER__MAX_CONTEXT", "1024")
    assert main(["worker", "--config", str(write(tmp_path, "[worker]\nport = 9001\nm = 3"))]) == 0
    assert main(["worker", "--config", str(tmp_path / "c.toml"), "--port", "9003", "--stage-threads", "2"]) == 0
    assert [(s.port, s.m, s.max_context, s.stage_threads) for s in started] == [
        (9002, 3, 1024, None),
        (9003, 3, 1024, [2]),
    ]


@pytest.mark.parametrize(
    ("toml", "env", "flags", "names"),
    [
        ("[worker]\nmax_sessions = 0", {}, {}, "worker.max_sessions"),
        ("[worker]\nmax_sesions = 3", {}, {}, "worker.max_sesions"),  # a typo is refused, not ignored
        ("", {"TANDEM_WORKER__BATCHING": "eager"}, {}, "worker.batching"),
        ("", {"TANDEM_WORKER__MAX_CONTEXT": "lots"}, {}, "worker.max_context"),
        ("", {}, {"stage_threads": ["2", "x"]}, "worker.stage_threads.1"),
        ("[worker]\nstages = 2\nstage_threads = [1]", {}, {}, "worker: stage_threads needs one value per stage"),
        ("worker = 3", {}, {}, "worker: must be a table"),
    ],
)
def test_a_bad_worker_value_is_named(tmp_path, worker_env, toml, env, flags, names):
    from app.config import load_worker_settings

    for name, value in env.items():
        worker_env.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_worker_settings(write(tmp_path, toml), flags)
    assert names in str(info.value)


def test_tandem_worker_names_a_bad_value_and_exits_2(tmp_path, worker_env, capsys):
    from app.cli import main

    assert main(["worker", "--config", str(write(tmp_path, "[worker]\nm = 0"))]) == 2
    assert "worker.m" in capsys.readouterr().err
    assert main(["worker", "--device", "tpu"]) == 2
    assert "worker.device" in capsys.readouterr().err
    assert main(["worker", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("variable", ["TANDEM_WORKER__AUTH_TOKEN", "TANDEM_WORKER_AUTH_TOKEN"])
def test_the_worker_token_comes_from_either_variable(tmp_path, worker_env, variable):
    from app.config import load_worker_settings

    assert load_worker_settings().auth_token is None
    worker_env.setenv(variable, "tok-5c1e")
    s = load_worker_settings(write(tmp_path, "[worker]\nauth_token = 'from-the-file'"))
    assert s.auth_token is not None and s.auth_token.get_secret_value() == "tok-5c1e"
    assert "tok-5c1e" not in repr(s)


def test_two_different_worker_tokens_are_refused_without_showing_them(worker_env):
    from app.config import load_worker_settings

    worker_env.setenv("TANDEM_WORKER__AUTH_TOKEN", "tok-one")
    worker_env.setenv("TANDEM_WORKER_AUTH_TOKEN", "tok-one")
    assert load_worker_settings().auth_token.get_secret_value() == "tok-one"  # the same token twice is one token
    worker_env.setenv("TANDEM_WORKER_AUTH_TOKEN", "tok-two")
    with pytest.raises(ConfigError) as info:
        load_worker_settings()
    assert "worker.auth_token" in str(info.value)
    assert "tok-one" not in str(info.value) and "tok-two" not in str(info.value)


def test_the_embedded_worker_gets_the_gateways_token_only(worker_env):
    from app.config import EmbeddedWorkerSettings
    from app.embedded import EmbeddedWorker

    worker_env.setenv("TANDEM_WORKER_AUTH_TOKEN", "some-other-workers")
    worker_env.setenv("TANDEM_WORKER__AUTH_TOKEN", "some-other-workers")
    worker_env.setenv("TANDEM_WORKER__MAX_SESSIONS", "8")
    env = EmbeddedWorker(EmbeddedWorkerSettings(), "m", 2, "gateways-token").environment()
    assert env["TANDEM_WORKER__AUTH_TOKEN"] == "gateways-token" and "TANDEM_WORKER_AUTH_TOKEN" not in env
    assert env["TANDEM_WORKER__MAX_SESSIONS"] == "8"
    unlocked = EmbeddedWorker(EmbeddedWorkerSettings(), "m", 2, None).environment()
    assert not any(name in unlocked for name in ("TANDEM_WORKER__AUTH_TOKEN", "TANDEM_WORKER_AUTH_TOKEN"))


def test_each_engine_knob_has_one_default():
    """The worker's section inherits the engine's knobs; the batch planner takes them as arguments."""
    import inspect

    from app.worker.settings import EngineLimits, WorkerSettings
    from policies.worker_batching import subchunk_tokens

    for name, field in EngineLimits.model_fields.items():
        inherited = WorkerSettings.model_fields[name]
        assert (inherited.annotation, inherited.default, inherited.metadata) == (
            field.annotation,
            field.default,
            field.metadata,
        ), name
    engine_knobs = WorkerSettings().model_dump(include=set(EngineLimits.model_fields))
    assert EngineLimits(**engine_knobs) == EngineLimits()
    planner = inspect.signature(subchunk_tokens).parameters
    assert all(planner[p].default is inspect.Parameter.empty for p in ("overhead", "min_tokens", "max_tokens"))


def test_a_provider_preset_fills_what_the_entry_leaves_out():
    from app.config import Settings

    s = Settings(clouds={"m": {"provider": "mistral", "model": "mistral-small-latest"}}, gateway={"cloud": "m"})
    m = s.clouds["m"]
    assert (m.base_url, m.continuation, m.stream_usage) == ("https://api.mistral.ai/v1", "prefix-flag", False)
    own = Settings(
        clouds={
            "v": {
                "provider": "vllm",
                "model": "x",
                "base_url": "http://gpu:9000/v1",
                "continuation": "completions",
                "tokenizer": "device",
            }
        },
        gateway={"cloud": "v"},
    ).clouds["v"]
    assert (own.base_url, own.continuation) == ("http://gpu:9000/v1", "completions")  # the entry's own fields win
    deepseek = Settings(clouds={"d": {"provider": "deepseek", "model": "deepseek-chat"}}, gateway={"cloud": "d"})
    assert deepseek.clouds["d"].structured_output == "json_object"  # its JSON mode knows no schema


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"continuation": "completions"}, "template"),  # another tokenizer: its template is needed
        ({"continuation": "prefill", "template": "x.gguf"}, "template is read only"),
        ({"token_id_prompts": True}, "token_id_prompts"),
        ({"provider": "nobody"}, "provider"),
    ],
)
def test_dialect_settings_that_contradict_each_other_fail_naming_the_field(table, named):
    from app.config import Settings

    with pytest.raises(pydantic.ValidationError) as err:
        Settings(clouds={"c": {"model": "m", **table}}, gateway={"cloud": "c"})
    assert named in str(err.value)
