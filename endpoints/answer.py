"""One answer over HTTP, whichever API asked for it (endpoints/openai.py, endpoints/responses.py).

The HTTP status is held until the first token exists: a failure before it is a real HTTP error in the OpenAI
envelope (or a failover inside the orchestrator), carrying the id of its trace; a failure after it is the
stream's failure event (endpoints/sse.py) or, for an answer collected whole, an error answer. A client that
disconnects cancels the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import NamedTuple

import anyio
from fastapi import Request

from app.serving.errors import Refused
from app.serving.job import Job
from app.serving.relay import Delta
from app.serving.tool_calls import ToolCall
from clients.base import BackendError, TokenLogprob
from endpoints.api_options import ApiOptions
from endpoints.errors import ApiError, refusal
from endpoints.serving import Serving
from endpoints.sse import SSEResponse


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. FastAPI has read the body already, so the
    next ASGI message can only be `http.disconnect`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def while_connected(request: Request, work: Awaitable, what: str):
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


def answer_headers(job: Job, choices: Sequence[Job] = ()) -> dict[str, str]:
    """An answer's headers once its first token is here: its trace's id, the endpoint that serves it, its key's
    rate-limit headers, the request's fields that endpoint (or, with n > 1, an endpoint serving one of its
    `choices`) did not apply (the trace says why), and its max_tokens where the window of the endpoint writing it
    left less (`<asked>-><given>`; with n > 1, the choice given least)."""
    headers = {"x-request-id": job.id, "x-tandem-backend": job.backend or "", **job.limit_headers}
    ignored = {name: why for j in (job, *choices) for name, why in j.ignored_fields().items()}
    if ignored:
        headers["x-tandem-ignored-fields"] = ", ".join(ignored)
    clamps = [j.max_tokens_clamped for j in (job, *choices) if j.max_tokens_clamped]
    if clamps:
        least = min(clamps, key=lambda clamp: clamp["given"])
        headers["x-tandem-max-tokens-clamped"] = f"{least['asked']}->{least['given']}"
    return headers


def before_first_token(exc: BackendError, request_id: str) -> ApiError:
    """A failure before the first token, as the HTTP error it is."""
    retry = exc.status >= 500 and exc.status != 501
    return ApiError(
        exc.status,
        str(exc),
        code="backend_error" if exc.status >= 500 else "invalid_request",
        retry=retry,
        headers={"x-request-id": request_id},
    )


async def begin(request: Request, serving: Serving, job: Job) -> tuple[Delta, AsyncIterator[Delta]]:
    """Start the answer and wait for its first token (an error before it is a real HTTP error, carrying the
    id of its trace): (first delta, the rest of the stream)."""
    stream = serving.answer(job)
    try:
        return await while_connected(request, anext(stream), "before the first token"), stream
    except ApiError as exc:
        exc.headers["x-request-id"] = job.id
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise
    except Refused as exc:  # a sub-request of outline decoding refused
        error = refusal(exc)
        error.headers["x-request-id"] = job.id
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise error from exc
    except BackendError as exc:
        await stream.aclose()
        raise before_first_token(exc, job.id) from exc


def streamed(api: ApiOptions, headers: dict[str, str], body: AsyncIterator[bytes], **options) -> SSEResponse:
    """The answer's bytes as the response, with the gateway's keep-alive pings (`options`: SSEResponse's)."""
    return SSEResponse(body, headers, api.ping_seconds, **options)


class Collected(NamedTuple):
    """A whole answer, read to its end."""

    text: str
    finish: str
    logprobs: list[TokenLogprob]
    calls: list[ToolCall]
    reasoning: str = ""  # a reasoning model's thinking, as the endpoint sent it


async def collect(job: Job, first: Delta, stream: AsyncIterator[Delta]) -> Collected:
    parts = [first.text]
    thoughts = [first.reasoning]
    logprobs = list(first.logprobs or ())
    calls = list(first.tool_calls)
    delta = first
    try:
        while delta.finish_reason is None:
            delta = await anext(stream)
            parts.append(delta.text)
            thoughts.append(delta.reasoning)
            calls += delta.tool_calls
            if delta.logprobs:
                logprobs.extend(delta.logprobs)
    except BackendError as exc:
        raise ApiError(
            exc.status, f"the answer failed midway: {exc}", code="backend_error", headers={"x-request-id": job.id}
        ) from exc
    finally:
        await stream.aclose()
    return Collected("".join(parts), delta.finish_reason, logprobs, calls, "".join(thoughts))
