"""/v1/chat/completions, /v1/completions, /v1/models[/{id}] and /v1/requests/{id}, on the OpenAI wire contract.

An answer's HTTP life (the status held until the first token, the client's disconnect) is endpoints/answer.py's;
streamed, its chunks are endpoints/sse.py's: a failure after the first token is an SSE `data: {"error": ...}`
event followed by [DONE].
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.serving.job import Job
from app.serving.relay import Delta
from clients.base import BackendError, Usage
from endpoints.answer import (
    Collected,
    answer_headers,
    before_first_token,
    begin,
    collect,
    streamed,
    while_connected,
)
from endpoints.api_options import ApiOptions, ApiOptionsDep
from endpoints.auth import require_api_key
from endpoints.errors import ApiError
from endpoints.logprobs import LogprobsRenderer
from endpoints.schemas import ChatCompletionRequest, CompletionRequest
from endpoints.serving import Serving, ServingDep, chat_input, completion_input
from endpoints.sse import ChatChunks, stream_answer, stream_choices, usage_object

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def _usage(job: Job | Usage) -> dict:
    return usage_object(job.usage if isinstance(job, Job) else job)


def _choice(body, chat: bool, index: int, answer: Collected) -> dict:
    text, finish, logprobs, calls, _ = answer
    if chat:
        message = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if calls and body.functions_api:  # the deprecated functions API: its one call
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            finish = "function_call" if finish == "tool_calls" else finish
        elif calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        choice = {"index": index, "message": message}
    else:
        choice = {"index": index, "text": text}
    lp = LogprobsRenderer(chat).obj(logprobs) if body.logprobs_top is not None else None
    return {**choice, "logprobs": lp, "finish_reason": finish}


def _completion(
    body, chat: bool, job: Job, choices: list[dict], usage: Usage, backends: str, jobs: Sequence[Job] = ()
) -> JSONResponse:
    return JSONResponse(
        {
            "id": job.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": _usage(usage),
        },
        headers={**answer_headers(job, jobs), "x-tandem-backend": backends},
    )


async def _answer(request: Request, serving: Serving, api: ApiOptions, body, job: Job, chat: bool):
    """Stream or collect one answer; the first token decides between an HTTP error and a 200."""
    if body.choices > 1:
        return await _answer_choices(request, serving, api, body, job, chat)
    first, stream = await begin(request, serving, job)
    if body.stream:
        chunks = ChatChunks(
            job.id,
            body.model,
            chat,
            body.include_usage,
            logprobs=body.logprobs_top is not None,
            functions_api=body.functions_api,
        )
        return streamed(api, answer_headers(job), stream_answer(job, first, stream, chunks))
    answer = await while_connected(request, collect(job, first, stream), "mid-answer")
    return _completion(body, chat, job, [_choice(body, chat, 0, answer)], job.usage, job.backend or "")


# -- n > 1: each choice is a job of its own (ids `<request id>-<index>`), on whichever endpoint serves it ------------


def _summed_usage(jobs: list[Job]) -> Usage:
    """The prompt counts once (as OpenAI counts it); the completions add up."""
    return Usage(
        jobs[0].usage.prompt_tokens,
        sum(j.usage.completion_tokens for j in jobs),
        cached_tokens=jobs[0].usage.cached_tokens,
        reasoning_tokens=sum(j.usage.reasoning_tokens for j in jobs),
    )


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


async def _answer_choices(request: Request, serving: Serving, api: ApiOptions, body, job: Job, chat: bool):
    """n answers to one request. The first token of any choice decides between an HTTP error and a 200; a
    choice that fails later is an SSE error event (streamed) or an error answer (not streamed)."""
    jobs = [job.choice(i) for i in range(body.choices)]
    if body.stream:
        merged = _merge([serving.answer(j) for j in jobs])
        try:
            first = await while_connected(request, anext(merged), "before the first token")
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
            raise before_first_token(exc, job.id) from exc
        lp = body.logprobs_top is not None
        chunks = [
            ChatChunks(
                job.id,
                body.model,
                chat,
                body.include_usage,
                index=i,
                logprobs=lp,
                functions_api=body.functions_api,
            )
            for i in range(len(jobs))
        ]
        headers = {**answer_headers(job, jobs), "x-tandem-backend": jobs[first[0]].backend or ""}
        return streamed(api, headers, stream_choices(job.id, first, merged, chunks, lambda: _summed_usage(jobs)))

    async def one(j: Job):
        stream = serving.answer(j)
        try:
            first = await anext(stream)
        except BackendError as exc:
            await stream.aclose()
            raise before_first_token(exc, job.id) from exc
        return await collect(j, first, stream)

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
        results = await while_connected(request, all_choices(), "mid-answer")
    except ApiError as exc:
        exc.headers["x-request-id"] = job.id
        raise
    choices = [_choice(body, chat, i, r) for i, r in enumerate(results)]
    backends = ",".join(dict.fromkeys(j.backend or "" for j in jobs))
    return _completion(body, chat, job, choices, _summed_usage(jobs), backends, jobs)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: ServingDep, api: ApiOptionsDep):
    job = await serving.prepare(chat_input(body, request.state.key))
    return await _answer(request, serving, api, body, job, chat=True)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, serving: ServingDep, api: ApiOptionsDep):
    job = await serving.prepare(completion_input(body, request.state.key))
    return await _answer(request, serving, api, body, job, chat=False)


@router.get("/requests/{request_id}")
async def request_trace(request_id: str, serving: ServingDep):
    """The trace of a recent request: plan, endpoints and timings, migrations, cost."""
    trace = await serving.trace(request_id)
    if trace is None:
        raise ApiError(
            404,
            f"No trace for request '{request_id}' (unknown, or older than the trace history).",
            param="request_id",
            code="request_not_found",
        )
    return trace


def _model_object(serving: Serving, card: dict) -> dict:
    """OpenAI's model object, with what serves it under the keys vLLM (`max_model_len`) and OpenRouter
    (`context_length`, `pricing`) use, and Tandem's own (`capabilities`, `locality`, `endpoints`); and the Anthropic
    Models API's (`type`, `display_name`, `created_at`, `max_input_tokens`, `max_tokens`: a Messages client lists
    models on the same path). Its window is its own: the prompt and the answer share it, one token each at least."""
    window = card["context_length"]
    anthropic = {
        "type": "model",
        "display_name": card["id"],
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(serving.created)),
        "max_input_tokens": max(window - 1, 0),
        "max_tokens": max(window - 1, 0),
    }
    return {"id": card["id"], "object": "model", "created": serving.created, "owned_by": "tandem", **anthropic, **card}


@router.get("/models")
async def list_models(serving: ServingDep):
    """OpenAI's list, which is also the Anthropic Models API's (its paging fields: every model fits one page)."""
    data = [_model_object(serving, card) for card in serving.models()]
    ids = [model["id"] for model in data]
    return {"object": "list", "data": data, "has_more": False, "first_id": ids[0], "last_id": ids[-1]}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, serving: ServingDep):
    cards = serving.models()
    card = next((c for c in cards if c["id"] == model_id), None)
    if card is None:
        available = ", ".join(c["id"] for c in cards)
        raise ApiError(
            404,
            f"The model '{model_id}' does not exist. Available: {available}.",
            param="model",
            code="model_not_found",
        )
    return _model_object(serving, card)
