"""The whole OpenAI chat request schema, as the pinned `openai` SDK defines it, against a real gateway.

Real parts: `tandem serve` in a subprocess with the bundled SmolLM2 on llama.cpp as its device, the real `openai` SDK,
and a scripted OpenAI-compatible upstream on loopback (tests/integration/scripted_upstream.py) that records every
body it receives, configured three times under three providers' dialects (clients/dialects.py). One test walks the
SDK's own parameter list, so a field a newer SDK adds fails it until it is handled here and in endpoints/schemas.py.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from clients.dialects import PLATFORM_FIELDS, RECORDED_FIELDS
from tests.integration.scripted_upstream import ScriptedUpstream

SMOL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Name one colour."}]
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
TOOLS = [{"type": "function", "function": ADD}]

# One valid value of each platform field (what the forwarding tests send and expect to see upstream as sent).
PLATFORM = {
    "reasoning_effort": "low",
    "verbosity": "low",
    "service_tier": "flex",
    "prompt_cache_key": "conversation-17",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "user-5f1c",
    "user": "alice",
    "metadata": {"team": "qa"},
    "store": False,
    "prediction": {"type": "content", "content": "red"},
}
LLAMA = {"top_k": 20, "min_p": 0.05, "typical_p": 0.9, "repeat_penalty": 1.1, "mirostat_mode": 2, "mirostat_tau": 4.0}

# Every parameter of the SDK's `chat.completions.create`: the arguments that exercise it (with what it needs beside
# it), and None where it answers a 400 naming it, with a word of the reason it gives.
SDK_CHAT_FIELDS: dict[str, dict] = {
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"functions": [ADD], "function_call": "auto"},
    "functions": {"functions": [ADD]},
    "logit_bias": {"logit_bias": {"0": -5}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "max_tokens": {"max_tokens": 3},
    "metadata": {"metadata": PLATFORM["metadata"]},
    "modalities": {"modalities": ["text"]},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "n": {"n": 2},
    "parallel_tool_calls": {"tools": TOOLS, "parallel_tool_calls": False},
    "prediction": {"prediction": PLATFORM["prediction"]},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt_cache_key": {"prompt_cache_key": PLATFORM["prompt_cache_key"]},
    "prompt_cache_options": {"prompt_cache_options": PLATFORM["prompt_cache_options"]},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": PLATFORM["safety_identifier"]},
    "seed": {"seed": 7},
    "service_tier": {"service_tier": "flex"},
    "stop": {"stop": ["\n\n"]},
    "store": {"store": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    "temperature": {"temperature": 0.7},
    "tool_choice": {"tools": TOOLS, "tool_choice": "none"},
    "tools": {"tools": TOOLS},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.9},
    "user": {"user": "alice"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
}
# The fields whose ignoring would hand back something other than what was asked: a 400 that says why.
REFUSED = {"audio": "text only", "moderation": "moderation", "web_search_options": "web search"}
# The SDK's own arguments that are not request fields.
_NOT_FIELDS = {"self", "messages", "model", "extra_headers", "extra_query", "extra_body", "timeout"}


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    clouds = "".join(
        f"""
[clouds.{name}]
provider = "{provider}"
base_url = "{upstream.base_url}"
model = "{name}-model"
connect_timeout = 2
read_timeout = 5
"""
        for name, provider in (("oai", "openai"), ("llama", "llama-server"), ("vllm", "vllm"))
    )
    clouds += "[clouds.oai.price]\nprefill_per_million = 2.5\ndecode_per_million = 10.0\n"
    process = start_gateway(f"""
[gateway]
cloud = "oai"
fallback = false
[device]
model = "{SMOL}"
reproducible = true   # greedy text is compared across requests: one evaluation path
n_ctx = 2048
[disco]
migration = false
profile_device = false
{clouds}""")
    yield process
    stop_gateway(process)


@pytest.fixture(autouse=True)
def fresh_script(upstream: ScriptedUpstream) -> None:
    upstream.reset()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120)


def ignored(headers) -> set[str]:
    value = headers.get("x-tandem-ignored-fields", "")
    return {name.strip() for name in value.split(",") if name.strip()}


def test_the_sdk_chat_parameters_are_each_handled(gw):
    """Each parameter the SDK's create() takes is sent as the SDK sends it: answered, or refused for a reason."""
    params = set(inspect.signature(openai.resources.chat.completions.Completions.create).parameters) - _NOT_FIELDS
    unknown = params - set(SDK_CHAT_FIELDS)
    assert not unknown, f"the SDK defines request fields this test does not handle yet: {sorted(unknown)}"
    c = client(gw)
    for name in sorted(params):
        args = {"model": "device", "messages": MESSAGES, "max_tokens": 3, **SDK_CHAT_FIELDS[name]}
        if "max_completion_tokens" in args:
            del args["max_tokens"]
        if name in REFUSED:
            with pytest.raises(openai.BadRequestError) as refused:
                c.chat.completions.create(**args)
            assert refused.value.body["param"] == name, name
            assert REFUSED[name] in refused.value.body["message"], refused.value.body["message"]
            continue
        raw = c.chat.completions.with_raw_response.create(**args)
        answer = raw.parse()
        if args.get("stream"):
            chunks = list(answer)
            if name == "stream_options":
                assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
            else:
                assert chunks[-1].choices[0].finish_reason is not None
        else:
            assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls", "function_call"), name
        # On the device, a platform field it does not take is named in the header (user and metadata the trace keeps).
        expected = {name} if name in PLATFORM_FIELDS and name not in RECORDED_FIELDS else set()
        assert ignored(raw.headers) == expected, name
    # n > 1: every choice's endpoint counts.
    raw = c.chat.completions.with_raw_response.create(
        model="device", messages=MESSAGES, max_tokens=3, n=2, reasoning_effort="low"
    )
    assert len(raw.parse().choices) == 2 and ignored(raw.headers) == {"reasoning_effort"}


