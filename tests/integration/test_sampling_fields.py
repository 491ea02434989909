"""logprobs / top_logprobs, n > 1, presence and frequency penalties, logit_bias and seed, end to end.

Real parts: the gateway (`tandem serve` in a subprocess) with the bundled SmolLM2 on llama.cpp as its device,
the real `openai` SDK, and a scripted OpenAI-compatible upstream on loopback
(tests/integration/scripted_upstream.py) that records what reached it and answers with logprobs when asked.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from deploy.models import model_path
from tests.integration.scripted_upstream import PIECES, Answer, ScriptedUpstream, piece_logprob

SMOL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
REPEAT = [{"role": "user", "content": "Repeat the word 'apple' twenty times, separated by spaces."}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "device"
fallback = false
[device]
reproducible = true   # greedy text is compared across requests: one evaluation path
model = "{SMOL}"
n_ctx = 2048
[disco]
migration = false
profile_device = false
[clouds.cloud]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
connect_timeout = 2
read_timeout = 3
retries = 0   # a scripted failure is the one answer a choice gets
""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vocab():
    """The device model's tokenizer alone (its token ids for logit_bias)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path(SMOL)), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def check_chat_entries(entries, top: int, greedy: bool) -> None:
    assert entries  # one entry per generated token: none would make every check below pass
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        if greedy and top:
            # The greedy choice is the most likely token (compared by bytes: `token` is the text it added).
            assert e.top_logprobs[0].bytes == e.bytes or math.isclose(e.top_logprobs[0].logprob, e.logprob)
            assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-4)


# -- logprobs on the device (llama.cpp) ------------------------------------------------------------------------------


