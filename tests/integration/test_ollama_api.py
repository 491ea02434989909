"""The Ollama API (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, ...) through the real `ollama` client.

Real parts: one `tandem serve` on loopback for the module, its device model Qwen2.5-Coder-0.5B (reproducible path)
and its embedded stand-in cloud (llama-cpp-python's server with Qwen2.5-Coder-1.5B), priced so that DiSCo moves an
answer that starts on the device to the cheaper cloud (as in test_anthropic_sdk.py). The client is `ollama.Client`
(httpx underneath: an event hook reads each answer's `x-request-id`, its trace's id); traces come from
GET /v1/requests/{id}; a race is forced over PUT /v1/budget, as a user would.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Iterator

import httpx
import ollama
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration import disco_helpers
from tests.integration.disco_helpers import (
    embedded_server_pid,
    endpoints,
    evict_cache,
    independent_continuation,
    signal_at,
)

KEY = "ollama-test-key"
DEVICE_KEY = "device-only-key"
LIMITED_KEY = "one-a-minute-key"
ADMIN = "ollama-admin-key"
AUTH = {"authorization": f"Bearer {KEY}"}
CHEAP_CLOUD = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"
ASK = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
GREEDY = {"temperature": 0}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
EMBEDDER = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: routed answers start on the device and move when that pays
stall_timeout = 30     # the patience for a token (a migration target's first included) on busy shared cores
admin_keys = ["{ADMIN}"]
api_keys = [
  "{KEY}",
  {{ key = "{DEVICE_KEY}", privacy = "device" }},
  {{ key = "{LIMITED_KEY}", name = "ollama-limited", rpm = 1 }},
]
[device]
reproducible = true
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0.0
consumption_rate = 0.1   # a slow reader: a routed answer's move to the cheap cloud comes within a few tokens
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
price = {CHEAP_CLOUD}
co_located = false     # the race test races it (embedded, it would never be raced against the device)
[clouds.cloud.embedded]
port = 0
n_ctx = 2048
""")
    yield process
    stop_gateway(process)


class Client(ollama.Client):
    """The real client, remembering the last answer's headers (its trace id is `x-request-id`)."""

    def __init__(self, gw: GatewayProcess, key: str | None = KEY):
        self.headers: httpx.Headers = httpx.Headers()
        headers = {"authorization": f"Bearer {key}"} if key else {}
        super().__init__(host=gw.url, headers=headers, timeout=180, event_hooks={"response": [self._seen]})

    def _seen(self, response: httpx.Response) -> None:
        self.headers = response.headers

    @property
    def request_id(self) -> str:
        return self.headers["x-request-id"]


def trace(gw: GatewayProcess, request_id: str) -> dict:
    return disco_helpers.trace(gw, request_id, key=KEY)


def streamed_chat(client: Client, **kw) -> tuple[str, list, ollama.ChatResponse]:
    """A streamed chat: (its text, its pieces, its last line)."""
    parts = list(client.chat(stream=True, **kw))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    pieces = [p.message.content for p in parts[:-1] if p.message.content]
    return "".join(pieces), pieces, parts[-1]


def assert_timed(last, eval_count: int) -> None:
    """Ollama's last-line counts and timings (nanoseconds, adding up)."""
    assert last.eval_count == eval_count and last.prompt_eval_count > 0 and last.load_duration == 0
    assert 0 < last.prompt_eval_duration < last.total_duration and 0 < last.eval_duration < last.total_duration
    assert last.prompt_eval_duration + last.eval_duration <= last.total_duration


# -- the probes, the models ------------------------------------------------------------------------------------------


def test_the_probes_answer_as_ollama_does(gw):
    root = httpx.get(gw.url + "/", timeout=10)
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert httpx.head(gw.url + "/", timeout=10).status_code == 200
    assert httpx.get(gw.url + "/api/version", timeout=10).json()["version"].count(".") == 2


