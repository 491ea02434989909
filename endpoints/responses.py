"""POST /v1/responses: the OpenAI Responses API, stateless, on top of the chat path.

A request is translated into a ChatCompletionRequest (`chat_request`), prepared by the serving core like any chat
request and answered by the same orchestrator, so DiSCo's routing, racing and migration apply unchanged. Only
the wire differs: a `response` object, or named SSE events (`event:` + `data:`, numbered by `sequence_number`,
no [DONE]). As on the chat path the HTTP status waits for the first token; a failure after it is a
`response.failed` event that ends the stream.

The response's id is its job's id (`resp_…`), so `GET /v1/requests/{id}` finds its trace. Nothing is stored.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.serving.errors import Refused
from app.serving.job import Job
from app.serving.requests import ChatInput
from clients.base import Usage
from endpoints.answer import answer_headers, begin, collect, streamed, while_connected
from endpoints.api_options import ApiOptionsDep
from endpoints.auth import require_api_key
from endpoints.errors import refusal
from endpoints.responses_schemas import FunctionCallItem, FunctionCallOutputItem, InputMessage, ResponsesRequest
from endpoints.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from endpoints.serving import KeyAccess, ServingDep, chat_input
from endpoints.sse import stream_answer

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

# Finish reasons that leave a response incomplete, and the reason the Responses API gives.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The input items as chat messages: consecutive function calls are one assistant turn with tool_calls, each
    function call output a tool turn."""
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                out[-1].tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            out.append(ChatMessage(role=item.role, content=item.text()))
    return out


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description)
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers a Responses request."""
    tools = [
        Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"}))) for t in body.tools or ()
    ]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatCompletionRequest(
        model=body.model,
        messages=_messages(body),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        user=body.user,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
        metadata=body.metadata,
        store=body.store,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
        verbosity=body.text.verbosity if body.text is not None else None,
        service_tier=body.service_tier,
        prompt_cache_key=body.prompt_cache_key,
        prompt_cache_options=body.prompt_cache_options,
        prompt_cache_retention=body.prompt_cache_retention,
        safety_identifier=body.safety_identifier,
        tandem=body.tandem,
    )


def responses_input(body: ResponsesRequest, key: KeyAccess | None) -> ChatInput:
    """A Responses body as the core takes it: its chat request's, with this API's own fields that no endpoint
    applies among the extras (reported as ignored)."""
    chat = chat_input(chat_request(body), key, id_prefix="resp_")
    extras = {**chat.extras, **body.ignored_extras()}
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        extras["stream_options.include_obfuscation"] = True
    return replace(chat, extras=extras)


# Chat's names for the fields an error can name, as this API calls them.
_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}


def _param(chat_param: str | None) -> str | None:
    if chat_param is None:
        return None
    if chat_param.startswith("tools[") and chat_param.endswith("].function.parameters"):
        return chat_param.replace("].function.parameters", "].parameters")
    return _PARAMS.get(chat_param, chat_param)


def _status(finish: str) -> str:
    return "incomplete" if finish in _INCOMPLETE else "completed"


class _Response:
    """One response's objects and, when streamed, its SSE events in order (endpoints/sse.py's `Events`: `opening`,
    `text` per delta, `tool_calls`, then `closing` or `failure`). Output items follow the answer: a message item
    opens at the first text, each complete tool call is a function_call item. The per-token event is pre-rendered
    around the only parts that change, its sequence number and text."""

    def __init__(self, job: Job, body: ResponsesRequest):
        self.job = job
        self.body = body
        self.created_at = int(time.time())
        self._base = job.id.removeprefix("resp_")
        self.seq = 0
        self.items: list[dict] = []  # output items so far; a message item keeps its text pieces in "_parts"
        self._message: dict | None = None  # the message item text goes to, while open
        self._delta = ""
        self.finished = False  # the stream's last event has been rendered

    # -- objects -------------------------------------------------------------------------------------------------
    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    @staticmethod
    def _public(item: dict, status: str) -> dict:
        if item["type"] != "message":
            return item
        text = "".join(item["_parts"])
        return {k: v for k, v in item.items() if k != "_parts"} | {"status": status, "content": [_Response._part(text)]}

    def output(self, status: str) -> list[dict]:
        item_status = "completed" if status == "completed" else "incomplete"
        return [self._public(item, item_status) for item in self.items]

    def object(self, status: str, finish: str | None = None, error: dict | None = None) -> dict:
        body = self.body
        u = self.job.usage
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens,
        }
        reason = _INCOMPLETE.get(finish) if status == "incomplete" else None
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
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
            "output": [] if status == "in_progress" else self.output(status),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,  # whatever the request said: Tandem is stateless
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": (
                body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "truncation": "disabled",
            "usage": usage if status != "in_progress" else None,
            "user": body.user,
        }

    def _call_item(self, call) -> dict:
        return {
            "type": "function_call",
            "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }

    def _open_message(self) -> bytes:
        """Open a message item if none is open; its events when streamed."""
        if self._message is not None:
            return b""
        n = sum(item["type"] == "message" for item in self.items)
        item_id = f"msg_{self._base}" + (f"_{n}" if n else "")
        self._message = {"type": "message", "id": item_id, "role": "assistant", "_parts": []}
        self.items.append(self._message)
        index = len(self.items) - 1
        kind = "response.output_text.delta"
        self._delta = (
            f'event: {kind}\ndata: {{"type":"{kind}","item_id":"{item_id}","output_index":{index},'
            '"content_index":0,"logprobs":[],"sequence_number":'
        )
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
        return (
            self._event("response.output_item.added", output_index=index, item=item)
            + self._event("response.content_part.added", **where, part=self._part(""))
        ).encode()

    def _close_message(self) -> bytes:
        if self._message is None:
            return b""
        item, self._message = self._message, None
        index = self.items.index(item)
        text = "".join(item["_parts"])
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return (
            self._event("response.output_text.done", **where, text=text, logprobs=[])
            + self._event("response.content_part.done", **where, part=self._part(text))
            + self._event("response.output_item.done", output_index=index, item=self._public(item, "completed"))
        ).encode()

    # -- events --------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def opening(self) -> bytes:
        shell = self.object("in_progress")
        return (
            self._event("response.created", response=shell) + self._event("response.in_progress", response=shell)
        ).encode()

    def text(self, text: str, logprobs=None) -> bytes:
        head = self._open_message()
        self._message["_parts"].append(text)
        event = f'{self._delta}{self.seq},"delta":{json.dumps(text)}}}\n\n'
        self.seq += 1
        return head + event.encode()

    def reasoning(self, text: str) -> bytes:
        return b""  # counted in the usage's reasoning_tokens; no reasoning items in this API's answers (yet)

    def tool_calls(self, calls, first_index: int) -> bytes:
        out = [self._close_message()]
        for call in calls:
            item = self._call_item(call)
            self.items.append(item)
            index = len(self.items) - 1
            where = {"item_id": item["id"], "output_index": index}
            out.append(
                (
                    self._event(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"},
                    )
                    + self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
                    + self._event(
                        "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
                    )
                    + self._event("response.output_item.done", output_index=index, item=item)
                ).encode()
            )
        return b"".join(out)

    def closing(self, text: str, finish: str, logprobs=None) -> bytes:
        last = self.text(text) if text else b""
        if not self.items:  # an empty answer still has its (empty) message
            last += self._open_message()
        self.finished = True
        status = _status(finish)
        return (
            last
            + self._close_message()
            + self._event(f"response.{status}", response=self.object(status, finish)).encode()
        )

    def end(self, usage: Usage) -> bytes:
        return b""  # the closing event carries the usage; no [DONE] in this API

    def failure(self, exc: BaseException) -> bytes:
        self.finished = True
        error = {"code": "server_error", "message": f"the answer failed midway: {exc}"}
        return self._event("response.failed", response=self.object("failed", error=error)).encode()


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, serving: ServingDep, api: ApiOptionsDep):
    try:
        job = await serving.prepare(responses_input(body, request.state.key))
    except Refused as exc:
        error = refusal(exc)
        error.param = _param(error.param)  # named as this API names it (e.g. the prompt as a whole is `input`)
        raise error from exc
    response = _Response(job, body)
    first, stream = await begin(request, serving, job)
    if body.stream:
        events = stream_answer(job, first, stream, response)
        return streamed(api, answer_headers(job), events, last=lambda _: response.finished)
    answer = await while_connected(request, collect(job, first, stream), "mid-answer")
    # The same steps as a stream's build the output items (their events are not sent).
    if answer.text:
        response.text(answer.text)
    response.tool_calls(answer.calls, 0)
    response.closing("", answer.finish)
    return JSONResponse(response.object(_status(answer.finish), answer.finish), headers=answer_headers(job))
