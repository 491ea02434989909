"""/v1/chat/completions, /v1/completions and /v1/models, on the OpenAI wire contract.

The HTTP status is held until the first token exists: a failure before it is a
real HTTP error in the OpenAI envelope (or a failover inside the orchestrator);
a failure after it is an SSE `data: {"error": ...}` event followed by [DONE].
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import NamedTuple

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from app.serving.job import Job
from app.serving.orchestrator import Delta
from clients.base import BackendError, TokenLogprob, Usage
from endpoints.auth import require_api_key
from endpoints.errors import ApiError
from endpoints.logprobs import LogprobsRenderer
from endpoints.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"
_PING = ServerSentEvent(comment="ping", sep="\n").encode()  # b": ping\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _gateway(request: Request):
    return request.app.state.gateway


router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def _error_body(exc: BaseException) -> dict:
    status = exc.status if isinstance(exc, BackendError) else 500
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": str(exc), "type": kind, "param": None, "code": f"backend_{status}"}}


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. FastAPI has read the body already, so the
    next ASGI message can only be `http.disconnect`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _while_connected(request: Request, work: Awaitable, what: str):
    """The result of `work`, unless the client disconnects first: then `work` is cancelled (a request nobody
    waits for must not keep a model busy) and the answer is a 499. Before a streamed response starts, and for
    the whole of a non-streamed one, nothing else watches the connection. `work` runs in this task, not a task
    of its own: a hop through the event loop less on the first token's path."""
    task = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _client_gone(request)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (server shutdown): not ours to turn into an answer
        task.uncancel()
        raise ApiError(499, f"client closed the request {what}") from None
    finally:
        watcher.cancel()


def _headers(job: Job) -> dict[str, str]:
    return {"x-request-id": job.id, "x-tandem-backend": job.backend or ""}


def _before_first(exc: BackendError, request_id: str) -> ApiError:
    retry = exc.status >= 500 and exc.status != 501
    return ApiError(
        exc.status,
        str(exc),
        code="backend_error" if exc.status >= 500 else "invalid_request",
        retry=retry,
        headers={"x-request-id": request_id},
    )


async def _begin(request: Request, job: Job) -> tuple[Delta, AsyncIterator[Delta]]:
    """Start the answer and wait for its first token (an error before it is a real HTTP error, carrying the
    id of its trace): (first delta, the rest of the stream)."""
    stream = _gateway(request).answer(job)
    try:
        return await _while_connected(request, anext(stream), "before the first token"), stream
    except ApiError as exc:
        exc.headers["x-request-id"] = job.id
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise
    except BackendError as exc:
        await stream.aclose()
        raise _before_first(exc, job.id) from exc


