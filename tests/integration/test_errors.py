"""Every error path answers in the OpenAI envelope with a message naming the problem,
quickly, and the gateway keeps serving afterwards."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "hi"}]


def post(gw, body: dict, path: str = "/chat/completions", headers: dict | None = None) -> httpx.Response:
    return httpx.post(gw.v1 + path, json=body, headers=headers, timeout=30)


def assert_envelope(r: httpx.Response, status: int, param: str | None = None, says: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert says.lower() in err["message"].lower(), err["message"]
    return err


def test_malformed_json(gateway):
    r = httpx.post(
        gateway.v1 + "/chat/completions",
        content=b'{"model": "tandem", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_envelope(r, 400, None, "could not parse the JSON body")


def test_missing_messages(gateway):
    assert_envelope(post(gateway, {"model": "tandem"}), 400, "messages", "missing required parameter")


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("temperature", 7, "less than or equal to 2"),
        ("n", 9, "less than or equal to 8"),
        ("top_p", 0, "greater than 0"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("frobnicate", True, "Unrecognized request argument"),  # OpenAI does not define it
        ("function_call", "auto", "needs functions"),
        ("logprobs", "yes please", "valid boolean"),
        ("top_logprobs", 3, "needs logprobs"),
    ],
)
def test_bad_fields_are_named(gateway, field, value, says):
    r = post(gateway, {"model": "tandem", "messages": MESSAGES, field: value})
    assert_envelope(r, 400, field, says)


def test_bad_message_role_is_named(gateway):
    r = post(gateway, {"model": "tandem", "messages": [{"role": "wizard", "content": "x"}]})
    assert_envelope(r, 400, "messages[0].role", "")


def test_sdk_raises_bad_request_naming_field(gateway):
    c = openai.OpenAI(base_url=gateway.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tandem", messages=MESSAGES, temperature=7)
    assert "temperature" in str(info.value)


def test_unknown_model_and_route(gateway):
    assert_envelope(post(gateway, {"model": "gpt-9", "messages": MESSAGES}), 404, "model", "does not exist")
    r = httpx.get(gateway.url + "/v1/nothing-here")
    assert_envelope(r, 404, None, "unknown route")


def test_unknown_policy(gateway):
    r = post(gateway, {"model": "tandem", "messages": MESSAGES, "tandem": {"policy": "psychic"}})
    assert_envelope(r, 400, "tandem.policy", "unknown routing policy")


def test_context_too_long(gateway):
    r = post(gateway, {"model": "tandem", "messages": [{"role": "user", "content": "word " * 5000}]})
    err = assert_envelope(r, 400, "messages", "context window")
    assert err["code"] == "context_length_exceeded"


def test_gateway_still_serves_after_errors(gateway):
    def count(status: str) -> float:
        return gateway.metric("tandem_requests_total", route="/v1/chat/completions", status=status)

    bad, good = count("400"), count("200")
    assert post(gateway, {"model": "tandem", "messages": MESSAGES, "n": 30}).status_code == 400
    r = post(gateway, {"model": "tandem", "messages": MESSAGES, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"]
    assert (count("400") - bad, count("200") - good) == (1, 1)


# --- authentication ------------------------------------------------------------------------


def test_wrong_or_missing_api_key(faulty_gateway):
    body = {"model": "device", "messages": MESSAGES, "max_tokens": 2}
    assert_envelope(
        post(faulty_gateway, body, headers={"authorization": "Bearer nope"}), 401, None, "incorrect api key"
    )
    assert_envelope(post(faulty_gateway, body), 401, None, "missing api key")
    c = openai.OpenAI(base_url=faulty_gateway.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    for key in (API_KEY, "second-key"):
        r = post(faulty_gateway, body, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(faulty_gateway.url + "/health").status_code == 200
    assert httpx.get(faulty_gateway.url + "/metrics").status_code == 200


# --- cloud down, stalled, failover -------------------------------------------------------------

AUTH = {"authorization": f"Bearer {API_KEY}"}


def test_cloud_down_is_a_clear_503_without_failover(faulty_gateway):
    t0 = time.monotonic()
    r = post(faulty_gateway, {"model": "tandem", "messages": MESSAGES}, headers=AUTH)
    assert time.monotonic() - t0 < 10
    err = assert_envelope(r, 503, None, "unreachable")
    assert "cloud" in err["message"]
    # Streaming requests fail the same way, before any byte of the stream.
    r = post(faulty_gateway, {"model": "tandem", "messages": MESSAGES, "stream": True}, headers=AUTH)
    assert_envelope(r, 503, None, "unreachable")


def test_stalled_cloud_times_out_not_hangs(faulty_gateway):
    t0 = time.monotonic()
    r = post(faulty_gateway, {"model": "stalled", "messages": MESSAGES, "stream": True}, headers=AUTH)
    assert time.monotonic() - t0 < 10
    assert_envelope(r, 504, None, "stalled")
    assert r.headers.get("x-should-retry") == "true"


def test_sdk_sees_cloud_down_as_api_error(faulty_gateway):
    c = openai.OpenAI(base_url=faulty_gateway.v1, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(model="tandem", messages=MESSAGES)
    assert info.value.status_code == 503


def test_cloud_down_fails_over_to_device(fallback_gateway):
    c = openai.OpenAI(base_url=fallback_gateway.v1, api_key="x", max_retries=0)
    raw = c.chat.completions.with_raw_response.create(model="tandem", messages=MESSAGES, max_tokens=4)
    assert raw.headers["x-tandem-backend"] == "device"
    assert raw.parse().choices[0].message.content
    stream = c.chat.completions.create(model="tandem", messages=MESSAGES, max_tokens=4, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream)
    errors = fallback_gateway.metric("tandem_backend_errors_total", backend="cloud", kind="http_503")
    assert errors >= 2


def test_readiness_names_the_unreachable_backend(faulty_gateway):
    r = httpx.get(faulty_gateway.url + "/health/ready")
    assert r.status_code == 503
    assert r.json()["backends"] == {"device": True, "cloud": False, "stalled": False}