def test_chat_logprobs_line_up_streamed_and_not(gw):
    c = client(gw)
    whole = c.chat.completions.create(
        model="device", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = whole.choices[0]
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert len(entries) == whole.usage.completion_tokens  # one entry per generated token
    check_chat_entries(entries, 3, greedy=True)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content

    chunks = list(
        c.chat.completions.create(
            model="device", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = []
    for ch in chunks:
        delta = ch.choices[0]
        text = delta.delta.content or ""
        if delta.logprobs is None:
            assert text == ""
            continue
        assert text == "".join(e.token for e in delta.logprobs.content)  # each chunk carries its own tokens
        streamed.extend(delta.logprobs.content)
    assert "".join(e.token for e in streamed) == choice.message.content
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_plain_request_has_null_logprobs_and_no_logprobs_field_cost(gw):
    body = {"model": "device", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and len(datas) >= 3  # the role chunk, a token at least, [DONE]
    for d in datas[:-1]:
        assert json.loads(d)["choices"][0]["logprobs"] is None


def test_logprobs_without_alternatives(gw):
    whole = client(gw).chat.completions.create(
        model="device", messages=MESSAGES, max_tokens=8, temperature=0.8, seed=3, logprobs=True
    )
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    assert entries and all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)


def test_completions_logprobs_streamed_and_not(gw):
    c = client(gw)
    prompt = "The capital of France is"
    whole = c.completions.create(model="device", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    text = whole.choices[0].text
    assert lp.tokens and "".join(lp.tokens) == text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 2
        assert math.isclose(max(top.values()), value, abs_tol=1e-4)  # greedy: the chosen one is the likeliest

    tokens, offsets = [], []
    for ch in c.completions.create(
        model="device", prompt=prompt, max_tokens=12, temperature=0, logprobs=2, stream=True
    ):
        part = ch.choices[0]
        if part.logprobs is None:
            assert part.text == ""
            continue
        assert part.text == "".join(part.logprobs.tokens)
        tokens += part.logprobs.tokens
        offsets += part.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_stop_sequence_trims_text_and_logprobs_together(gw):
    c = client(gw)
    plain = c.chat.completions.create(model="device", messages=MESSAGES, max_tokens=24, temperature=0)
    text = plain.choices[0].message.content
    words = text.split()
    assert len(words) >= 4, text
    stop = words[len(words) // 2][1:] or words[len(words) // 2]  # cut inside a token, most likely
    for stream in (False, True):
        kwargs = dict(model="device", messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop])
        if stream:
            got, entries = "", []
            for ch in c.chat.completions.create(**kwargs, logprobs=True, stream=True):
                got += ch.choices[0].delta.content or ""
                if ch.choices[0].logprobs is not None:
                    entries += ch.choices[0].logprobs.content
        else:
            whole = c.chat.completions.create(**kwargs, logprobs=True)
            got, entries = whole.choices[0].message.content, whole.choices[0].logprobs.content
        assert got == text[: text.index(stop)]
        assert "".join(e.token for e in entries) == got


# -- n > 1 -----------------------------------------------------------------------------------------------------------


def test_n_choices_non_streamed(gw):
    whole = client(gw).chat.completions.create(
        model="device", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11, n=2, logprobs=True
    )
    assert [ch.index for ch in whole.choices] == [0, 1]
    assert all(ch.message.content and ch.finish_reason in ("stop", "length") for ch in whole.choices)
    for ch in whole.choices:
        assert "".join(e.token for e in ch.logprobs.content) == ch.message.content
    trace = httpx.get(f"{gw.v1}/requests/{whole.id}", timeout=10).json()
    assert [t["id"] for t in trace["choices"]] == [f"{whole.id}-0", f"{whole.id}-1"]
    completions = sum(t["completion_tokens"] for t in trace["choices"])
    assert whole.usage.completion_tokens == completions
    assert whole.usage.prompt_tokens == trace["choices"][0]["prompt_tokens"]  # counted once
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + completions
    # Choice 0 with seed s is the n=1 answer with seed s.
    one = client(gw).chat.completions.create(model="device", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11)
    assert one.choices[0].message.content == whole.choices[0].message.content


def test_n_choices_streamed_with_usage(gw):
    body = {
        "model": "device",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0.9,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert {c["id"] for c in chunks} == {request_id}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] > 0
    texts, roles, finishes = {}, {}, {}
    for c in chunks[:-1]:
        assert c["usage"] is None and len(c["choices"]) == 1
        ch = c["choices"][0]
        i = ch["index"]
        if ch["delta"].get("role"):
            roles[i] = roles.get(i, 0) + 1
            assert i not in texts, "the role chunk comes first"
        texts[i] = texts.get(i, "") + (ch["delta"].get("content") or "")
        if ch["finish_reason"]:
            finishes[i] = finishes.get(i, 0) + 1
    assert roles == finishes == {0: 1, 1: 1, 2: 1}
    assert all(texts[i] for i in range(3))
    trace = httpx.get(f"{gw.v1}/requests/{request_id}", timeout=10).json()
    assert len(trace["choices"]) == 3
    completions = sum(t["completion_tokens"] for t in trace["choices"])
    assert usage["usage"]["completion_tokens"] == completions
    assert usage["usage"]["prompt_tokens"] == trace["choices"][0]["prompt_tokens"]


def test_n_choices_streamed_disconnect_stops_every_choice(gw):
    body = {"model": "device", "messages": REPEAT, "max_tokens": 400, "n": 2, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and gw.metric("tandem_backend_active_streams", backend="device") != 0:
        time.sleep(0.05)
    assert gw.metric("tandem_backend_active_streams", backend="device") == 0
    assert gw.metric("tandem_in_flight_requests") == 0


# -- penalties and logit_bias ----------------------------------------------------------------------------------------


def test_large_negative_logit_bias_removes_a_token(gw, vocab):
    c = client(gw)
    plain = c.chat.completions.create(model="device", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    ids = vocab.tokenize(bytes(first.bytes), add_bos=False, special=True)
    assert len(ids) == 1, ids
    banned = ids[0]
    biased = c.chat.completions.create(
        model="device",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        logit_bias={str(banned): -100},
    )
    assert biased.choices[0].message.content != plain.choices[0].message.content
    entries = biased.choices[0].logprobs.content
    assert entries and all(bytes(e.bytes) != bytes(first.bytes) for e in entries)


def test_presence_and_frequency_penalties_change_greedy_output(gw):
    c = client(gw)
    kwargs = dict(model="device", messages=REPEAT, max_tokens=30, temperature=0)
    plain = c.chat.completions.create(**kwargs).choices[0].message.content
    assert plain.lower().count("apple") >= 3, plain
    presence = c.chat.completions.create(**kwargs, presence_penalty=2.0).choices[0].message.content
    frequency = c.chat.completions.create(**kwargs, frequency_penalty=2.0).choices[0].message.content
    assert presence != plain
    assert frequency != plain
    assert frequency.lower().count("apple") < plain.lower().count("apple")


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("chat", {"n": 9}, "n"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias[5]"),
        ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"echo": True}, "echo"),
        ("chat", {"tools": []}, "tools"),
    ],
)
def test_bad_values_are_400_naming_the_field(gw, path, extra, param):
    if path == "chat":
        body = {"model": "device", "messages": MESSAGES, "max_tokens": 2, **extra}
    else:
        body = {"model": "device", "prompt": "Hi", "max_tokens": 2, **extra}
    r = httpx.post(f"{gw.v1}/{'chat/completions' if path == 'chat' else 'completions'}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split("[")[0] in err["message"]


# -- pass-through to an OpenAI-compatible upstream -------------------------------------------------------------------


def test_upstream_gets_the_fields_and_its_logprobs_come_back(gw, upstream):
    whole = client(gw).chat.completions.create(
        model="cloud",
        messages=MESSAGES,
        max_tokens=20,
        temperature=0.5,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"42": 5, "7": -100},
    )
    sent = upstream.requests[-1]
    assert sent.path.endswith("/chat/completions")
    b = sent.body
    assert b["logprobs"] is True and b["top_logprobs"] == 2
    assert b["presence_penalty"] == 0.5 and b["frequency_penalty"] == -0.25
    assert b["logit_bias"] == {"42": 5.0, "7": -100.0} and b["seed"] == 7
    assert "n" not in b
    entries = whole.choices[0].logprobs.content
    assert [e.token for e in entries] == list(PIECES)
    assert [e.logprob for e in entries] == pytest.approx([piece_logprob(k) for k in range(len(PIECES))])
    assert [t.token for t in entries[0].top_logprobs] == [PIECES[0], " alt1"]


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_an_upstreams_extra_alternative_is_trimmed_to_top_logprobs(gw, upstream, stream):
    """An upstream that adds the sampled token to the k likeliest (llama-cpp-python's server, the embedded cloud)
    still answers with exactly k alternatives, the likeliest first, as OpenAI does."""
    upstream.push(Answer(sampled_below_top=True))
    args = {"model": "cloud", "messages": MESSAGES, "max_tokens": 20, "logprobs": True, "top_logprobs": 2}
    if stream:
        chunks = client(gw).chat.completions.create(**args, stream=True)
        entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    else:
        entries = client(gw).chat.completions.create(**args).choices[0].logprobs.content
    assert [e.token for e in entries] == list(PIECES)
    assert all([t.token for t in e.top_logprobs] == [" alt2", " alt1"] for e in entries)


def test_upstream_completions_logprobs_and_n(gw, upstream):
    whole = client(gw).completions.create(model="cloud", prompt="Hello", max_tokens=20, logprobs=3, n=2, seed=5)
    assert [ch.index for ch in whole.choices] == [0, 1]
    assert len(upstream.requests) == 2  # one upstream request per choice
    bodies = [r.body for r in upstream.requests]
    assert all(
        r.path.endswith("/completions") and b["logprobs"] == 3 and "n" not in b
        for r, b in zip(upstream.requests, bodies, strict=True)
    )
    assert sorted(b["seed"] for b in bodies) == [5, 6]
    for ch in whole.choices:
        assert ch.logprobs.tokens == list(PIECES)
        assert ch.logprobs.token_logprobs == pytest.approx([piece_logprob(k) for k in range(len(PIECES))])
        assert list(ch.logprobs.top_logprobs[0]) == [PIECES[0], " alt1", " alt2"]


def test_logprobs_across_a_fault_migration_come_from_each_endpoint(gw, upstream):
    """The cloud fails after 4 tokens; the device continues: the first 4 logprobs are the upstream's, the rest the
    device's, and the trace says from which token each endpoint produced."""
    upstream.push(Answer(pieces=PIECES[:4], then="reset"))
    chunks = list(
        client(gw).chat.completions.create(
            model="tandem",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
            extra_body={"tandem": {"policy": "cloud"}},
        )
    )
    entries, text = [], ""
    for ch in chunks:
        text += ch.choices[0].delta.content or ""
        if ch.choices[0].logprobs is not None:
            entries += ch.choices[0].logprobs.content
    assert text.startswith("".join(PIECES[:4])) and len(text) > len("".join(PIECES[:4]))
    assert "".join(e.token for e in entries) == text
    assert [e.logprob for e in entries[:4]] == pytest.approx([piece_logprob(k) for k in range(4)])
    device = entries[4:]
    assert device and all(e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4) for e in device)
    t = httpx.get(f"{gw.v1}/requests/{chunks[0].id}", timeout=10).json()
    assert [(e["backend"], e["from_token"]) for e in t["endpoints"]] == [("cloud", 0), ("device", 4)]
    assert t["migrations"][0]["at_token"] == 4


def test_n_choices_errors(gw, upstream):
    # Every choice fails before a token: a real HTTP error with the request's id.
    upstream.push(Answer(status=500), Answer(status=500))
    body = {"model": "cloud", "messages": MESSAGES, "max_tokens": 8, "n": 2}
    for stream in (False, True):
        r = httpx.post(gw.v1 + "/chat/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["message"] and r.headers["x-request-id"].startswith("chatcmpl-")
        upstream.push(Answer(status=500), Answer(status=500))
    time.sleep(0.5)  # a cancelled choice's request may still be on its way: it must not take the next answers
    upstream.reset()
    # One choice fails mid-stream (a pinned cloud cannot move): the SSE error event, then [DONE].
    # (Both answers fail: which request the scripted upstream gives which answer to is a race between the choices.)
    upstream.push(Answer(pieces=PIECES[:3], then="reset"), Answer(pieces=PIECES[:3], gap=0.05, then="reset"))
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    assert "error" in json.loads(datas[-2])