def test_list_show_and_ps(gw):
    client = Client(gw)
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {
        "tandem",
        "device",
        "qwen2.5-coder-0.5b-instruct",
        "cloud",
        "qwen2.5-coder-1.5b-instruct",
        EMBEDDER,
    }
    device = client.show("device")
    assert device.capabilities == ["completion", "tools"]
    # Ollama's clients read a model's window as `<architecture>.context_length`: /v1/models' context_length.
    windows = {
        m["id"]: m["context_length"] for m in httpx.get(gw.v1 + "/models", headers=AUTH, timeout=10).json()["data"]
    }
    assert device.modelinfo == {"general.architecture": "tandem", "tandem.context_length": 2048}  # [device] n_ctx
    assert client.show(EMBEDDER).modelinfo["tandem.context_length"] == 256  # the embedding model's window
    assert (windows["device"], windows[EMBEDDER]) == (2048, 256)
    raw = httpx.post(gw.url + "/api/show", headers=AUTH, json={"model": "cloud:latest"}, timeout=10).json()
    assert raw["tandem"] == {"locality": "cloud", "endpoints": ["cloud"]}
    tags = httpx.get(gw.url + "/api/tags", headers=AUTH, timeout=10).json()["models"]
    about = {m["name"]: m["tandem"] for m in tags}
    assert about["tandem"] == {"locality": "routed", "endpoints": ["device", "cloud"]}
    assert about["qwen2.5-coder-0.5b-instruct"] == {"locality": "device", "endpoints": ["device"]}
    assert client.show("tandem").capabilities == ["completion", "tools"]
    assert client.show(EMBEDDER).capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    assert {m.model for m in client.ps().models} == {"device", "cloud"}


# -- a migration and a race, whole over NDJSON ----------------------------------------------------------------------
# First after the probes: DiSCo's output-length estimate learns from every answer, and the module's many short ones
# (one or two tokens) would soon make any move look worthless to it (Eq. 5's expected remaining tokens).


def test_a_streamed_answer_that_migrates_arrives_whole(gw):
    evict_cache(gw, "cloud", AUTH)  # the cloud's path is then the one independent_continuation takes
    client = Client(gw)
    text, _, last = streamed_chat(client, model="tandem", messages=ASK, options={**GREEDY, "num_predict": 24})
    t = trace(gw, client.request_id)
    (migration,) = t["migrations"]
    assert endpoints(t) == [("device", "migrated-from"), ("cloud", "finished")]
    assert last.done_reason == "length" and last.eval_count == 24 == t["completion_tokens"]
    # Nothing lost or repeated at the seam: the device's own start, then what the cloud says after exactly that.
    k = migration["at_token"]
    device_part = Client(gw).chat(model="device", messages=ASK, options={**GREEDY, "num_predict": k}).message.content
    assert text.startswith(device_part)
    assert text[len(device_part) :] == independent_continuation(gw, "cloud", ASK, device_part, 24 - k, AUTH)


def test_a_raced_answer_arrives_whole(gw):
    admin = {"authorization": f"Bearer {ADMIN}"}
    # DiSCo-S, server-constrained, b = 1: every prompt races both endpoints (test_disco_live.py's knobs).
    knobs = {"policy": "disco-s", "constrained_side": "server", "budget": 1.0, "migration": False}
    assert httpx.put(gw.v1 + "/budget", headers=admin, json=knobs, timeout=10).status_code == 200
    try:
        evict_cache(gw, "cloud", AUTH)  # the cloud starts from position 0, as independent_continuation's does
        client = Client(gw)
        text, _, last = streamed_chat(client, model="tandem", messages=ASK, options={**GREEDY, "num_predict": 12})
    finally:
        assert httpx.delete(gw.v1 + "/budget", headers=admin, timeout=10).status_code == 200
    t = trace(gw, client.request_id)
    assert t["plan"]["kind"] == "race"
    outcomes = dict(endpoints(t))
    (winner,) = [b for b, outcome in outcomes.items() if outcome == "finished"]
    assert sorted(outcomes.values()) == ["finished", "lost"]
    assert last.done_reason == "length" and last.eval_count == 12 == t["completion_tokens"]
    # Whole: exactly the winner's own greedy answer, nothing of the loser's in it.
    assert text == independent_continuation(gw, winner, ASK, "", 12, AUTH)


