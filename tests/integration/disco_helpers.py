"""Helpers for the live DiSCo tests: stream with the SDK, read traces, and check that a
migrated answer continues byte for byte from what the client had already received."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from functools import cache

import httpx
import openai

from clients.chat_template import render_chat
from deploy.models import model_path


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=180)


def stream_chunks(gw, messages, policy: str | None = None, max_tokens: int = 32, on_chunk=None, **kw):
    """Stream a chat answer; returns (request id, list of content pieces, finish_reason)."""
    extra = {"tandem": {"policy": policy}} if policy else None
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="tandem", messages=messages, max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra, **kw
    )
    request_id = raw.headers["x-request-id"]
    pieces, finish = [], None
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        piece = chunk.choices[0].delta.content
        if piece:
            pieces.append(piece)
            if on_chunk is not None:
                on_chunk(len(pieces))
        finish = chunk.choices[0].finish_reason or finish
    return request_id, pieces, finish


def trace(gw, request_id: str, patience: float = 0.0, key: str | None = None) -> dict:
    """The request's trace, read with API key `key` where the gateway has keys; `patience`: seconds to wait for it
    to be kept (a request the client left is kept once the gateway has seen the disconnect and stopped its backends,
    after the client's side has closed)."""
    headers = {"authorization": f"Bearer {key}"} if key else None
    deadline = time.monotonic() + patience
    r = httpx.get(f"{gw.v1}/requests/{request_id}", headers=headers, timeout=10)
    while r.status_code == 404 and time.monotonic() < deadline:
        time.sleep(0.1)
        r = httpx.get(f"{gw.v1}/requests/{request_id}", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()


def endpoints(t: dict, name: str = "backend") -> list[tuple[str, str]]:
    """(name, outcome) of each endpoint a traced answer went through, in order; `name`: the entry's "backend" (the
    configured backend's name) or "endpoint" (its role in the answer)."""
    return [(e[name], e["outcome"]) for e in t["endpoints"]]


QWEN = "qwen2.5-coder-0.5b-instruct"


@cache
def _template(model: str = QWEN) -> str:
    from llama_cpp import Llama

    vocab = Llama(str(model_path(model)), vocab_only=True, verbose=False)
    return vocab.metadata["tokenizer.chat_template"]


def rendered(messages, model: str = QWEN) -> str:
    """The chat prompt exactly as the gateway renders it (the device model's own template)."""
    return render_chat(_template(model), messages)


def evict_cache(gw, backend: str, headers: dict | None = None) -> None:
    """Leave `backend`'s KV cache holding an unrelated one-word prompt, so that its next request is evaluated from
    position 0. Greedy text is bit-identical only along the same computation path, and the llama.cpp server behind
    a stand-in cloud reuses the longest prefix it holds: two requests for the same input follow the same path only
    from the same cache state. (A device backend with `reproducible = true` needs none of this.)"""
    r = httpx.post(
        gw.v1 + "/completions",
        json={"model": backend, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
        headers=headers,
        timeout=180,
    )
    r.raise_for_status()


def independent_continuation(
    gw, backend: str, messages, prefix: str, max_tokens: int, headers: dict | None = None, model: str = QWEN
) -> str:
    """What `backend` generates greedily after prompt + prefix, asked directly (no migration), from an evicted cache:
    the path a migration onto it took when the test evicted its cache before the migrating request. `headers`: the
    gateway's API key, where it has keys; `model`: the device model, whose template renders the prompt."""
    evict_cache(gw, backend, headers)
    prompt = rendered(messages, model) + prefix
    r = httpx.post(
        gw.v1 + "/completions",
        json={"model": backend, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=headers,
        timeout=180,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def embedded_server_pid(gw) -> int:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(gw.process.pid)], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "llama_cpp.server" in args:
            return int(pid)
    raise AssertionError(f"no embedded cloud server under gateway {gw.process.pid}:\n{out.stdout}")


def signal_process(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)


def signal_at(pid: int, sig: signal.Signals, chunk: int) -> tuple[Callable[[int], None], threading.Event]:
    """A streaming callback (called with the count of chunks received) that sends `sig` to `pid` once `chunk`
    chunks have arrived, and the event that says it did."""
    sent = threading.Event()

    def on_chunk(n: int) -> None:
        if n == chunk and not sent.is_set():
            signal_process(pid, sig)
            sent.set()

    return on_chunk, sent
