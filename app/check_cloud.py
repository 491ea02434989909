"""`tandem check-cloud NAME`: what a configured cloud really does when asked to continue an answer.

It sends the cloud one tiny fresh request, then one continuation in the cloud's dialect (clients/continuation.py):
the answer to "count from 1 to 20" already begun with "1, 2, 3, 4, 5,". The verdict says what the upstream did with
it: "continued" (it went on with 6), "restarted" (it began again from 1: it took the answer so far as history, so
this dialect does not continue there), "refused" (it answered with an error), or "unclear" (something else: the
text is printed). A preset (app/providers.py) is a guess about a provider; this checks it against the account and
model the config names. The requests go through the backend the gateway itself builds, so they are exactly what
migrations send. Exit status 0 when the cloud did what its dialect promises, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass

from app.config import CloudSettings, Settings
from app.embedded import EmbeddedServer
from app.serving.gateway import upstream_options
from clients.base import BackendError, GenerationRequest
from clients.chat_template import render_chat
from clients.gguf_meta import read_chat_template
from clients.openai_compat import OpenAICompatBackend
from deploy.models import resolve_model

GREETING = ({"role": "user", "content": "Say hello in five words."},)
COUNTING = ({"role": "user", "content": "Count from 1 to 20, separated by commas and spaces. Nothing else."},)
BEGUN = "1, 2, 3, 4, 5,"


@dataclass
class Outcome:
    verdict: str  # ok | continued | restarted | refused | unclear | not asked
    text: str
    seconds: float


def verdict_of(text: str) -> str:
    """What a continuation of BEGUN says about the upstream."""
    head = text.lstrip()
    if re.match(r"6\b", head):
        return "continued"
    if re.match(r"1\b", head) or "1, 2, 3" in text:
        return "restarted"
    return "unclear"


async def _ask(backend: OpenAICompatBackend, request: GenerationRequest) -> tuple[list[str], float]:
    """One answer's pieces of text, as the upstream sent them."""
    started = time.monotonic()
    pieces = [event.text async for event in backend.stream(request) if event.text]
    return pieces, time.monotonic() - started


def _request(messages, prefix: str, device_template: str | None) -> GenerationRequest:
    # The device's rendering of the prompt, which only a completions upstream with the device's tokenizer reads.
    prompt = render_chat(device_template, messages) if device_template else ""
    return GenerationRequest(prompt_text=prompt, messages=messages, prefix_text=prefix, max_tokens=12, temperature=0.0)


async def check(cloud: CloudSettings, device_template: str | None) -> tuple[Outcome, Outcome]:
    """(the fresh answer, the continuation) of a cloud, asked through the backend a gateway builds for it."""
    backend = OpenAICompatBackend("check", upstream_options(cloud))
    try:
        return await _check(backend, device_template)
    finally:
        await backend.close()


async def _check(backend: OpenAICompatBackend, device_template: str | None) -> tuple[Outcome, Outcome]:
    continuation = backend.dialect.continuation
    try:
        pieces, seconds = await _ask(backend, _request(GREETING, "", device_template))
        fresh = Outcome("ok", "".join(pieces), seconds)
    except BackendError as exc:
        fresh = Outcome("refused", str(exc), 0.0)
    if not continuation.continues:
        return fresh, Outcome("not asked", "continuation = 'chat': this cloud only starts answers", 0.0)
    try:
        pieces, seconds = await _ask(backend, _request(COUNTING, BEGUN, device_template))
        text = "".join(pieces)
        if continuation.echoes_prefill and pieces and pieces[0].startswith(BEGUN):
            # llama-server sends the prefill back first, in one piece (an answer begun again spells it token by
            # token); a migration's seam drops it (app/serving/seam.py).
            text = f"[{BEGUN} sent back, dropped]" + text[len(BEGUN) :]
            continued = Outcome(verdict_of(text[text.index("]") + 1 :]), text, seconds)
        else:
            continued = Outcome(verdict_of(text), text, seconds)
    except BackendError as exc:
        continued = Outcome("refused", str(exc), 0.0)
    return fresh, continued


def run(settings: Settings, name: str) -> int:
    cloud = settings.clouds.get(name)
    if cloud is None:
        print(f"no cloud {name!r} in [clouds] (configured: {', '.join(settings.clouds) or 'none'})", file=sys.stderr)
        return 2
    if cloud.kind != "openai":
        print(f"cloud {name!r} is a HAT cloud: it continues answers by token ids, nothing to check", file=sys.stderr)
        return 2
    server = None
    if cloud.embedded is not None:
        server = EmbeddedServer(cloud.embedded, resolve_model(cloud.embedded.model), alias=cloud.model)
        cloud = cloud.model_copy(update={"base_url": server.base_url})
    device_template = None
    if cloud.gateway_template:
        device_template = read_chat_template(resolve_model(settings.device.model))
    print(f"cloud {name!r}: {cloud.base_url}, model {cloud.model!r}, continuation = {cloud.continuation!r}")
    try:
        if server is not None:
            server.start()
            asyncio.run(server.wait_ready())
        fresh, continued = asyncio.run(check(cloud, device_template))
    finally:
        if server is not None:
            server.stop()
    print(f"  fresh answer:  {fresh.verdict} ({fresh.seconds:.2f} s) {fresh.text[:120]!r}")
    print(f"  continuation:  {continued.verdict} ({continued.seconds:.2f} s) after {BEGUN!r}: {continued.text[:120]!r}")
    expected = "not asked" if cloud.continuation == "chat" else "continued"
    if continued.verdict == "restarted":
        print("  the upstream took the answer so far as history: this dialect does not continue there")
    return 0 if fresh.verdict == "ok" and continued.verdict == expected else 1