# -- chat and generate on each route ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "served_by"),
    [("device", {"device"}), ("cloud", {"cloud"}), ("tandem", None)],
    ids=["device", "cloud", "routed"],
)
def test_chat_plain_and_streamed(gw, model, served_by):
    client = Client(gw)
    answer = client.chat(model=model, messages=ASK, stream=False, options={**GREEDY, "num_predict": 12})
    t = trace(gw, client.request_id)
    assert answer.done and answer.done_reason == "length" and answer.model == model
    assert answer.message.role == "assistant" and answer.message.content
    assert answer.prompt_eval_count == t["prompt_tokens"] and answer.eval_count == t["completion_tokens"] == 12
    assert_timed(answer, 12)
    assert served_by is None or {b for b, _ in endpoints(t)} == served_by

    text, pieces, last = streamed_chat(client, model=model, messages=ASK, options={**GREEDY, "num_predict": 12})
    assert client.headers["content-type"] == "application/x-ndjson"
    assert last.done_reason == "length" and last.message.content == "" and len(pieces) > 1
    assert_timed(last, 12)
    assert last.prompt_eval_count == answer.prompt_eval_count
    assert trace(gw, client.request_id)["completion_tokens"] == 12
    if model == "device":  # one computation path (reproducible device): the same greedy text, streamed or not
        assert text == answer.message.content


@pytest.mark.parametrize("model", ["device", "cloud", "tandem"], ids=["device", "cloud", "routed"])
def test_generate_plain_and_streamed(gw, model):
    client = Client(gw)
    options = {**GREEDY, "num_predict": 10}
    whole = client.generate(model=model, prompt=ASK[0]["content"], options=options)
    assert whole.done and whole.done_reason == "length" and whole.response and whole.context is None
    assert_timed(whole, 10)
    assert trace(gw, client.request_id)["prompt_tokens"] == whole.prompt_eval_count
    parts = list(client.generate(model=model, prompt=ASK[0]["content"], options=options, stream=True))
    assert parts[-1].done and parts[-1].response == "" and not any(p.done for p in parts[:-1])
    assert_timed(parts[-1], 10)
    if model == "device":
        assert "".join(p.response for p in parts) == whole.response


def test_generate_is_chat_with_one_user_turn_and_raw_is_the_prompt_as_it_is(gw):
    client = Client(gw)
    options = {**GREEDY, "num_predict": 10}
    system = "You are a terse assistant."
    generated = client.generate(model="device", prompt=ASK[0]["content"], system=system, options=options)
    chat = client.chat(model="device", messages=[{"role": "system", "content": system}, *ASK], options=options)
    assert generated.response == chat.message.content
    assert generated.prompt_eval_count == chat.prompt_eval_count

    prompt = "def add(a, b):"
    raw = client.generate(model="device", prompt=prompt, raw=True, options=options)
    completion = httpx.post(
        gw.v1 + "/completions",
        headers=AUTH,
        json={"model": "device", "prompt": prompt, "max_tokens": 10, "temperature": 0},
        timeout=120,
    ).json()
    assert raw.response == completion["choices"][0]["text"]
    assert raw.prompt_eval_count == completion["usage"]["prompt_tokens"]


