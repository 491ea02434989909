"""POST /v1/messages and POST /v1/messages/count_tokens: the Anthropic Messages API, a second front door onto the
same serving core as chat.

A request (endpoints/anthropic_schemas.py) is translated into a ChatCompletionRequest and from there into the
core's ChatInput (`messages_input`), as the Responses API's is: the core prepares it like any chat request and the
orchestrator answers it, so routing, races, migrations, fault recovery, privacy levels, budgets and traces apply
unchanged. What is this API's own: `system` as the first message, tool_use / tool_result blocks as the chat shape's
tool calls and tool messages, `tool_choice` any / tool as a forced call (grammar-constrained, as `required` / a named
function are), `top_k`, `stop_sequences` beyond chat's four, and a trailing assistant message, which the answer
continues (ChatInput.continue_final). Thinking asks a reasoning endpoint for an effort (`reasoning_effort`); what no
endpoint applies (the API's own services, server tools, earlier thinking, the `anthropic-beta` header's features)
joins the request's extras, so the answer's `x-tandem-ignored-fields` and its trace name it. Only the wire differs
on the way out: a `message` object, or its named SSE events (`MessageEvents`), `stop_reason` for chat's finish
reasons, and the errors in this API's envelope (endpoints/errors.py, by path). As everywhere the HTTP status waits
for the first token; a failure after it is an `error` event that ends the stream.

The message's id is its job's (`msg_…`), so `GET /v1/requests/{id}` finds its trace. `count_tokens` renders the
request as /v1/messages would and returns the prompt's length in the device model's tokens: exactly what the
device prefills for it; it runs nothing, so it is not admitted against the key's limits.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.serving.errors import Refused
from app.serving.job import Job
from app.serving.requests import ChatInput
from app.serving.tool_calls import ToolCall
from clients.base import Usage
from endpoints.answer import answer_headers, begin, collect, streamed, while_connected
from endpoints.anthropic_schemas import (
    Conversation,
    CountTokensRequest,
    MessagesRequest,
    SearchResultBlock,
    TextBlock,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from endpoints.api_options import ApiOptionsDep
from endpoints.auth import require_messages_key
from endpoints.errors import anthropic_error, refusal
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
)
from endpoints.schemas import ToolCall as ChatToolCall
from endpoints.serving import KeyAccess, Serving, ServingDep, chat_input
from endpoints.sse import stream_answer

router = APIRouter(prefix="/v1", dependencies=[Depends(require_messages_key)])

# Chat's finish reasons as this API's stop reasons ("stop" is "stop_sequence" when a stop sequence ended it).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
PING = b'event: ping\ndata: {"type":"ping"}\n\n'


# -- the request, as the core takes it -------------------------------------------------------------------------------


def _chat_messages(body: Conversation) -> list[ChatMessage]:
    """The conversation in chat's shape: a user message's tool_result blocks are tool messages (before its text),
    an assistant message's tool_use blocks its tool_calls."""
    system = body.system_text()
    out = [ChatMessage(role="system", content=system)] if system is not None else []
    for message in body.messages:
        blocks = message.blocks
        if message.role == "system":
            out.append(ChatMessage(role="system", content=message.text("\n\n")))
            continue
        if message.role == "user":
            results = [b for b in blocks if isinstance(b, ToolResultBlock)]
            out += [ChatMessage(role="tool", content=b.text(), tool_call_id=b.tool_use_id) for b in results]
            if not results or any(isinstance(b, TextBlock | SearchResultBlock) for b in blocks):
                out.append(ChatMessage(role="user", content=message.text("\n\n")))
            continue
        calls = [
            ChatToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)))
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        text = message.text("")
        if text or calls or message is not body.messages[-1]:  # a final one of thinking alone begins no answer
            out.append(ChatMessage(role="assistant", content=text, tool_calls=calls or None))
    return out


def _tool_choice(body: Conversation) -> str | NamedToolChoice | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _response_format(body: Conversation) -> ResponseFormat | None:
    """`output_config.format` (structured output) as chat's json_schema format."""
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    return ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema_, strict=True)
    )


# This API's service tiers as chat's: "standard_only" is OpenAI's standard tier, "default".
_SERVICE_TIERS = {"auto": "auto", "standard_only": "default"}


def chat_request(body: Conversation) -> ChatCompletionRequest:
    """The chat request that answers a Messages request (the sampling fields chat cannot hold are added to the
    ChatInput by `messages_input`). Only the client's own tools are offered; thinking asks a reasoning endpoint for an
    effort (`Conversation.reasoning_effort`)."""
    sampling = body if isinstance(body, MessagesRequest) else None
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict
            ),
        )
        for t in body.custom_tools
    ]
    parallel = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    user = sampling.metadata.user_id if sampling and sampling.metadata else None
    tier = sampling.service_tier if sampling else None
    return ChatCompletionRequest(
        model=body.model,
        messages=_chat_messages(body),
        max_tokens=sampling.max_tokens if sampling else None,
        temperature=sampling.temperature if sampling else None,
        top_p=sampling.top_p if sampling else None,
        stream=bool(sampling and sampling.stream),
        tools=tools or None,
        tool_choice=_tool_choice(body) if tools or not body.tools else None,  # (server tools alone: none)
        parallel_tool_calls=False if parallel else None,
        response_format=_response_format(body),
        user=user,
        reasoning_effort=body.reasoning_effort(),
        service_tier=_SERVICE_TIERS[tier] if tier else None,
        tandem=body.tandem,
    )


