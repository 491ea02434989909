"""GET/PUT /v1/budget on a minimal app: round trip, the error envelope, admin auth, persistence.

Why a serving core without backends: the router only needs the core's ledger and budget snapshot (the ledger and
DiSCo's runtime: pure logic) and the keys of endpoints/api_options.py's ApiOptions, so the tests pin that contract
without loading models.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

import endpoints.auth as auth_mod
import endpoints.budget as budget
from app.config import ApiKeySettings, key_limits
from app.serving.budget import BudgetSettings, Price
from app.serving.core import CoreOptions, ServingCore
from app.serving.disco import DiscoRuntime
from app.serving.ledger import Ledger
from app.serving.state import MemoryStore
from endpoints.api_options import ApiOptions
from endpoints.errors import install_error_handlers
from policies.cost import QWEN2_5_0_5B

ADMIN = "adm-secret-1"


def make_app(ledger: Ledger, *, admin_keys=(), api_keys=(), state=None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(budget.router)
    keys = tuple(k if isinstance(k, ApiKeySettings) else SecretStr(k) for k in api_keys)
    app.state.api_options = ApiOptions(
        api_keys=keys, key_limits=tuple(map(key_limits, keys)), admin_keys=tuple(SecretStr(k) for k in admin_keys)
    )
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B)
    options = CoreOptions("tandem", 256, "any", "sequential")
    app.state.serving = ServingCore(
        options, None, {}, None, ledger, disco, None, None, created=0, state=state or MemoryStore(ledger)
    )
    return app


def new_ledger(path=None) -> Ledger:
    return Ledger(path, BudgetSettings(policy="disco", budget=0.5, prices={"cloud": Price(0.15, 0.6)}))


@pytest.fixture
def client() -> TestClient:
    return TestClient(make_app(new_ledger()))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_envelope(resp, status: int, param: str | None, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code
    return err


def test_get_returns_snapshot(client):
    resp = client.get("/v1/budget")
    assert resp.status_code == 200
    body = resp.json()
    assert body["policy"] == "disco" and body["budget"] == 0.5
    assert body["prices"] == {"cloud": {"prefill": 0.15, "decode": 0.6}}
    assert body["spend"]["window"]["size"] == 1000


def test_get_shows_booked_spend():
    ledger = new_ledger()
    ledger.update({"constrained_side": "server"})
    ledger.record("r1", "cloud", 100, 7, 0.0000192, constrained=True, prompt_tokens=100)
    body = TestClient(make_app(ledger)).get("/v1/budget").json()
    assert body["spend"]["endpoints"]["cloud"]["decode_tokens"] == 7
    assert body["spend"]["window"]["realised_budget"] == 1.0
    assert body["effective_side"] == "server"


def test_put_partial_update_round_trip(client):
    resp = client.put("/v1/budget", json={"budget": 0.2, "prices": {"cloud": {"decode": 0.8}}})
    assert resp.status_code == 200
    assert resp.json()["budget"] == 0.2
    got = client.get("/v1/budget").json()
    assert got["budget"] == 0.2 and got["alpha"] == 0.05 and got["policy"] == "disco"
    assert got["prices"]["cloud"] == {"prefill": 0.15, "decode": 0.8}
    assert got["version"] == 1


def test_put_alias_policy_stored_canonical(client):
    assert client.put("/v1/budget", json={"policy": "cloud"}).json()["policy"] == "server-only"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"budget": 1.5}, "budget"),
        ({"budget": -1}, "budget"),
        ({"alpha": 0}, "alpha"),
        ({"alpha": 2}, "alpha"),
        ({"exchange_rate": -0.3}, "exchange_rate"),
        ({"consumption_rate": 0}, "consumption_rate"),
        ({"policy": "psychic"}, "policy"),
        ({"constrained_side": "left"}, "constrained_side"),
        ({"buget": 0.1}, "buget"),
        ({"prices": {"other": {"prefill": 1, "decode": 1}}}, "prices.other"),
        ({"prices": {"cloud": {"decode": -2}}}, "prices.cloud.decode"),
    ],
)
def test_bad_field_is_400_naming_it(client, body, param):
    err = assert_envelope(client.put("/v1/budget", json=body), 400, param, "invalid_value")
    assert err["type"] == "invalid_request_error"
    assert param.split(".")[-1] in err["message"]
    assert client.get("/v1/budget").json()["version"] == 0  # nothing changed


def test_unknown_policy_message_lists_known(client):
    err = assert_envelope(client.put("/v1/budget", json={"policy": "psychic"}), 400, "policy", "invalid_value")
    assert "disco-s" in err["message"] and "stoch-d" in err["message"]


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"{bad json", "invalid_json"),
        (b'{"budget": NaN}', "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b"", "invalid_request"),
        (b"[1, 2]", "invalid_request"),
        (b'"budget"', "invalid_request"),
        (b"null", "invalid_request"),
        (b"0.5", "invalid_request"),
    ],
)
def test_malformed_or_non_object_body_is_400(client, content, code):
    resp = client.put("/v1/budget", content=content, headers={"Content-Type": "application/json"})
    err = assert_envelope(resp, 400, None, code)
    assert err["type"] == "invalid_request_error"


def test_state_write_failure_is_500_and_changes_nothing(tmp_path, monkeypatch):
    ledger = new_ledger(tmp_path / "budget.json")
    client = TestClient(make_app(ledger))

    def crash(src, dst):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr("app.serving.ledger.os.replace", crash)
    resp = client.put("/v1/budget", json={"budget": 0.9})
    err = assert_envelope(resp, 500, None, "state_write_failed")
    assert "not changed" in err["message"]
    monkeypatch.undo()
    assert client.get("/v1/budget").json()["budget"] == 0.5


def test_listener_failure_is_500_saying_it_was_saved():
    ledger = new_ledger()

    def boom():
        raise RuntimeError("recompute failed")

    ledger.on_change(boom)
    client = TestClient(make_app(ledger))
    resp = client.put("/v1/budget", json={"budget": 0.4})
    err = assert_envelope(resp, 500, None, "apply_failed")
    assert "saved" in err["message"] and "recompute failed" in err["message"]
    assert resp.headers["x-should-retry"] == "false"
    assert client.get("/v1/budget").json()["budget"] == 0.4


# ------------------------------------------------------------------ auth


@pytest.mark.parametrize("method", ["get", "put", "delete"])
def test_admin_key_required_when_configured(method):
    client = TestClient(make_app(new_ledger(), admin_keys=["other-admin", ADMIN], api_keys=["user-key"]))
    kwargs = {"json": {"budget": 0.3}} if method == "put" else {}
    call = getattr(client, method)
    err = assert_envelope(call("/v1/budget", **kwargs), 401, None, "invalid_api_key")
    assert err["type"] == "authentication_error" and "Missing admin key" in err["message"]
    assert_envelope(call("/v1/budget", headers=auth("wrong"), **kwargs), 401, None, "invalid_api_key")
    # an ordinary API key must not be able to change the budget it spends against (nor read it, with admin keys)
    if method == "get":
        assert_envelope(call("/v1/budget", headers=auth("user-key")), 401, None, "invalid_api_key")
    else:
        err = assert_envelope(call("/v1/budget", headers=auth("user-key"), **kwargs), 403, None, "admin_key_required")
        assert err["type"] == "permission_error" and "needs an admin key" in err["message"]
    assert_envelope(call("/v1/budget", headers={"Authorization": ADMIN}, **kwargs), 401, None, "invalid_api_key")
    assert call("/v1/budget", headers=auth(ADMIN), **kwargs).status_code == 200
    assert call("/v1/budget", headers=auth("other-admin"), **kwargs).status_code == 200


def test_auth_runs_before_the_body_is_judged():
    client = TestClient(make_app(new_ledger(), admin_keys=[ADMIN]))
    resp = client.put("/v1/budget", content=b"{bad", headers={"Content-Type": "application/json"})
    assert_envelope(resp, 401, None, "invalid_api_key")


def test_api_keys_read_but_never_change_the_budget_without_admin_keys():
    client = TestClient(make_app(new_ledger(), api_keys=["user-key"]))
    err = assert_envelope(client.get("/v1/budget"), 401, None, "invalid_api_key")
    assert "API key" in err["message"]
    assert_envelope(client.get("/v1/budget", headers=auth("nope")), 401, None, "invalid_api_key")
    assert client.get("/v1/budget", headers=auth("user-key")).status_code == 200
    # Changing it needs an admin key whenever the gateway has keys: there is none here, and the error says so.
    err = assert_envelope(client.put("/v1/budget", json={"budget": 1.0}), 401, None, "invalid_api_key")
    assert "Missing admin key" in err["message"]
    for call in (client.put, client.delete):
        kwargs = {"json": {"budget": 1.0}} if call == client.put else {}
        err = assert_envelope(call("/v1/budget", headers=auth("user-key"), **kwargs), 403, None, "admin_key_required")
        assert "gateway.admin_keys" in err["message"]
    assert client.get("/v1/budget", headers=auth("user-key")).json()["budget"] == 0.5  # nothing changed


def test_open_without_any_keys(client):
    assert client.get("/v1/budget").status_code == 200
    assert client.put("/v1/budget", json={"budget": 0.1}).status_code == 200


def test_every_key_is_compared_in_constant_time(monkeypatch):
    """Every configured key goes through hmac.compare_digest, even after a match."""
    calls = []
    real = auth_mod.hmac.compare_digest

    def spy(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", spy)
    client = TestClient(make_app(new_ledger(), admin_keys=[ADMIN, "k2", "k3"]))
    assert client.get("/v1/budget", headers=auth(ADMIN)).status_code == 200
    assert calls == [ADMIN.encode(), b"k2", b"k3"]
    calls.clear()
    assert client.get("/v1/budget", headers=auth("x")).status_code == 401
    assert len(calls) == 3


# ------------------------------------------------------------------ persistence


def test_settings_survive_recreating_the_app(tmp_path):
    path = tmp_path / "budget.json"
    first = TestClient(make_app(new_ledger(path), admin_keys=[ADMIN]))
    resp = first.put("/v1/budget", json={"budget": 0.15, "policy": "disco-d", "exchange_rate": 5}, headers=auth(ADMIN))
    assert resp.status_code == 200
    second = TestClient(make_app(new_ledger(path), admin_keys=[ADMIN]))
    got = second.get("/v1/budget", headers=auth(ADMIN)).json()
    assert (got["budget"], got["policy"], got["exchange_rate"]) == (0.15, "disco-d", 5.0)
    assert got["effective_side"] == "device"


def test_delete_goes_back_to_the_config_and_forgets_the_state_file(tmp_path):
    path = tmp_path / "budget.json"
    client = TestClient(make_app(new_ledger(path), admin_keys=[ADMIN]))
    assert client.get("/v1/budget", headers=auth(ADMIN)).json()["settings_source"] == "config"
    changed = client.put("/v1/budget", json={"budget": 0.9, "policy": "cloud"}, headers=auth(ADMIN)).json()
    assert changed["settings_source"] == f"state file {path}" and path.exists()
    restarted = TestClient(make_app(new_ledger(path), admin_keys=[ADMIN]))
    assert restarted.get("/v1/budget", headers=auth(ADMIN)).json()["settings_source"] == f"state file {path}"
    reset = restarted.delete("/v1/budget", headers=auth(ADMIN)).json()
    assert (reset["budget"], reset["policy"], reset["settings_source"]) == (0.5, "disco", "config")
    assert not path.exists()
    assert TestClient(make_app(new_ledger(path))).get("/v1/budget").json()["budget"] == 0.5  # after a restart too


async def test_works_over_httpx_asgi_transport():
    import httpx

    app = make_app(new_ledger())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as ac:
        assert (await ac.put("/v1/budget", json={"alpha": 0.1})).json()["alpha"] == 0.1
        assert (await ac.get("/v1/budget")).json()["alpha"] == 0.1


def _spent(store: MemoryStore, key, request_id: str, usd: float, tokens: int) -> None:
    """What the core does when a request under `key` ends: its admission settled with what it cost."""
    import asyncio
    import time

    from app.serving.limits import UNLIMITED, Admission, to_micro

    admission = Admission(request_id, key, 0, UNLIMITED, time.time(), shared=False)
    admission.add(usd, tokens)
    assert admission.spent_micro == to_micro(usd)
    asyncio.run(store.settle(admission))


def test_spend_per_key_by_name_to_an_admin_key_and_only_its_own_to_an_api_key():
    plain, team = "plain-user-secret", ApiKeySettings(key=SecretStr("team-secret"), name="team-b", cap_usd=2.0)
    for admin_keys in ((ADMIN,), ()):
        ledger = new_ledger()
        store = MemoryStore(ledger)
        app = make_app(ledger, admin_keys=admin_keys, api_keys=(plain, team), state=store)
        limits = app.state.api_options.key_limits
        _spent(store, limits[0], "r1", 0.25, 10)
        _spent(store, limits[0], "r2", 0.5, 5)
        _spent(store, limits[1], "r3", 0.125, 7)
        client = TestClient(app)
        if admin_keys:
            resp = client.get("/v1/budget", headers=auth(ADMIN))
            shown = {k["name"]: k for k in resp.json()["keys"]}
            assert set(shown) == {limits[0].name, "team-b"} and limits[0].name.startswith("sha256-")
            assert shown[limits[0].name]["spent_usd"] == 0.75 and shown[limits[0].name]["cap_usd"] is None
            assert shown[limits[0].name]["tokens_this_minute"] == 15
            assert shown[limits[0].name]["requests_this_minute"] is None  # counted at admission: keys with limits
            assert shown["team-b"]["spent_usd"] == 0.125 and shown["team-b"]["cap_usd"] == 2.0
            assert shown["team-b"]["period"] == "day" and shown["team-b"]["streams"] == 0
            assert "secret" not in resp.text  # the keys themselves never, nor a piece of them
            put = client.put("/v1/budget", json={"budget": 0.4}, headers=auth(ADMIN)).json()
            assert {k["name"] for k in put["keys"]} == set(shown)
            assert client.get("/v1/budget", headers=auth(plain)).status_code == 401  # admin keys read it
        else:  # no admin keys: an API key reads the budget, and its own spend only
            (own,) = client.get("/v1/budget", headers=auth("team-secret")).json()["keys"]
            assert own["name"] == "team-b" and own["spent_usd"] == 0.125
            (own,) = client.get("/v1/budget", headers=auth(plain)).json()["keys"]
            assert own["name"] == limits[0].name and own["spent_usd"] == 0.75
