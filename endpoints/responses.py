"""POST /v1/responses: the OpenAI Responses API, stateless, on top of the chat path.

A request is translated into a ChatCompletionRequest (`chat_request`), prepared by the gateway like any chat
request and answered by the same orchestrator, so DiSCo's routing, racing and migration apply unchanged. Only
the wire differs: a `response` object, or named SSE events (`event:` + `data:`, numbered by `sequence_number`,
no [DONE]). As on the chat path the HTTP status waits for the first token; a failure after it is a
`response.failed` event that ends the stream.

The response's id is its job's id (`resp_…`), so `GET /v1/requests/{id}` finds its trace. Nothing is stored.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.serving.job import Job
from endpoints.auth import require_api_key
from endpoints.errors import ApiError
from endpoints.openai import _begin, _collect, _gateway, _headers, _sse, _sse_response, _while_connected
from endpoints.schemas import ChatCompletionRequest, ChatMessage, InputMessage, ResponsesRequest

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

# Finish reasons that leave a response incomplete, and the reason the Responses API gives.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers a Responses request (tools and text.format will map here, onto chat's
    `tools` and `response_format`)."""
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    return ChatCompletionRequest(
        model=body.model,
        messages=[*system, *(ChatMessage(role=item.role, content=item.text()) for item in items)],
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        user=body.user,
        tandem=body.tandem,
    )


def _status(finish: str) -> str:
    return "incomplete" if finish in _INCOMPLETE else "completed"


class _Response:
    """One response's objects and, when streamed, its SSE events in order (the events `_sse` asks for:
    `opening`, `text` per delta, then `closing` or `failure`). The per-token event is pre-rendered around the
    only parts that change, its sequence number and text."""

    def __init__(self, job: Job, body: ResponsesRequest):
        self.job = job
        self.body = body
        self.created_at = int(time.time())
        self.item_id = "msg_" + job.id.removeprefix("resp_")
        self.seq = 0
        self.parts: list[str] = []
        self.finished = False  # the stream's last event has been rendered
        kind = "response.output_text.delta"
        self._delta = (
            f'event: {kind}\ndata: {{"type":"{kind}","item_id":"{self.item_id}","output_index":0,'
            '"content_index":0,"logprobs":[],"sequence_number":'
        )

    # -- objects -------------------------------------------------------------------------------------------------
    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    def _item(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [self._part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def object(self, status: str, text: str | None, finish: str | None = None, error: dict | None = None) -> dict:
        """The `response` object: `text` None before the answer has any (its first events)."""
        body = self.body
        u = self.job.usage
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        }
        item_status = "completed" if status == "completed" else "incomplete"
        reason = _INCOMPLETE.get(finish) if status == "incomplete" else None
        return {
            "id": self.job.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": body.model,
            "output": [] if text is None else [self._item(item_status, text)],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "store": False,  # whatever the request said: Tandem is stateless
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": [],
            "truncation": "disabled",
            "usage": usage if status != "in_progress" else None,
            "user": body.user,
        }

    # -- events --------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def opening(self) -> bytes:
        shell = self.object("in_progress", None)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return (
            self._event("response.created", response=shell)
            + self._event("response.in_progress", response=shell)
            + self._event("response.output_item.added", output_index=0, item=self._item("in_progress", None))
            + self._event("response.content_part.added", **where, part=self._part(""))
        ).encode()

    def text(self, text: str, logprobs=None) -> bytes:
        self.parts.append(text)
        event = f'{self._delta}{self.seq},"delta":{json.dumps(text)}}}\n\n'
        self.seq += 1
        return event.encode()

    def closing(self, text: str, finish: str, logprobs=None) -> bytes:
        last = self.text(text) if text else b""
        self.finished = True
        whole = "".join(self.parts)
        status = _status(finish)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        response = self.object(status, whole, finish)
        events = (
            self._event("response.output_text.done", **where, text=whole, logprobs=[])
            + self._event("response.content_part.done", **where, part=self._part(whole))
            + self._event("response.output_item.done", output_index=0, item=response["output"][0])
            + self._event(f"response.{status}", response=response)
        )
        return last + events.encode()

    def failure(self, exc: BaseException) -> bytes:
        self.finished = True
        error = {"code": "server_error", "message": f"the answer failed midway: {exc}"}
        return self._event("response.failed", response=self.object("failed", "".join(self.parts), error=error)).encode()


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request):
    try:
        job = await _gateway(request).prepare_chat(chat_request(body), id_prefix="resp_")
    except ApiError as exc:
        if exc.param == "messages":  # the prompt as a whole (too long for the context): here it is `input`
            exc.param = "input"
        raise
    response = _Response(job, body)
    first, stream = await _begin(request, job)
    if body.stream:
        return _sse_response(request, job, _sse(job, first, stream, response), last=lambda _: response.finished)
    answer = await _while_connected(request, _collect(job, first, stream), "mid-answer")
    return JSONResponse(response.object(_status(answer.finish), answer.text, answer.finish), headers=_headers(job))