def test_modalities_with_audio_is_refused_saying_why(gw):
    with pytest.raises(openai.BadRequestError) as refused:
        client(gw).chat.completions.create(model="device", messages=MESSAGES, max_tokens=2, modalities=["audio"])
    assert refused.value.body["param"] == "modalities"
    assert "text only" in refused.value.body["message"]


def test_a_field_openai_does_not_define_is_still_refused_naming_it(gw):
    with pytest.raises(openai.BadRequestError) as refused:
        client(gw).chat.completions.create(
            model="device", messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": True}
        )
    assert refused.value.body["param"] == "frobnicate"


def test_the_device_applies_llamas_sampling_extras_and_ignores_the_platform_fields_visibly(gw):
    raw = client(gw).chat.completions.with_raw_response.create(
        model="device", messages=MESSAGES, max_tokens=4, extra_body=LLAMA, **PLATFORM
    )
    answer = raw.parse()
    assert ignored(raw.headers) == set(PLATFORM) - set(RECORDED_FIELDS)
    trace = httpx.get(f"{gw.v1}/requests/{answer.id}", timeout=10).json()
    assert trace["user"] == "alice" and trace["metadata"] == {"team": "qa"}
    assert set(trace["ignored_fields"]) == set(PLATFORM) - set(RECORDED_FIELDS)
    assert all("device" in why for why in trace["ignored_fields"].values())


def test_the_device_samples_under_min_p(gw):
    """min_p = 1 keeps only the likeliest token: a hot sampler then writes the greedy answer (on the reproducible
    path, so the two requests evaluate alike); without it, the same seed writes another."""
    c = client(gw)
    ask = {"model": "device", "messages": MESSAGES, "max_tokens": 16}
    greedy = c.chat.completions.create(**ask, temperature=0).choices[0].message.content
    hot = {**ask, "temperature": 2.0, "seed": 3}
    cut = c.chat.completions.create(**hot, extra_body={"min_p": 1.0}).choices[0].message.content
    free = c.chat.completions.create(**hot).choices[0].message.content
    assert cut == greedy != free


def test_openais_dialect_gets_every_platform_field_as_sent_and_no_llama_extra(gw, upstream):
    raw = client(gw).chat.completions.with_raw_response.create(
        model="oai", messages=MESSAGES, max_tokens=4, extra_body=LLAMA, **PLATFORM
    )
    raw.parse()
    (sent,) = upstream.requests
    assert sent.body["model"] == "oai-model"
    assert {k: sent.body.get(k) for k in PLATFORM} == PLATFORM
    assert not set(LLAMA) & set(sent.body)
    assert ignored(raw.headers) == set(LLAMA)


@pytest.mark.parametrize(
    ("cloud", "names"),
    [
        # llama-server's names: mirostat's mode is `mirostat` there.
        ("llama", {**{k: k for k in LLAMA}, "mirostat_mode": "mirostat"}),
        # vLLM takes top_k, min_p and repeat_penalty (as repetition_penalty), and reasoning_effort and user.
        ("vllm", {"top_k": "top_k", "min_p": "min_p", "repeat_penalty": "repetition_penalty"}),
    ],
)
def test_a_local_servers_dialect_gets_the_sampling_extras_in_its_own_names(gw, upstream, cloud, names):
    raw = client(gw).chat.completions.with_raw_response.create(
        model=cloud, messages=MESSAGES, max_tokens=4, extra_body=LLAMA, reasoning_effort="low", service_tier="flex"
    )
    raw.parse()
    (sent,) = upstream.requests
    assert {theirs: sent.body.get(theirs) for ours, theirs in names.items()} == {
        theirs: LLAMA[ours] for ours, theirs in names.items()
    }
    assert "service_tier" not in sent.body
    taken = set(names) | ({"reasoning_effort"} if cloud == "vllm" else set())
    assert ignored(raw.headers) == (set(LLAMA) | {"reasoning_effort", "service_tier"}) - taken