def test_nothing_to_answer_is_ollamas_load_and_unload(gw):
    client = Client(gw)
    loaded = client.chat(model="device", messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    assert client.generate(model="device:latest", prompt="", keep_alive=0).done_reason == "unload"
    with pytest.raises(ollama.ResponseError) as missing:
        client.generate(model="no-such-model", prompt="")
    assert missing.value.status_code == 404


# -- options, format, a continued message, logprobs ------------------------------------------------------------------


def test_options_stop_top_k_and_seed(gw):
    client = Client(gw)

    def text(**options) -> ollama.ChatResponse:
        return client.chat(model="device", messages=ASK, options={"num_predict": 10, **options})

    plain = text(**GREEDY).message.content
    stop = plain.split()[1]
    stopped = text(**GREEDY, stop=["\u2603", stop])
    assert stopped.done_reason == "stop" and stop not in stopped.message.content
    assert plain.startswith(stopped.message.content)
    assert text(temperature=1.0, top_k=1).message.content == plain  # top_k 1 is greedy at any temperature
    seeded = text(temperature=1.0, seed=7).message.content
    assert text(temperature=1.0, seed=7).message.content == seeded  # the reproducible device: a seed repeats


def test_llama_cpps_samplers_apply_on_the_device(gw):
    """min_p = 1 keeps only the likeliest token: a hot sampler then writes the greedy answer (on the reproducible
    path, so the requests evaluate alike); without it, the same seed writes another (test_request_schema.py's check
    of the OpenAI door, through Ollama's `options`)."""
    client = Client(gw)

    def text(**options) -> str:
        return client.chat(model="device", messages=ASK, options={"num_predict": 16, **options}).message.content

    greedy = text(**GREEDY)
    hot = {"temperature": 2.0, "seed": 3}
    cut = text(**hot, min_p=1.0)
    assert "x-tandem-ignored-fields" not in client.headers
    assert cut == greedy != text(**hot)


def test_options_not_applied_are_named(gw):
    body = {
        "model": "device",
        "messages": [{**ASK[0], "images": []}],
        "stream": False,
        "keep_alive": "5m",
        "options": {**GREEDY, "num_predict": 2, "num_ctx": 4096, "num_gpu": 99, "repeat_last_n": 8, "mirostat": 2},
        "think": True,
        "some_new_field": 1,
    }
    r = httpx.post(gw.url + "/api/chat", headers=AUTH, json=body, timeout=120)
    assert r.status_code == 200 and r.json()["eval_count"] == 2
    ignored = r.headers["x-tandem-ignored-fields"].split(", ")
    assert ignored == ["some_new_field", "options.num_ctx", "options.num_gpu", "options.repeat_last_n", "think"]
    applied = {**body, "options": {**GREEDY, "num_predict": 2}, "think": False}
    r = httpx.post(gw.url + "/api/chat", headers=AUTH, json=applied, timeout=120)
    assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "some_new_field"
    client = Client(gw)
    client.chat(model="device", messages=ASK, options={"num_predict": 1, "seed": 1, "stop": ["x"], "top_p": 0.9})
    assert "x-tandem-ignored-fields" not in client.headers


def test_format_json_and_a_json_schema(gw):
    client = Client(gw)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Make up a person: a name and an age."}]
    shaped = client.chat(model="device", messages=ask, format=schema, options={**GREEDY, "num_predict": 40})
    person = json.loads(shaped.message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    parts = list(client.generate(model="device", prompt=ask[0]["content"], format="json", stream=True, options=GREEDY))
    assert isinstance(json.loads("".join(p.response for p in parts)), dict)


def test_a_trailing_assistant_message_is_continued(gw):
    begun = "Sure! Here is the function, named `plus`:"
    continued = Client(gw).chat(
        model="device", messages=[*ASK, {"role": "assistant", "content": begun}], options={**GREEDY, "num_predict": 8}
    )
    assert continued.message.content == independent_continuation(gw, "device", ASK, begun, 8, AUTH)


def test_logprobs_line_up_with_the_text(gw):
    client = Client(gw)
    options = {**GREEDY, "num_predict": 6}
    answer = client.chat(model="device", messages=ASK, logprobs=True, top_logprobs=2, options=options)
    assert len(answer.logprobs) == 6 and "".join(lp.token for lp in answer.logprobs) == answer.message.content
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in answer.logprobs)
    parts = list(client.chat(model="device", messages=ASK, logprobs=True, stream=True, options=options))
    assert [lp.token for p in parts for lp in p.logprobs or ()] == [lp.token for lp in answer.logprobs]


# -- tools -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_a_tool_loop(gw, streamed):
    client = Client(gw)
    ask = [{"role": "user", "content": "What is the weather in Paris right now? Answer in celsius."}]

    def chat(messages) -> tuple[ollama.Message, ollama.ChatResponse]:
        options = {**GREEDY, "num_predict": 60}
        if not streamed:
            answer = client.chat(model="device", messages=messages, tools=[WEATHER], options=options)
            return answer.message, answer
        parts = list(client.chat(model="device", messages=messages, tools=[WEATHER], options=options, stream=True))
        calls = [c for p in parts for c in p.message.tool_calls or ()]
        text = "".join(p.message.content or "" for p in parts)
        return ollama.Message(role="assistant", content=text, tool_calls=calls or None), parts[-1]

    message, first = chat(ask)
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments["city"] == "Paris"
    assert first.done_reason == "stop"
    result = {"role": "tool", "tool_name": "get_weather", "content": '{"temperature": 31, "sky": "sunny"}'}
    again, answer = chat([*ask, message, result])
    # The result reached the model (the prompt grew by it); the 0.5B model answers with it or calls the tool again,
    # and a call is then whole and valid (as in test_anthropic_sdk's loop).
    assert answer.prompt_eval_count > first.prompt_eval_count + 20
    if again.tool_calls:
        assert again.tool_calls[0].function.name == "get_weather"
        assert isinstance(again.tool_calls[0].function.arguments.get("city"), str)
    else:
        assert "31" in again.content


# -- embeddings ------------------------------------------------------------------------------------------------------


def test_embed_and_the_older_embeddings(gw):
    client = Client(gw)
    texts = ["The cat sat on the mat.", "A dog barked."]
    embedded = client.embed(model=EMBEDDER, input=texts)
    assert len(embedded.embeddings) == 2 and embedded.prompt_eval_count > 0 and embedded.total_duration > 0
    for vector in embedded.embeddings:
        assert len(vector) == 384 and math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)
    openai_shape = httpx.post(gw.v1 + "/embeddings", headers=AUTH, json={"model": EMBEDDER, "input": texts}).json()
    assert [d["embedding"] for d in openai_shape["data"]] == [list(v) for v in embedded.embeddings]
    single = client.embeddings(model=EMBEDDER, prompt=texts[0])  # one text: the same batch shape as embed's one
    assert list(single.embedding) == list(client.embed(model=EMBEDDER, input=texts[0]).embeddings[0])
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(single.embedding, embedded.embeddings[0], strict=True))
    with pytest.raises(ollama.ResponseError) as chat_model:
        client.embed(model="device", input="hello")
    assert chat_model.value.status_code == 404


