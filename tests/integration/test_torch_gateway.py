"""The torch device backend behind the real gateway: the same OpenAI surface as llama.cpp."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import start_gateway, stop_gateway

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def torch_gateway():
    gw = start_gateway("""
[gateway]
policy = "device"
[device]
kind = "torch"
model = "smollm2-135m-instruct"
[disco]
profile_device = false
""")
    yield gw
    stop_gateway(gw)


def test_sdk_stream_and_non_stream_agree(torch_gateway):
    c = openai.OpenAI(base_url=torch_gateway.v1, api_key="x", max_retries=0, timeout=120)
    whole = c.chat.completions.create(model="tandem", messages=MESSAGES, max_tokens=10, temperature=0)
    text = whole.choices[0].message.content
    assert text.strip()
    assert whole.usage.completion_tokens == 10 or whole.choices[0].finish_reason == "stop"
    chunks = list(
        c.chat.completions.create(
            model="tandem",
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_disconnect_stops_torch_generation(torch_gateway):
    body = {"model": "device", "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream("POST", torch_gateway.v1 + "/chat/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    deadline = time.monotonic() + 5
    while torch_gateway.metric("tandem_backend_active_streams", backend="device") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert torch_gateway.metric("tandem_backend_active_streams", backend="device") == 0
    generated = torch_gateway.metric("tandem_backend_generated_tokens", backend="device")
    time.sleep(0.5)
    assert torch_gateway.metric("tandem_backend_generated_tokens", backend="device") == generated