def test_a_device_level_request_forwards_nothing(gw, upstream):
    """Privacy `device`: the answer comes from the device, and no field of it reaches any upstream."""
    raw = client(gw).chat.completions.with_raw_response.create(
        model="tandem",
        messages=MESSAGES,
        max_tokens=4,
        extra_body={**LLAMA, "tandem": {"privacy": "device", "policy": "cloud"}},
        **PLATFORM,
    )
    raw.parse()
    assert raw.headers["x-tandem-backend"] == "device"
    assert upstream.requests == []


def test_the_deprecated_functions_api_calls_its_function(gw):
    """`functions` and a named `function_call` force the call on the device; the answer is a `function_call`."""
    c = client(gw)
    args = {
        "model": "device",
        "messages": [{"role": "user", "content": "What is 2 plus 3?"}],
        "max_tokens": 64,
        "temperature": 0,
        "functions": [ADD],
        "function_call": {"name": "add"},
    }
    whole = c.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call.name == "add" and choice.message.tool_calls is None
    assert isinstance(json.loads(choice.message.function_call.arguments), dict)
    chunks = list(c.chat.completions.create(**args, stream=True))
    calls = [ch.choices[0].delta.function_call for ch in chunks if ch.choices and ch.choices[0].delta.function_call]
    assert calls[0].name == "add"
    assert isinstance(json.loads("".join(call.arguments or "" for call in calls)), dict)
    assert chunks[-1].choices[0].finish_reason == "function_call"


# The SDK's `responses.create` parameters, as above (None: a 400 naming it with a word of its reason).
SDK_RESPONSES_FIELDS: dict[str, tuple[dict, str | None]] = {
    "access_programs": ({"access_programs": {"cyber": "standard"}}, None),
    "background": ({"background": True}, "stores none"),
    "background_options": ({"background_options": {"completion_window": "soonest"}}, None),
    "context_management": ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, None),
    "conversation": ({"conversation": "conv_123"}, "stateless"),
    "image": ({"image": {"context_compression": "auto"}}, None),
    "include": ({"include": ["reasoning.encrypted_content"]}, None),
    "instructions": ({"instructions": "Be brief."}, None),
    "max_output_tokens": ({"max_output_tokens": 3}, None),
    "max_tool_calls": ({"max_tool_calls": 2}, None),
    "metadata": ({"metadata": {"team": "qa"}}, None),
    "moderation": ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    "parallel_tool_calls": ({"parallel_tool_calls": False}, None),
    "previous_response_id": ({"previous_response_id": "resp_1"}, "stateless"),
    "prompt": ({"prompt": {"id": "pmpt_1"}}, "stateless"),
    "prompt_cache_key": ({"prompt_cache_key": "conversation-17"}, None),
    "prompt_cache_options": ({"prompt_cache_options": {"mode": "implicit", "ttl": "12h"}}, None),
    "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, None),
    "reasoning": ({"reasoning": {"effort": "low", "summary": "auto"}}, None),
    "safety_identifier": ({"safety_identifier": "user-5f1c"}, None),
    "service_tier": ({"service_tier": "flex"}, None),
    "store": ({"store": False}, None),
    "stream": ({"stream": True}, None),
    "stream_options": ({"stream": True, "stream_options": {"include_obfuscation": False}}, None),
    "temperature": ({"temperature": 0.7}, None),
    "text": ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, None),
    "tool_choice": ({"tools": [{"type": "function", **ADD}], "tool_choice": "none"}, None),
    "tools": ({"tools": [{"type": "function", **ADD}]}, None),
    "top_logprobs": ({"top_logprobs": 2}, None),
    "top_p": ({"top_p": 0.9}, None),
    "truncation": ({"truncation": "auto"}, None),
    "user": ({"user": "alice"}, None),
}
SDK_COMPLETIONS_FIELDS: dict[str, tuple[dict, str | None]] = {
    "best_of": ({"best_of": 2}, "n choices"),
    "echo": ({"echo": True}, "completion only"),
    "frequency_penalty": ({"frequency_penalty": 0.5}, None),
    "logit_bias": ({"logit_bias": {"0": -5}}, None),
    "logprobs": ({"logprobs": 2}, None),
    "max_tokens": ({"max_tokens": 3}, None),
    "n": ({"n": 2}, None),
    "presence_penalty": ({"presence_penalty": 0.5}, None),
    "seed": ({"seed": 7}, None),
    "stop": ({"stop": ["\n\n"]}, None),
    "stream": ({"stream": True}, None),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, None),
    "suffix": ({"suffix": "!"}, "forwards only"),
    "temperature": ({"temperature": 0.7}, None),
    "top_p": ({"top_p": 0.9}, None),
    "user": ({"user": "alice"}, None),
}