# -- keys, privacy, limits, the feed ---------------------------------------------------------------------------------


def test_keys_and_privacy_levels(gw):
    with pytest.raises(ollama.ResponseError) as missing:
        Client(gw, key=None).chat(model="device", messages=ASK, options={"num_predict": 1})
    assert missing.value.status_code == 401 and "API key" in missing.value.error
    with pytest.raises(ollama.ResponseError) as wrong:
        Client(gw, key="wrong").list()
    assert wrong.value.status_code == 401
    device_only = Client(gw, key=DEVICE_KEY)
    with pytest.raises(ollama.ResponseError) as floor:
        device_only.chat(model="cloud", messages=ASK, options={"num_predict": 1})
    assert floor.value.status_code == 400 and "privacy level 'device'" in floor.value.error
    device_only.chat(model="tandem", messages=ASK, options={"num_predict": 4})
    assert {b for b, _ in endpoints(trace(gw, device_only.request_id))} == {"device"}
    # The request's own level, in Tandem's `tandem` field as on the other front doors.
    body = {"model": "cloud", "messages": ASK, "stream": False, "tandem": {"privacy": "device"}}
    r = httpx.post(gw.url + "/api/chat", headers=AUTH, json=body, timeout=30)
    assert r.status_code == 400 and "privacy level 'device'" in r.json()["error"]


