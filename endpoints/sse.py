"""An answer as server-sent events: one renderer of its deltas for chat and completions (n = 1 and n > 1), for
the Responses API and for the Anthropic Messages API, and the response that sends them.

`ChoiceRenderer` turns one choice's deltas into bytes, whatever the API: the opening (chat's role chunk, the
Responses API's `response.created`) goes out with the first content, text as it comes, each complete tool call
after the text before it, and the answer's last delta closes the choice. The bytes are the API's `Events`:
`ChatChunks` here, the Responses API's in endpoints/responses.py, the Messages API's in endpoints/anthropic.py.
Chunks are pre-rendered around the only part that changes per token (its text), because the relay's per-chunk cost
is the gateway's overhead on every token.

`stream_answer` (one choice) and `stream_choices` (n > 1, merged) drive a renderer; a failure after the first token
is the API's failure event, which ends the stream. `SSEResponse` sends the bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import anyio
from fastapi.responses import Response
from sse_starlette import ServerSentEvent

from app.serving.job import Job
from app.serving.relay import Delta
from app.serving.tool_calls import ToolCall
from clients.base import BackendError, TokenLogprob, Usage
from endpoints.logprobs import LogprobsRenderer

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
PING = ServerSentEvent(comment="ping", sep="\n").encode()  # b": ping\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Events(Protocol):
    """One API's events for one choice of a streamed answer, in the order `ChoiceRenderer` asks for them."""

    def opening(self) -> bytes:
        """What goes out with the first content."""

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes: ...

    def reasoning(self, text: str) -> bytes:
        """A reasoning model's thinking, as the endpoint sent it."""

    def tool_calls(self, calls: Sequence[ToolCall], first_index: int) -> bytes:
        """Complete calls; `first_index` counts this choice's calls before them."""

    def closing(self, text: str, finish: str, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes:
        """The choice's last text and its finish."""

    def end(self, usage: Usage) -> bytes:
        """After every choice's closing: what ends the stream."""

    def failure(self, exc: BaseException) -> bytes:
        """The answer failed after its first token: the event that ends the stream."""


class ChoiceRenderer:
    """One choice's deltas as its events' bytes."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self._head = events.opening()
        self._calls = 0  # tool calls sent so far

    def render(self, delta: Delta) -> bytes:
        """The bytes of one delta (empty while the relay holds everything back)."""
        if delta.finish_reason is None and not delta.tool_calls:  # the hot path: one token's text
            if not delta.text:
                if not delta.reasoning:
                    return b""
                out = b""
            else:
                out = self.events.text(delta.text, delta.logprobs)
        else:
            out = self._calls_and_closing(delta)
        if delta.reasoning:  # the thinking comes before the text it led to
            out = self.events.reasoning(delta.reasoning) + out
        if self._head:
            out, self._head = self._head + out, b""
        return out

    def _calls_and_closing(self, delta: Delta) -> bytes:
        events = self.events
        text, logprobs, out = delta.text, delta.logprobs, b""
        if delta.tool_calls:  # the text before the calls, the calls, then any finish in a chunk of its own
            if text:
                out = events.text(text, logprobs)
            out += events.tool_calls(delta.tool_calls, self._calls)
            self._calls += len(delta.tool_calls)
            text, logprobs = "", None
        if delta.finish_reason is not None:
            out += events.closing(text, delta.finish_reason, logprobs)
        return out

    def failure(self, exc: BaseException) -> bytes:
        """The opening, if it has not gone out yet, and the failure event."""
        out, self._head = self._head + self.events.failure(exc), b""
        return out


async def stream_answer(job: Job, first: Delta, stream: AsyncIterator[Delta], events: Events) -> AsyncIterator[bytes]:
    """One choice's bytes. The opening goes out with the first content, the last chunk with the stream's end
    (which `SSEResponse` sends with the end of the body): one write, one wake-up of the client."""
    try:
        choice = ChoiceRenderer(events)
        delta = first
        while delta.finish_reason is None:
            chunk = choice.render(delta)
            if chunk:
                yield chunk
            try:
                delta = await anext(stream)
            except Exception as exc:  # the orchestrator raises BackendError; anything else is a bug, still framed
                log.warning("request %s failed mid-stream: %s", job.id, exc)
                yield choice.failure(exc)
                return
        yield choice.render(delta) + events.end(job.usage)
    finally:
        # Client gone or done: stop the backend's work now (llama.cpp thread, upstream HTTP).
        with anyio.CancelScope(shield=True):
            await stream.aclose()


async def stream_choices(
    request_id: str,
    first: tuple[int, Delta | BaseException],
    merged: AsyncIterator[tuple[int, Delta | BaseException]],
    events: list[Events],
    usage: Callable[[], Usage],
) -> AsyncIterator[bytes]:
    """n choices' bytes as their deltas come (`merged`: each tagged with its choice's index; a choice's failure is
    its exception, which ends the stream)."""
    try:
        choices = [ChoiceRenderer(e) for e in events]
        i, delta = first
        while True:
            if isinstance(delta, BaseException):
                log.warning("request %s: choice %d failed mid-stream: %s", request_id, i, delta)
                yield events[i].failure(delta)  # the stream's end, not the choice's: no opening owed before it
                return
            chunk = choices[i].render(delta)
            if chunk:
                yield chunk
            try:
                i, delta = await anext(merged)
            except StopAsyncIteration:
                break
        yield events[0].end(usage())
    finally:
        with anyio.CancelScope(shield=True):
            await merged.aclose()


def _error_body(exc: BaseException) -> dict:
    status = exc.status if isinstance(exc, BackendError) else 500
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": str(exc), "type": kind, "param": None, "code": f"backend_{status}"}}


class ChatChunks:
    """Chat's and completions' events for one choice: pre-rendered JSON around the text. The stream ends with the
    usage chunk (when asked) and [DONE]; a failure is an error event in the OpenAI envelope, then [DONE]."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        include_usage: bool,
        index: int = 0,
        logprobs: bool = False,
        functions_api: bool = False,
    ) -> None:
        self.request_id = request_id
        # A request in the deprecated functions API gets its call as a `function_call` delta, finish "function_call".
        self.functions_api = functions_api
        self.chat = chat
        self.include_usage = include_usage
        self._object = "chat.completion.chunk" if chat else "text_completion"
        usage = ',"usage":null' if include_usage else ""
        self._head = f'data: {{"id":"{request_id}","object":"{self._object}","created":{int(time.time())},"model":{json.dumps(model)},"system_fingerprint":null,"choices":[{{"index":{index},'  # noqa: E501
        self._tail = f'"logprobs":null,"finish_reason":%s}}]{usage}}}\n\n'
        # Only when logprobs are asked: the chunk's logprobs object in place of null.
        self._lp_tail = f'"logprobs":%s,"finish_reason":%s}}]{usage}}}\n\n'
        self._logprobs = LogprobsRenderer(chat) if logprobs else None
        self._model = model

    def opening(self) -> bytes:
        if not self.chat:
            return b""
        return (self._head + '"delta":{"role":"assistant","content":""},' + self._tail % "null").encode()

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] | None = None, finish: str | None = None) -> bytes:
        fin = "null" if finish is None else f'"{finish}"'
        body = f'"delta":{{"content":{json.dumps(text)}}},' if self.chat else f'"text":{json.dumps(text)},'
        if self.chat and finish is not None and not text:
            body = '"delta":{},'
        if self._logprobs is not None and (logprobs or text):
            return (self._head + body + self._lp_tail % (self._logprobs.json(logprobs or ()), fin)).encode()
        return (self._head + body + self._tail % fin).encode()

    def reasoning(self, text: str) -> bytes:
        """Chat's `reasoning_content` delta (DeepSeek's field, which OpenAI-compatible clients read); completions
        have no place for it."""
        if not self.chat:
            return b""
        return (self._head + f'"delta":{{"reasoning_content":{json.dumps(text)}}},' + self._tail % "null").encode()

    def tool_calls(self, calls: Sequence[ToolCall], first_index: int) -> bytes:
        """Each complete call as two chunks, as OpenAI streams them: its id and name, then its arguments."""
        out = []
        for i, call in enumerate(calls, first_index):
            if self.functions_api:
                pieces = [{"function_call": {"name": call.name, "arguments": ""}}]
                pieces.append({"function_call": {"arguments": call.arguments}})
            else:
                head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
                pieces = [
                    {"tool_calls": [head]},
                    {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]},
                ]
            for piece in pieces:
                delta = json.dumps(piece, separators=(",", ":"), ensure_ascii=False)
                out.append(self._head + f'"delta":{delta},' + self._tail % "null")
        return "".join(out).encode()

    def closing(self, text: str, finish: str, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes:
        if self.functions_api and finish == "tool_calls":
            finish = "function_call"
        return self.text(text, logprobs, finish)

    def end(self, usage: Usage) -> bytes:
        return (self._usage(usage) if self.include_usage else b"") + DONE

    @staticmethod
    def failure(exc: BaseException) -> bytes:
        return ("data: " + json.dumps(_error_body(exc)) + "\n\n").encode() + DONE

    def _usage(self, u: Usage) -> bytes:
        return (
            "data: "
            + json.dumps(
                {
                    "id": self.request_id,
                    "object": self._object,
                    "created": int(time.time()),
                    "model": self._model,
                    "system_fingerprint": None,
                    "choices": [],
                    "usage": usage_object(u),
                },
                separators=(",", ":"),
            )
            + "\n\n"
        ).encode()


def usage_object(u: Usage) -> dict:
    """OpenAI's usage object, with the parts providers bill apart (cached prompt tokens, reasoning tokens)."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


class SSEResponse(Response):
    """text/event-stream over raw ASGI, with only the concurrency it needs: the stream runs in the request's
    own task; one watcher task turns a client disconnect into cancelling it and sends `: ping` comments when
    the stream has been quiet for `ping` seconds. sse-starlette's EventSourceResponse starts a task group of
    four tasks per response, which under load cost the first token tens of milliseconds (BENCHMARKS.md).
    `last` says which chunk ends the stream (chat's ends with [DONE]), so the body's end goes in its write;
    `keepalive` is what a ping sends (an API may name its own event for it)."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: dict[str, str],
        ping: float,
        last: Callable[[bytes], bool] = lambda chunk: chunk.endswith(DONE),
        keepalive: bytes = PING,
    ) -> None:
        self.stream = body
        self.ping = ping
        self.last = last
        self.keepalive = keepalive
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in {**_HEADERS, **headers}.items()
        ]

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        streamer = asyncio.current_task()
        lock = asyncio.Lock()
        last = loop.time()
        gone = False

        async def watch() -> None:
            nonlocal gone, last
            while True:
                try:
                    async with asyncio.timeout(max(0.0, last + self.ping - loop.time())):
                        message = await receive()
                except TimeoutError:
                    if loop.time() - last >= self.ping:
                        async with lock:
                            await send({"type": "http.response.body", "body": self.keepalive, "more_body": True})
                        last = loop.time()
                    continue
                if message["type"] == "http.disconnect":
                    gone = True
                    streamer.cancel()
                    return

        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        watcher = loop.create_task(watch())
        try:
            async for chunk in self.stream:
                end = self.last(chunk)  # nothing follows the last event: the body's end goes in the same write
                async with lock:
                    await send({"type": "http.response.body", "body": chunk, "more_body": not end})
                if end:
                    break
                last = loop.time()
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            streamer.uncancel()  # the client left: a normal end for us, not a cancelled server
        finally:
            watcher.cancel()
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()