@pytest.mark.parametrize("api", ["responses", "completions"])
def test_the_sdk_responses_and_completions_parameters_are_each_handled(gw, api):
    from openai.resources.completions import Completions
    from openai.resources.responses import Responses

    create, table = {
        "responses": (Responses.create, SDK_RESPONSES_FIELDS),
        "completions": (Completions.create, SDK_COMPLETIONS_FIELDS),
    }[api]
    params = set(inspect.signature(create).parameters) - _NOT_FIELDS - {"input", "prompt"}
    if api == "responses":
        params.add("prompt")  # the Responses API's stored prompt template, not completions' prompt text
    unknown = params - set(table)
    assert not unknown, f"the SDK defines {api} request fields this test does not handle yet: {sorted(unknown)}"
    c = client(gw)
    resource = c.responses if api == "responses" else c.completions
    base = {"model": "device", "input": "Name one colour.", "max_output_tokens": 3}
    if api == "completions":
        base = {"model": "device", "prompt": "Colours: red,", "max_tokens": 3}
    for name in sorted(params):
        args, refused = table[name]
        args = {**base, **args}
        if refused is not None:
            with pytest.raises(openai.BadRequestError) as caught:
                resource.create(**args)
            assert caught.value.body["param"] == name, name
            assert refused in caught.value.body["message"], caught.value.body["message"]
            continue
        raw = resource.with_raw_response.create(**args)
        answer = raw.parse()
        if args.get("stream"):
            assert list(answer), name
        elif api == "responses":
            assert answer.status in ("completed", "incomplete"), name
        else:
            assert answer.choices[0].finish_reason in ("stop", "length"), name
        expected = set()
        if api == "responses" and name not in ("metadata", "user"):
            expected = {
                "include": {"include"},
                "top_logprobs": {"top_logprobs"},
                "max_tool_calls": {"max_tool_calls"},
                "context_management": {"context_management"},
                "access_programs": {"access_programs"},
                "image": {"image"},
                "background_options": {"background_options"},
                "truncation": {"truncation"},
                "reasoning": {"reasoning_effort", "reasoning.summary"},
                "text": {"verbosity"},
                "prompt_cache_key": {"prompt_cache_key"},
                "prompt_cache_options": {"prompt_cache_options"},
                "prompt_cache_retention": {"prompt_cache_retention"},
                "safety_identifier": {"safety_identifier"},
                "service_tier": {"service_tier"},
                "store": {"store"},
            }.get(name, set())
        assert ignored(raw.headers) == expected, name


# -- GET /v1/models ------------------------------------------------------------------------------------------------


def test_models_carry_what_serves_them_and_the_sdk_parses_them(gw):
    c = client(gw)
    models = {m.id: m for m in c.models.list().data}
    # Every name a request may use: the gateway's, each backend's name and model id, the embedding model.
    assert {"tandem", "device", SMOL, "oai", "oai-model", "llama", "vllm", "all-minilm-l6-v2"} <= set(models)
    device, oai = models["device"].model_dump(), models["oai-model"].model_dump()
    # Each model's own window: the device's n_ctx, a provider preset's (OpenAI's), the default where the upstream's
    # /v1/models reports none; the routed name's is the largest it may start on (the device and its cloud, oai).
    windows = {name: m.model_dump()["context_length"] for name, m in models.items()}
    assert windows["device"] == windows[SMOL] == 2048 and windows["oai"] == windows["tandem"] == 128_000
    assert windows["llama"] == windows["vllm"] == 32_768
    assert device["max_model_len"] == 2048 and device["locality"] == "device"
    assert models[SMOL].model_dump()["locality"] == "device"
    assert oai["locality"] == "cloud" and oai["endpoints"] == ["oai"]
    assert oai["pricing"] == {"prompt": "2.5e-06", "completion": "1e-05"}  # [clouds.oai.price], per token
    assert float(device["pricing"]["prompt"]) > 0  # the device's energy at λ
    assert device["capabilities"] == {
        "chat": True,
        "completions": True,
        "tools": True,
        "structured_output": True,
        "logprobs": True,
        "embeddings": False,
    }
    routed = models["tandem"].model_dump()
    assert routed["locality"] == "routed" and set(routed["endpoints"]) == {"device", "oai", "llama", "vllm"}
    embedder = models["all-minilm-l6-v2"].model_dump()
    assert embedder["capabilities"]["embeddings"] and not embedder["capabilities"]["chat"]
    # One model at a time, the same object; an unknown id is a 404 in the envelope.
    assert c.models.retrieve("oai-model").model_dump() == oai
    with pytest.raises(openai.NotFoundError) as missing:
        c.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