def test_a_rate_limited_key_gets_ollamas_429_and_its_answers_are_settled(gw):
    client = Client(gw, key=LIMITED_KEY)
    client.chat(model="device", messages=ASK, options={"num_predict": 1})
    assert client.headers["x-ratelimit-remaining-requests"] == "0"
    limited = None
    for _ in range(3):  # one a minute: of three requests in a row at least one is refused, across a minute's turn too
        try:
            client.chat(model="device", messages=ASK, options={"num_predict": 1})
        except ollama.ResponseError as exc:
            limited = exc
            break
    assert limited is not None and limited.status_code == 429 and "requests per minute" in limited.error
    assert int(client.headers["retry-after"]) > 0
    budget = httpx.get(gw.v1 + "/budget", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    (line,) = [k for k in budget["keys"] if k["name"] == "ollama-limited"]
    assert line["streams"] == 0  # each answer's admission was settled when it ended: nothing held


def test_an_answer_is_on_the_live_feed(gw):
    client = Client(gw)
    client.chat(model="device", messages=ASK, options={"num_predict": 3})
    request_id = client.request_id
    seen = []
    with httpx.stream(
        "GET", gw.v1 + "/events", headers={**AUTH, "Last-Event-ID": "0"}, timeout=30
    ) as feed:  # the dashboard's feed, from the start of the bus's history
        for line in feed.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("request_id") == request_id:
                    seen.append(event["type"])
                    if event["type"] == "request.finished":
                        break
    assert seen[0] == "request.planned" and seen[-1] == "request.finished" and "endpoint.started" in seen


# -- bad input -------------------------------------------------------------------------------------------------------


CHAT = {"model": "device", "messages": ASK, "stream": False}


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/api/chat", {**CHAT, "messages": [{**ASK[0], "images": ["aGk="]}]}, "messages[0].images"),
        ("/api/chat", {**CHAT, "options": {"temperature": 9}}, "options.temperature"),
        ("/api/chat", {**CHAT, "options": {"num_predict": 10**30}}, "options.num_predict"),
        ("/api/chat", {**CHAT, "options": {"stop": [""]}}, "options.stop"),
        ("/api/chat", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("/api/chat", {**CHAT, "format": "yaml"}, "format"),
        ("/api/chat", {**CHAT, "format": {"type": "object", "minProperties": "x"}}, "format"),
        ("/api/chat", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/api/chat", {**CHAT, "tandem": {"privacy": "nowhere"}}, "tandem.privacy"),
        ("/api/generate", {"model": "device", "prompt": "hi", "images": ["aGk="]}, "images"),
        ("/api/generate", {"model": "device", "prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
        ("/api/generate", {"model": "device", "prompt": "hi", "suffix": "return x"}, "suffix"),
        ("/api/generate", {"model": "device", "prompt": "hi", "context": [1, 2, 3]}, "context"),
        ("/api/generate", {"model": "device", "prompt": "hi", "raw": True, "format": "json"}, "raw"),
        ("/api/embed", {"model": EMBEDDER, "input": "hi", "dimensions": 8}, "dimensions"),
        ("/api/embed", {"model": EMBEDDER, "input": [""]}, "input"),
    ],
    ids=[
        "image",
        "temperature",
        "huge-num_predict",
        "empty-stop",
        "role",
        "format-word",
        "format-schema",
        "top_logprobs-alone",
        "tandem-privacy",
        "generate-image",
        "template",
        "suffix",
        "context",
        "raw-format",
        "dimensions",
        "empty-input",
    ],
)
def test_bad_input_is_a_400_in_ollamas_envelope(gw, path, body, named):
    r = httpx.post(gw.url + path, headers=AUTH, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert list(error) == ["error"] and named in error["error"]
    assert r.headers["x-request-id"]


def test_a_body_without_a_json_content_type_is_read_as_json_as_ollama_does(gw):
    """Ollama's own examples: `curl http://localhost:11434/api/chat -d '{…}'` (curl says form-urlencoded)."""
    body = json.dumps({"model": "device", "messages": ASK, "stream": False, "options": {**GREEDY, "num_predict": 3}})
    for content_type in ("application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
        r = httpx.post(gw.url + "/api/chat", headers=headers, content=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True and r.json()["eval_count"] == 3


def test_errors_anywhere_under_api_are_ollamas(gw):
    unparsable = httpx.post(gw.url + "/api/chat", headers={**AUTH, "content-type": "application/json"}, content="{")
    assert unparsable.status_code == 400 and "JSON" in unparsable.json()["error"]
    pull = httpx.post(gw.url + "/api/pull", headers=AUTH, json={"model": "llama3"}, timeout=10)
    assert pull.status_code == 501 and "does not pull" in pull.json()["error"]
    unknown = httpx.get(gw.url + "/api/nothing-here", headers=AUTH, timeout=10)
    assert unknown.status_code == 404 and unknown.json() == {"error": "Unknown route: GET /api/nothing-here"}
    # The gateway keeps serving.
    assert Client(gw).chat(model="device", messages=ASK, options={"num_predict": 2}).eval_count == 2


def test_a_streamed_answer_whose_endpoint_dies_arrives_whole(gw):
    """Last: the cloud is killed."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.put(gw.v1 + "/budget", headers=admin, json={"policy": "cloud"}, timeout=10).status_code == 200
    kill_after_three, killed = signal_at(embedded_server_pid(gw), signal.SIGKILL, 3)
    client, pieces = Client(gw), []
    try:
        for part in client.chat(model="tandem", messages=ASK, stream=True, options={**GREEDY, "num_predict": 16}):
            if part.message.content:
                pieces.append(part.message.content)
                kill_after_three(len(pieces))
            last = part
    finally:
        httpx.delete(gw.v1 + "/budget", headers=admin, timeout=10)
    assert killed.is_set() and last.done and last.done_reason in ("length", "stop")
    t = trace(gw, client.request_id)
    assert [m["reason"] for m in t["migrations"]] == ["error"]
    assert endpoints(t) == [("cloud", "failed"), ("device", "finished")]
    assert last.eval_count == t["completion_tokens"]
    # The device's part is exactly what it says after the prompt and the cloud's delivered part: no token repeated,
    # skipped or lost at the seam.
    k = t["migrations"][0]["at_token"]
    assert 0 < k < len(pieces)
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    assert independent_continuation(gw, "device", ASK, prefix, len(pieces) - k, AUTH) == rest
