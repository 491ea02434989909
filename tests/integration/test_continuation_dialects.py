"""Each continuation dialect sends exactly the request its server documents: wire tests on a recording upstream.

A device-started answer (SmolLM2-135M on llama.cpp, a real gateway started with `tandem serve`) moves to a cheaper
cloud mid-answer; the cloud is the scripted upstream (tests/integration/scripted_upstream.py), which records the body
each dialect sends and answers with its fixed pieces. These check the wire shape only; the migrations onto real
servers that speak these dialects are in test_tandem_upstream.py and test_llama_server_dialects.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from clients.chat_template import render_chat
from clients.gguf_meta import read_chat_template
from deploy.models import model_path
from tests.integration.disco_helpers import trace
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "Tell me a long story about a cat who learns to sail."}]
CHEAP = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"
TEMPLATE_MODEL = "qwen2.5-coder-0.5b-instruct"  # the upstream's own template, not the device's (SmolLM2's)


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    clouds = "".join(
        f"""
[clouds.{name}]
base_url = "{upstream.base_url}"
model = "scripted-{name}"
price = {CHEAP}
{extra}
"""
        for name, extra in [
            ("prefill", 'continuation = "prefill"'),
            ("prefixflag", 'continuation = "prefix-flag"'),
            ("cfm", 'continuation = "continue-final-message"'),
            ("templated", f'continuation = "completions"\ntemplate = "{TEMPLATE_MODEL}"'),
            ("mistral", 'provider = "mistral"'),
            ("deepseek", 'provider = "deepseek"'),
        ]
    )
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
cloud = "prefill"
stall_timeout = 60     # a shared test machine: the device may be slow, never a fault here
[device]
reproducible = true   # the device's own answer is asked again below: one evaluation path
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
exchange_rate = 50      # SmolLM2 is so small that only a high λ makes its decoding dearer than the cloud's
consumption_rate = 1    # a slow reader: the move comes within a few tokens
{clouds}
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def ask(gw: GatewayProcess, cloud: str, model: str = "tandem", max_tokens: int = 40) -> httpx.Response:
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "tandem": {"cloud": cloud},
    }
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def migrated(gw: GatewayProcess, cloud: str, upstream: ScriptedUpstream) -> tuple[str, str, dict, dict]:
    """(the answer, the device's part of it, the migration's trace record, the body the cloud got)."""
    r = ask(gw, cloud)
    answer = r.json()["choices"][0]["message"]["content"]
    t = trace(gw, r.headers["x-request-id"])
    (move,) = t["migrations"]
    assert (move["from"], move["to"], move["reason"]) == ("device", cloud, "cost") and "error" not in move
    device_part = ask(gw, cloud, model="device", max_tokens=move["at_token"]).json()["choices"][0]["message"]["content"]
    (sent,) = upstream.requests
    seam = t["endpoints"][1]["seam"]
    assert seam["held"] == device_part[len(device_part.rstrip()) :]  # trailing whitespace moved out of the prefix
    # Joined without a seam defect: the delivered text, then the cloud's pieces less what repeats the held whitespace.
    assert answer == device_part + "".join(PIECES)[len(seam["dropped"]) :]
    return answer, device_part, move, sent.body | {"path": sent.path}


def assistant_turn(device_part: str, **flags) -> dict:
    return {"role": "assistant", "content": device_part.rstrip(), **flags}


def test_prefill_sends_the_answer_so_far_as_a_final_assistant_message(gw, upstream):
    _, device_part, move, body = migrated(gw, "prefill", upstream)
    assert move["dialect"] == "prefill"
    assert body["path"] == "/v1/chat/completions"
    assert body["messages"] == [*MESSAGES, assistant_turn(device_part)]
    assert "continue_final_message" not in body and "add_generation_prompt" not in body
    assert body["stream_options"] == {"include_usage": True}


def test_prefix_flag_marks_the_final_assistant_message(gw, upstream):
    _, device_part, move, body = migrated(gw, "prefixflag", upstream)
    assert move["dialect"] == "prefix-flag"
    assert body["path"] == "/v1/chat/completions"
    assert body["messages"] == [*MESSAGES, assistant_turn(device_part, prefix=True)]


def test_continue_final_message_sets_both_template_flags(gw, upstream):
    _, device_part, move, body = migrated(gw, "cfm", upstream)
    assert move["dialect"] == "continue-final-message"
    assert body["path"] == "/v1/chat/completions"
    assert body["messages"] == [*MESSAGES, assistant_turn(device_part)]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False


def test_completions_renders_the_upstreams_own_template(gw, upstream):
    _, device_part, move, body = migrated(gw, "templated", upstream)
    assert move["dialect"] == "completions"
    assert body["path"] == "/v1/completions"
    template = read_chat_template(model_path(TEMPLATE_MODEL))
    assert body["prompt"] == render_chat(template, MESSAGES) + device_part.rstrip()
    assert body["prompt"].startswith("<|im_start|>system\nYou are Qwen")  # the upstream's template, not SmolLM2's


def test_mistral_preset_speaks_prefix_flag_without_stream_options(gw, upstream):
    _, device_part, move, body = migrated(gw, "mistral", upstream)
    assert move["dialect"] == "prefix-flag"
    assert body["messages"][-1] == assistant_turn(device_part, prefix=True)
    assert "stream_options" not in body  # Mistral refuses fields it does not know


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_deepseek_preset_asks_json_mode_for_a_schema_and_checks_the_answer_against_it(gw, upstream):
    """DeepSeek's JSON mode takes json_object only: a json_schema format goes as json_object, the schema in a system
    message (which also has the word its JSON mode wants), and the answer that comes back is checked against it."""
    upstream.push(Answer(pieces=('{"city": ', '"Paris"}')), Answer(pieces=('{"town": "Paris"}',)))
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    body = {"model": "deepseek", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "response_format": fmt}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"city": "Paris"}
    sent = upstream.requests[0].body
    assert sent["response_format"] == {"type": "json_object"}
    system, *rest = sent["messages"]
    assert system["role"] == "system" and "JSON" in system["content"] and json.dumps(CITY) in system["content"]
    assert rest == MESSAGES
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)  # JSON, but not what the schema says
    assert r.status_code == 502 and "schema refuses" in r.json()["error"]["message"], r.text
    # json_object itself is DeepSeek's own: sent as it came.
    upstream.push(Answer(pieces=("{}",)))
    r = httpx.post(gw.v1 + "/chat/completions", json={**body, "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 200, r.text
    assert upstream.requests[-1].body["response_format"] == {"type": "json_object"}
    assert upstream.requests[-1].body["messages"] == MESSAGES


def test_a_fresh_answer_on_a_dialect_cloud_is_a_plain_chat_request(gw, upstream):
    body = {"model": "prefixflag", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (sent,) = upstream.requests
    assert sent.path == "/v1/chat/completions" and sent.body["messages"] == MESSAGES
    assert "dialect" not in trace(gw, r.headers["x-request-id"])["endpoints"][0]


def test_a_client_prefill_goes_to_a_dialect_cloud_in_its_dialect(gw, upstream):
    """The client's own prefix (Mistral's form, sent to Tandem) reaches a continue-final-message cloud in vLLM's form,
    its trailing whitespace held back and dropped from the answer's start."""
    body = {
        "model": "cfm",
        "messages": [*MESSAGES, {"role": "assistant", "content": "Once upon a time, ", "prefix": True}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (sent,) = upstream.requests
    assert sent.body["messages"] == [*MESSAGES, {"role": "assistant", "content": "Once upon a time,"}]
    assert sent.body["continue_final_message"] is True
    assert r.json()["choices"][0]["message"]["content"] == "".join(PIECES)[1:]  # " The" less the held space


def test_the_device_continues_a_client_prefill_and_contradicting_flags_are_refused(gw, upstream):
    body = {
        "model": "device",
        "messages": [*MESSAGES, {"role": "assistant", "content": "Once", "prefix": True}],
        "max_tokens": 4,
        "continue_final_message": True,
    }
    ok = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(
        gw.v1 + "/chat/completions",
        json={**body, "add_generation_prompt": True},
        timeout=60,
    )
    assert bad.status_code == 400 and "add_generation_prompt" in bad.json()["error"]["message"]
    assert upstream.requests == []


# --- seams: a cloud's text continued on the device (another vocabulary) after the cloud fails mid-answer ------------

SMOLLM_TEMPLATE = read_chat_template(model_path("smollm2-135m-instruct"))


def faulted_onto_device(gw: GatewayProcess, upstream: ScriptedUpstream, piece: str, max_tokens: int = 12, **extra):
    """The scripted cloud streams `piece` and drops the connection; the device goes on. (answer, its trace)."""
    upstream.push(Answer(pieces=(piece,), then="close"))
    body = {
        "model": "tandem",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "tandem": {"policy": "cloud", "cloud": "prefill"},
        **extra,
    }
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    t = trace(gw, r.headers["x-request-id"])
    assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [("prefill", "device", "error")]
    return r.json()["choices"][0]["message"]["content"], t


def device_after(gw: GatewayProcess, text: str, max_tokens: int) -> str:
    """What the device writes after the prompt and `text`, asked directly (its reproducible path)."""
    prompt = render_chat(SMOLLM_TEMPLATE, MESSAGES) + text
    body = {"model": "device", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(gw.v1 + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_seam_inside_a_word(gw, upstream):
    piece = "Once upon a time, a cat named Whisk"
    answer, t = faulted_onto_device(gw, upstream, piece)
    assert t["endpoints"][1]["seam"] == {"dialect": "tokens", "prefix_chars": len(piece), "held": "", "dropped": ""}
    assert answer == piece + device_after(gw, piece, 11)


def test_seam_after_trailing_whitespace(gw, upstream):
    piece = "Once upon a time, there was a "
    answer, t = faulted_onto_device(gw, upstream, piece)
    seam = t["endpoints"][1]["seam"]
    assert (seam["held"], seam["prefix_chars"]) == (" ", len(piece) - 1)
    own = device_after(gw, piece.rstrip(), 11)  # the device continues the text without its trailing space ...
    assert own.startswith(" ") and seam["dropped"] == " "
    assert answer == piece + own[1:]  # ... and the space it writes again is dropped: no doubled space
    assert "  " not in answer


def test_seam_after_a_multi_byte_character(gw, upstream):
    piece = "Once upon a time, a cat 🐱 named"
    answer, _ = faulted_onto_device(gw, upstream, piece)
    assert answer == piece + device_after(gw, piece, 11)
    assert "\ufffd" not in answer


def test_a_stop_sequence_spanning_the_seam_stops(gw, upstream):
    piece = "Once upon a time, a cat named Whisk"
    own = device_after(gw, piece, 11)
    assert len(own) >= 2
    stop = piece[-2:] + own[:2]  # begins in the cloud's text, ends in the device's
    answer, t = faulted_onto_device(gw, upstream, piece, stop=[stop])
    assert answer == piece[:-2]
    assert t["finish_reason"] == "stop"