class _Chunks:
    """Pre-rendered JSON around the only part that changes per chunk (the text), because
    the relay's per-chunk cost is the gateway's overhead on every token.

    The events of one stream, as `_sse` asks for them: `opening()` goes out with the first text, `text(t)` for
    each delta, then `closing(t, finish)` or `failure(exc)`, each ending the stream (endpoints/responses.py has
    the Responses API's)."""

    def __init__(self, job: Job, model: str, chat: bool, include_usage: bool, index: int = 0, logprobs: bool = False):
        self.job = job
        self.chat = chat
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage = ',"usage":null' if include_usage else ""
        self._head = f'data: {{"id":"{job.id}","object":"{obj}","created":{int(time.time())},"model":{json.dumps(model)},"system_fingerprint":null,"choices":[{{"index":{index},'  # noqa: E501
        self._tail = f'"logprobs":null,"finish_reason":%s}}]{usage}}}\n\n'
        # Only when logprobs are asked: the chunk's logprobs object in place of null.
        self._lp_tail = f'"logprobs":%s,"finish_reason":%s}}]{usage}}}\n\n'
        self._logprobs = LogprobsRenderer(chat) if logprobs else None
        self._model = model

    def role(self) -> bytes:
        return (self._head + '"delta":{"role":"assistant","content":""},' + self._tail % "null").encode()

    def text(self, text: str, finish: str | None = None, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes:
        fin = "null" if finish is None else f'"{finish}"'
        body = f'"delta":{{"content":{json.dumps(text)}}},' if self.chat else f'"text":{json.dumps(text)},'
        if self.chat and finish is not None and not text:
            body = '"delta":{},'
        if self._logprobs is not None and (logprobs or text):
            return (self._head + body + self._lp_tail % (self._logprobs.json(logprobs or ()), fin)).encode()
        return (self._head + body + self._tail % fin).encode()

    def tool_calls(self, calls, first_index: int) -> bytes:
        """Each complete call as two chunks, as OpenAI streams them: its id and name, then its arguments."""
        out = []
        for i, call in enumerate(calls, first_index):
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            for piece in (head, {"index": i, "function": {"arguments": call.arguments}}):
                delta = json.dumps({"tool_calls": [piece]}, separators=(",", ":"), ensure_ascii=False)
                out.append(self._head + f'"delta":{delta},' + self._tail % "null")
        return "".join(out).encode()

    def opening(self) -> bytes:
        return self.role() if self.chat else b""

    def closing(self, text: str, finish: str, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes:
        return self.text(text, finish, logprobs) + (self.usage() if self.include_usage else b"") + _DONE

    @staticmethod
    def failure(exc: BaseException) -> bytes:
        return ("data: " + json.dumps(_error_body(exc)) + "\n\n").encode() + _DONE

    def usage(self, u: Usage | None = None) -> bytes:
        u = u or self.job.usage
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return (
            "data: "
            + json.dumps(
                {
                    "id": self.job.id,
                    "object": obj,
                    "created": int(time.time()),
                    "model": self._model,
                    "system_fingerprint": None,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "total_tokens": u.total_tokens,
                    },
                },
                separators=(",", ":"),
            )
            + "\n\n"
        ).encode()


async def _sse(job: Job, first: Delta, stream: AsyncIterator[Delta], events) -> AsyncIterator[bytes]:
    """The stream's bytes, rendered by `events` (a `_Chunks`, or the Responses API's events)."""
    try:
        # The opening (chat's role chunk) goes out with the first token's chunk, and the last one with the usage
        # chunk and [DONE] (which `_SSEResponse` sends with the end of the body): one write, one wake-up of the
        # client.
        head = events.opening()
        delta = first
        calls = 0
        while delta.finish_reason is None:
            if delta.text:
                yield head + events.text(delta.text, logprobs=delta.logprobs)
                head = b""
            if delta.tool_calls:
                yield head + events.tool_calls(delta.tool_calls, calls)
                head, calls = b"", calls + len(delta.tool_calls)
            try:
                delta = await anext(stream)
            except Exception as exc:  # the orchestrator raises BackendError; anything else is a bug, still framed
                log.warning("request %s failed mid-stream: %s", job.id, exc)
                yield head + events.failure(exc)
                return
        text = delta.text
        if delta.tool_calls:  # the last calls, then a finish chunk of its own
            head += (events.text(text) if text else b"") + events.tool_calls(delta.tool_calls, calls)
            text = ""
        yield head + events.closing(text, delta.finish_reason, delta.logprobs)
    finally:
        # Client gone or done: stop the backend's work now (llama.cpp thread, upstream HTTP).
        with anyio.CancelScope(shield=True):
            await stream.aclose()


class _SSEResponse(Response):
    """text/event-stream over raw ASGI, with only the concurrency it needs: the stream runs in the request's
    own task; one watcher task turns a client disconnect into cancelling it and sends `: ping` comments when
    the stream has been quiet for `ping` seconds. sse-starlette's EventSourceResponse starts a task group of
    four tasks per response, which under load cost the first token tens of milliseconds (BENCHMARKS.md).
    `last` says which chunk ends the stream (chat's ends with [DONE]), so the body's end goes in its write."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: dict[str, str],
        ping: float,
        last: Callable[[bytes], bool] = lambda chunk: chunk.endswith(_DONE),
    ) -> None:
        self.stream = body
        self.ping = ping
        self.last = last
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
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
                            await send({"type": "http.response.body", "body": _PING, "more_body": True})
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


def _sse_response(request: Request, job: Job, body: AsyncIterator[bytes], **kw) -> _SSEResponse:
    ping = _gateway(request).settings.gateway.ping_seconds
    return _SSEResponse(body, {**_SSE_HEADERS, **_headers(job)}, ping, **kw)


class _Collected(NamedTuple):
    """A whole answer, read to its end."""

    text: str
    finish: str
    logprobs: list[TokenLogprob]
    calls: list


async def _collect(job: Job, first: Delta, stream: AsyncIterator[Delta]) -> _Collected:
    parts = [first.text]
    logprobs = list(first.logprobs or ())
    calls = list(first.tool_calls)
    delta = first
    try:
        while delta.finish_reason is None:
            delta = await anext(stream)
            parts.append(delta.text)
            calls += delta.tool_calls
            if delta.logprobs:
                logprobs.extend(delta.logprobs)
    except BackendError as exc:
        raise ApiError(
            exc.status, f"the answer failed midway: {exc}", code="backend_error", headers={"x-request-id": job.id}
        ) from exc
    finally:
        await stream.aclose()
    return _Collected("".join(parts), delta.finish_reason, logprobs, calls)


def _usage(job: Job | Usage) -> dict:
    u = job.usage if isinstance(job, Job) else job
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}


def _choice(body, chat: bool, index: int, answer: _Collected) -> dict:
    text, finish, logprobs, calls = answer
    if chat:
        message = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        choice = {"index": index, "message": message}
    else:
        choice = {"index": index, "text": text}
    lp = LogprobsRenderer(chat).obj(logprobs) if body.logprobs_top is not None else None
    return {**choice, "logprobs": lp, "finish_reason": finish}


def _completion(body, chat: bool, request_id: str, choices: list[dict], usage: Usage, backends: str) -> JSONResponse:
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": _usage(usage),
        },
        headers={"x-request-id": request_id, "x-tandem-backend": backends},
    )


async def _answer(request: Request, body, job: Job, chat: bool):
    """Stream or collect one answer; the first token decides between an HTTP error and a 200."""
    if body.choices > 1:
        return await _answer_choices(request, body, job, chat)
    first, stream = await _begin(request, job)
    if body.stream:
        chunks = _Chunks(job, body.model, chat, body.include_usage, logprobs=body.logprobs_top is not None)
        return _sse_response(request, job, _sse(job, first, stream, chunks))
    answer = await _while_connected(request, _collect(job, first, stream), "mid-answer")
    return _completion(body, chat, job.id, [_choice(body, chat, 0, answer)], job.usage, job.backend or "")


# -- n > 1: each choice is a job of its own (ids `<request id>-<index>`), on whichever endpoint serves it ------------


def _summed_usage(jobs: list[Job]) -> Usage:
    """The prompt counts once (as OpenAI counts it); the completions add up."""
    return Usage(jobs[0].usage.prompt_tokens, sum(j.usage.completion_tokens for j in jobs))


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta | BaseException]]:
    """The choices' deltas as they come, tagged with their index; a choice's failure is yielded as its exception.
    One task per choice reads its stream (a llama.cpp device computes a token only once the last was read);
    closing this iterator cancels them all and closes every stream (the backends' work stops)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException) or item.finish_reason is not None:
                left -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _sse_choices(
    request_id: str, jobs: list[Job], first, merged, chunks: list[_Chunks], include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        heads = [c.role() if c.chat else b"" for c in chunks]  # each choice's role chunk goes with its first text
        calls = [0] * len(chunks)
        i, delta = first
        while True:
            if isinstance(delta, BaseException):
                log.warning("request %s: choice %d failed mid-stream: %s", request_id, i, delta)
                yield ("data: " + json.dumps(_error_body(delta)) + "\n\n").encode() + _DONE
                return
            if delta.tool_calls:
                head = heads[i] + (chunks[i].text(delta.text, None, delta.logprobs) if delta.text else b"")
                yield head + chunks[i].tool_calls(delta.tool_calls, calls[i])
                heads[i], calls[i] = b"", calls[i] + len(delta.tool_calls)
                delta = replace(delta, text="", logprobs=None)
            if delta.text or delta.finish_reason is not None:
                yield heads[i] + chunks[i].text(delta.text, delta.finish_reason, delta.logprobs)
                heads[i] = b""
            try:
                i, delta = await anext(merged)
            except StopAsyncIteration:
                break
        yield (chunks[0].usage(_summed_usage(jobs)) if include_usage else b"") + _DONE
    finally:
        with anyio.CancelScope(shield=True):
            await merged.aclose()


async def _answer_choices(request: Request, body, job: Job, chat: bool):
    """n answers to one request. The first token of any choice decides between an HTTP error and a 200; a
    choice that fails later is an SSE error event (streamed) or an error answer (not streamed)."""
    orchestrator = _gateway(request).orchestrator
    jobs = [job.choice(i) for i in range(body.choices)]
    if body.stream:
        merged = _merge([orchestrator.generate(j) for j in jobs])
        try:
            first = await _while_connected(request, anext(merged), "before the first token")
        except ApiError as exc:
            exc.headers["x-request-id"] = job.id
            with anyio.CancelScope(shield=True):
                await merged.aclose()
            raise
        if isinstance(first[1], BaseException):
            await merged.aclose()
            exc = first[1]
            if not isinstance(exc, BackendError):
                exc = BackendError(f"internal error: {exc}", 500)
            raise _before_first(exc, job.id) from exc
        lp = body.logprobs_top is not None
        chunks = [_Chunks(job, body.model, chat, body.include_usage, index=i, logprobs=lp) for i in range(len(jobs))]
        headers = {**_SSE_HEADERS, "x-request-id": job.id, "x-tandem-backend": jobs[first[0]].backend or ""}
        body_iter = _sse_choices(job.id, jobs, first, merged, chunks, body.include_usage)
        return _SSEResponse(body_iter, headers, _gateway(request).settings.gateway.ping_seconds)

    async def one(j: Job):
        stream = orchestrator.generate(j)
        try:
            first = await anext(stream)
        except BackendError as exc:
            await stream.aclose()
            raise _before_first(exc, job.id) from exc
        return await _collect(j, first, stream)

    async def all_choices():
        tasks = [asyncio.ensure_future(one(j)) for j in jobs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = await _while_connected(request, all_choices(), "mid-answer")
    except ApiError as exc:
        exc.headers["x-request-id"] = job.id
        raise
    choices = [_choice(body, chat, i, r) for i, r in enumerate(results)]
    backends = ",".join(dict.fromkeys(j.backend or "" for j in jobs))
    return _completion(body, chat, job.id, choices, _summed_usage(jobs), backends)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    job = await _gateway(request).prepare_chat(body, request.state.key_privacy)
    return await _answer(request, body, job, chat=True)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    job = await _gateway(request).prepare_completion(body, request.state.key_privacy)
    return await _answer(request, body, job, chat=False)


@router.get("/requests/{request_id}")
async def request_trace(request_id: str, request: Request):
    """The trace of a recent request: plan, endpoints and timings, migrations, cost."""
    traces = _gateway(request).orchestrator.traces
    trace = traces.get(request_id)
    if trace is None and f"{request_id}-0" in traces:  # a request with n > 1: one trace per choice
        choices = []
        while (t := traces.get(f"{request_id}-{len(choices)}")) is not None:
            choices.append(t)
        trace = {"id": request_id, "choices": choices}
    if trace is None:
        raise ApiError(
            404,
            f"No trace for request '{request_id}' (unknown, or older than the trace history).",
            param="request_id",
            code="request_not_found",
        )
    return trace


@router.get("/models")
async def list_models(request: Request):
    gw = _gateway(request)
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": gw.created, "owned_by": "tandem"}
            for m in [*gw.model_ids(), *([gw.embedder.model_id] if gw.embedder is not None else [])]
        ],
    }