def messages_input(body: Conversation, key: KeyAccess | None, beta: str | None = None) -> ChatInput:
    """A Messages body as the core takes it; `beta` is its `anthropic-beta` header (no feature of it applied)."""
    chat = chat_input(chat_request(body), key, id_prefix="msg_")
    extra = {}
    if isinstance(body, MessagesRequest):
        extra = {"stop": tuple(body.stop_sequences or ()), "top_k": body.top_k}
    extras = {**chat.extras, **body.ignored_extras(beta)}
    if (hint := body.cache_hint()) is not None:
        extras["cache_control"] = hint
    return replace(chat, continue_final=body.prefill, extras=extras, **extra)


_TOOL_SCHEMA = re.compile(r"^tools\[(\d+)\]\.function\.parameters$")


def _param(chat_param: str | None, body: Conversation) -> str | None:
    """A field the core's refusal names (chat's names) as this API names it (a tool's index among all `tools`,
    server tools included)."""
    if chat_param is not None and (match := _TOOL_SCHEMA.match(chat_param)):
        indices = [i for i, t in enumerate(body.tools or ()) if isinstance(t, ToolDefinition)]
        return f"tools[{indices[int(match[1])]}].input_schema"
    return chat_param


async def _prepare(serving: Serving, body: Conversation, request: Request, count: bool = False) -> Job | int:
    """The request's job (or, with `count`, only its prompt's length: nothing admitted), a refusal in this API's
    names."""
    chat = messages_input(body, request.state.key, request.headers.get("anthropic-beta"))
    try:
        return await (serving.count_tokens(chat) if count else serving.prepare(chat))
    except Refused as exc:
        error = refusal(exc)
        error.param = _param(error.param, body)
        raise error from exc


# -- the answer, on this API's wire ----------------------------------------------------------------------------------


def stop_reason(job: Job, finish: str) -> str:
    if finish == "stop" and job.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish, "end_turn")


def _tool_use(call: ToolCall) -> dict:
    """A call as a tool_use block (the id keeps the chat call's random part)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": {}}


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens}


def _message(job: Job, model: str, content: list[dict], stop: str | None, usage: Usage) -> dict:
    return {
        "id": job.id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": job.stop_sequence if stop == "stop_sequence" else None,
        "usage": _usage(usage),
    }


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


class MessageEvents:
    """One message's SSE events, in the order endpoints/sse.py's ChoiceRenderer asks for them: `message_start` (and
    a `ping`) with the first content; a text block opened at the first text, a `content_block_delta` per piece; each
    complete tool call a tool_use block (start, its input as one `input_json_delta`, stop), after the text block is
    closed; then `message_delta` (stop reason, usage) and `message_stop`. The per-token delta is pre-rendered around
    its text."""

    def __init__(self, job: Job, model: str):
        self.job = job
        self.model = model
        self._index = -1  # the current content block's
        self._text_open = False
        self._delta = b""
        self._finish = "stop"
        self.finished = False  # the stream's last event has been rendered

    def opening(self) -> bytes:
        message = _message(self.job, self.model, [], None, Usage(self.job.prompt_tokens, 0))
        return _event("message_start", {"message": message}) + PING

    def _open_text(self) -> bytes:
        if self._text_open:
            return b""
        self._text_open = True
        self._index += 1
        self._delta = (
            f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":{self._index},'
            '"delta":{"type":"text_delta","text":'
        ).encode()
        return _event("content_block_start", {"index": self._index, "content_block": {"type": "text", "text": ""}})

    def _close_text(self) -> bytes:
        if not self._text_open:
            return b""
        self._text_open = False
        return _event("content_block_stop", {"index": self._index})

    def text(self, text: str, logprobs=None) -> bytes:
        return self._open_text() + self._delta + json.dumps(text).encode() + b"}}\n\n"

    def tool_calls(self, calls, first_index: int) -> bytes:
        out = [self._close_text()]
        for call in calls:
            self._index += 1
            where = {"index": self._index}
            out += [
                _event("content_block_start", {**where, "content_block": _tool_use(call)}),
                _event(
                    "content_block_delta",
                    {**where, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                ),
                _event("content_block_stop", where),
            ]
        return b"".join(out)

    def closing(self, text: str, finish: str, logprobs=None) -> bytes:
        self._finish = finish
        return (self.text(text) if text else b"") + self._close_text()

    def end(self, usage: Usage) -> bytes:
        self.finished = True
        delta = {"stop_reason": stop_reason(self.job, self._finish), "stop_sequence": self.job.stop_sequence}
        return _event("message_delta", {"delta": delta, "usage": _usage(usage)}) + _event("message_stop", {})

    def failure(self, exc: BaseException) -> bytes:
        self.finished = True
        status = getattr(exc, "status", 500)
        error = anthropic_error(status if status >= 500 else 500, f"the answer failed midway: {exc}")
        return _event("error", {"error": error["error"]})


@router.post("/messages")
async def create_message(body: MessagesRequest, request: Request, serving: ServingDep, api: ApiOptionsDep):
    job = await _prepare(serving, body, request)
    first, stream = await begin(request, serving, job)
    headers = {**answer_headers(job), "request-id": job.id}
    if body.stream:
        events = MessageEvents(job, body.model)
        return streamed(
            api, headers, stream_answer(job, first, stream, events), last=lambda _: events.finished, keepalive=PING
        )
    answer = await while_connected(request, collect(job, first, stream), "mid-answer")
    content = [{"type": "text", "text": answer.text}] if answer.text else []
    content += [{**_tool_use(call), "input": json.loads(call.arguments)} for call in answer.calls]
    message = _message(job, body.model, content, stop_reason(job, answer.finish), job.usage)
    return JSONResponse(message, headers=headers)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, serving: ServingDep):
    """The prompt /v1/messages would prefill for this request, in the device model's tokens."""
    return {"input_tokens": await _prepare(serving, body, request, count=True)}
