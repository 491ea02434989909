"""The real `openai` SDK against a real gateway: llama.cpp device model + loopback cloud server.

Greedy text is compared across requests along one computation path: the device runs in the reproducible mode
(conftest's `gateway`), and the embedded cloud (llama-cpp-python's server) is asked each compared prompt from
position 0 (`from_position_0`, or prompts that share no first token).
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.integration.disco_helpers import evict_cache

PROMPT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120)


def aclient(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120)


def from_position_0(gw, model: str) -> None:
    """The embedded cloud keeps the longest prefix its KV cache shares with the next prompt and evaluates only the
    rest (a repeated prompt: its last token alone, not in the prompt's batch): an unrelated prompt first makes the
    next one evaluated from position 0, as the one it is compared with was. The reproducible device needs nothing."""
    if model == "cloud":
        evict_cache(gw, "cloud")


@pytest.mark.parametrize("model", ["device", "cloud"])
def test_sync_non_stream_and_stream_agree(gateway, model):
    c = client(gateway)
    from_position_0(gateway, model)
    whole = c.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0, seed=1)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text.strip()
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 10
    assert 0 < whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    from_position_0(gateway, model)
    chunks = list(
        c.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0, seed=1, stream=True)
    )
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    assert all(len(ch.choices) == 1 for ch in chunks), "no empty-choices chunk without include_usage"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert streamed == text  # greedy: one answer, whichever way it is delivered


async def test_async_stream_with_usage(gateway):
    c = aclient(gateway)
    stream = await c.chat.completions.create(
        model="tandem",
        messages=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch async for ch in stream]
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert all(ch.usage is None and len(ch.choices) == 1 for ch in body)
    assert body[-1].choices[0].finish_reason == "length"
    await c.close()


async def test_async_non_stream(gateway):
    c = aclient(gateway)
    r = await c.chat.completions.create(model="tandem", messages=PROMPT, max_completion_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    await c.close()


def test_policy_extension_routes_to_cloud(gateway):
    c = client(gateway)
    raw = c.chat.completions.with_raw_response.create(
        model="tandem", messages=PROMPT, max_tokens=4, temperature=0, extra_body={"tandem": {"policy": "cloud"}}
    )
    assert raw.headers["x-tandem-backend"] == "cloud"
    assert raw.headers["x-request-id"].startswith("chatcmpl-")
    raw = c.chat.completions.with_raw_response.create(model="tandem", messages=PROMPT, max_tokens=4, temperature=0)
    assert raw.headers["x-tandem-backend"] == "device"


@pytest.mark.parametrize("model", ["device", "cloud"])
def test_stop_sequence_is_cut_and_hidden(gateway, model):
    c = client(gateway)
    from_position_0(gateway, model)
    full = c.chat.completions.create(model=model, messages=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    # Pick a stop string from the middle of the known greedy answer.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[: text.index(stop)]
    for stream in (False, True):
        from_position_0(gateway, model)
        r = c.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\u2603never"], stream=stream
        )
        if stream:
            chunks = list(r)
            got = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == cut
        assert finish == "stop"


def test_seeded_sampling_is_reproducible(gateway):
    c = client(gateway)
    kwargs = dict(model="device", messages=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    a = c.chat.completions.create(**kwargs).choices[0].message.content
    b = c.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_models_list(gateway):
    models = {m.id for m in client(gateway).models.list()}
    assert {"tandem", "device", "cloud", "qwen2.5-coder-0.5b-instruct"} <= models  # device and cloud share a model


@pytest.mark.parametrize("model", ["device", "cloud"])
def test_completions_stream_and_non_stream(gateway, model):
    c = client(gateway)
    from_position_0(gateway, model)
    r = c.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert 0 < r.usage.completion_tokens <= 8
    from_position_0(gateway, model)
    chunks = list(
        c.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=8, temperature=0, stream=True)
    )
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


def test_completions_token_id_prompt(gateway):
    from llama_cpp import Llama

    from deploy.models import model_path

    vocab = Llama(str(model_path("qwen2.5-coder-0.5b-instruct")), vocab_only=True, verbose=False)
    ids = vocab.tokenize(b"def add(a, b):", add_bos=False)
    c = client(gateway)
    as_text = c.completions.create(model="device", prompt="def add(a, b):", max_tokens=6, temperature=0)
    as_ids = c.completions.create(model="device", prompt=ids, max_tokens=6, temperature=0)
    assert as_ids.usage.prompt_tokens == len(ids) == as_text.usage.prompt_tokens
    assert as_ids.choices[0].text == as_text.choices[0].text


# Names with sixteen different first letters: no two prompts share their first token, so the embedded cloud, which
# keeps the prefix its cache shares with the next prompt, evaluates each of them from position 0 whatever came before.
NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Karl Laura Mike Nina Oscar Peggy".split()


async def test_sixteen_concurrent_streams(gateway):
    """16 streams at once, half on each endpoint, each with its own prompt: every answer must
    equal the same prompt answered alone (no cross-talk between queued requests)."""
    c = aclient(gateway)

    def prompt(i: int) -> str:
        return f"{NAMES[i]} has {i} apples. How many apples does {NAMES[i]} have? Answer:"

    async def one(i: int) -> str:
        model = "device" if i % 2 else "cloud"
        stream = await c.completions.create(model=model, prompt=prompt(i), max_tokens=6, temperature=0, stream=True)
        parts = [ch.choices[0].text async for ch in stream]
        return "".join(parts)

    together = await asyncio.gather(*(one(i) for i in range(16)))
    alone = [await one(i) for i in (3, 4, 11, 12)]
    assert [together[i] for i in (3, 4, 11, 12)] == alone
    assert all(t.strip() for t in together)
    assert sum(str(i) in t for i, t in enumerate(together)) >= 12  # the models do follow the prompt
    await c.close()
