"""POST /v1/responses: the OpenAI Responses API, stateless, on top of the chat path.

A request is translated into a ChatCompletionRequest (`chat_request`), prepared by the serving core like any chat
request and answered by the same orchestrator, so DiSCo's routing, racing and migration apply unchanged. Tools are
offered as chat's functions (`ResponsesRequest.offered`): function tools as they are, a namespace's tools under
`<namespace>__<name>`, a custom (freeform) tool as a function of one string, `input`; the built-in tools are not
offered (reported ignored). A call comes back as the item of the tool it stands for: a function_call with its own
name and namespace, or a custom_tool_call with its input. Only the wire differs: a `response` object, or named SSE
events (`event:` + `data:`, numbered by `sequence_number`, no [DONE]). As on the chat path the HTTP status waits
for the first token; a failure after it is a `response.failed` event that ends the stream.

The response's id is its job's id (`resp_…`), so `GET /v1/requests/{id}` finds its trace. Nothing is stored.
"""

from __future__ import annotations

import json
import re
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
from endpoints.responses_schemas import (
    AllowedTools,
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    Offered,
    ResponsesNamedTool,
    ResponsesRequest,
)
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
    """The input items as chat messages: calls (function and custom tool calls) one assistant turn with tool_calls,
    after the assistant's text of the same turn, each call's output a tool turn. Dropped items (reasoning, the
    built-in tools' calls) are not shown; `ignored_extras` reports them."""
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    for item in items:
        if isinstance(item, FunctionCallItem | CustomToolCallItem):
            arguments = item.arguments if isinstance(item, FunctionCallItem) else custom_arguments(item.input)
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.function_name, arguments=arguments))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or ()), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            out.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
        elif isinstance(item, InputMessage):
            out.append(ChatMessage(role=item.role, content=item.text()))
    return out


def custom_arguments(text: str) -> str:
    """A custom tool's input as the arguments of the function it is offered as."""
    return json.dumps({"input": text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The input of a custom tool's call, from the arguments the model wrote for its function: `input`'s string (the
    arguments as written, when an endpoint that does not enforce the schema wrote something else)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and len(value) == 1 and isinstance(text := next(iter(value.values())), str):
        return text
    return arguments


def _function(name: str, offered: Offered) -> FunctionDefinition:
    """A tool as the function the model is offered: a custom tool takes its input as one string, `input`."""
    tool = offered.tool
    description = tool.description
    if offered.namespace_description:
        description = "\n\n".join(filter(None, (offered.namespace_description, description)))
    if not isinstance(tool, CustomTool):
        return FunctionDefinition(name=name, description=description, parameters=tool.parameters, strict=tool.strict)
    text = {"type": "string", "description": "The input, as plain text."}
    grammar = tool.grammar
    if grammar is not None and grammar.syntax == "regex":
        text["pattern"] = f"^(?:{grammar.definition})$"
    elif grammar is not None:  # a Lark grammar: a string inside the call's JSON cannot follow it; the model reads it
        description = f"{description or ''}\n\nThe input follows this Lark grammar:\n{grammar.definition}".lstrip()
    parameters = {"type": "object", "properties": {"input": text}, "required": ["input"], "additionalProperties": False}
    return FunctionDefinition(name=name, description=description, parameters=parameters)


def _tool_choice(body: ResponsesRequest, offered: dict[str, Offered]) -> str | NamedToolChoice | None:
    choice = body.tool_choice
    if isinstance(choice, AllowedTools):
        return choice.mode
    if isinstance(choice, ResponsesNamedTool):
        named = [n for n, o in offered.items() if o.tool.name == choice.name and o.tool.type == choice.type]
        name = choice.name if choice.name in offered or not named else named[0]
        return NamedToolChoice(type="function", function=NamedFunction(name=name))
    if not isinstance(choice, str) or (not offered and choice != "required"):
        return None  # a built-in tool forced (none is offered: reported ignored), or nothing to choose from
    return choice


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
    offered = body.offered()
    tools = [Tool(type="function", function=_function(name, o)) for name, o in offered.items()]
    choice = _tool_choice(body, offered)
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


_TOOL_SCHEMA = re.compile(r"^tools\[(\d+)\]\.function\.parameters$")


def _param(chat_param: str | None, body: ResponsesRequest) -> str | None:
    if chat_param is None:
        return None
    if match := _TOOL_SCHEMA.match(chat_param):  # the i-th function offered: where the request defines it
        offered = list(body.offered().values())[int(match[1])]
        return offered.path + (".format" if isinstance(offered.tool, CustomTool) else ".parameters")
    return _PARAMS.get(chat_param, chat_param)


def _status(finish: str) -> str:
    return "incomplete" if finish in _INCOMPLETE else "completed"


class _Response:
    """One response's objects and, when streamed, its SSE events in order (endpoints/sse.py's `Events`: `opening`,
    `text` per delta, `tool_calls`, then `closing` or `failure`). Output items follow the answer: a message item
    opens at the first text, each complete tool call is a function_call or custom_tool_call item. The per-token
    event is pre-rendered around the only parts that change, its sequence number and text."""

    def __init__(self, job: Job, body: ResponsesRequest):
        self.job = job
        self.body = body
        self.offered = body.offered()  # what each call's function name stands for
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
            "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools or ()],
            "truncation": "disabled",
            "usage": usage if status != "in_progress" else None,
            "user": body.user,
        }

    def _call_item(self, call) -> dict:
        """A call as its output item: a function_call, or a custom_tool_call (its input the function's one
        argument), with its tool's own name and namespace apart."""
        offered = self.offered.get(call.name)
        base = call.id.removeprefix("call_")
        name = offered.tool.name if offered is not None else call.name
        if offered is not None and isinstance(offered.tool, CustomTool):
            item = {"type": "custom_tool_call", "id": "ctc_" + base, "call_id": call.id, "name": name}
            item["input"] = custom_input(call.arguments)
        else:
            item = {"type": "function_call", "id": "fc_" + base, "call_id": call.id, "name": name}
            item |= {"arguments": call.arguments, "status": "completed"}
        if offered is not None and offered.namespace is not None:
            item["namespace"] = offered.namespace
        return item

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
            if item["type"] == "custom_tool_call":
                text, kind, done = item["input"], "response.custom_tool_call_input", {"input": item["input"]}
                opened = {**item, "input": ""}
            else:
                text, kind, done = call.arguments, "response.function_call_arguments", {"arguments": call.arguments}
                opened = {**item, "arguments": "", "status": "in_progress"}
                done = {"name": item["name"], **done}
            out.append(
                (
                    self._event("response.output_item.added", output_index=index, item=opened)
                    + self._event(f"{kind}.delta", **where, delta=text)
                    + self._event(f"{kind}.done", **where, **done)
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
        error.param = _param(error.param, body)  # named as this API names it (e.g. the prompt as a whole is `input`)
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
