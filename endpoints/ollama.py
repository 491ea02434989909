"""The Ollama API, a third front door onto the same serving core as chat: /api/chat, /api/generate, /api/embed,
/api/embeddings, /api/tags, /api/show, /api/ps, /api/version, and `GET /` ("Ollama is running"), which clients
probe before anything else.

A request (endpoints/ollama_schemas.py) becomes the core's ChatInput (/api/chat, and /api/generate with the model's
chat template) or CompletionInput (/api/generate with `raw: true`), so routing, races, migrations, fault recovery,
privacy levels, key limits, budgets, traces and the live feed apply unchanged. What is this API's own: `options`
(temperature, top_p, top_k, num_predict, stop, seed, the penalties; llama.cpp's samplers as the core's sampling
extras, as the OpenAI surface passes them), `format` ("json" or a JSON schema, the core's response_format and so its
grammar), tool calls with their arguments as objects (a tool result answers the call it names, or the earliest
unanswered call of its tool), a trailing assistant message continued, the answer as NDJSON lines, streamed unless
`stream: false` (Ollama's default), its last line carrying `done`, `done_reason` and the timings in nanoseconds, and
the errors as `{"error": "..."}` (endpoints/errors.py, by path). A field Tandem does not apply is named in the
`x-tandem-ignored-fields` header (docs/ollama.md says why for each). As on every door the HTTP status waits for the
first token; a failure after it is an `{"error": ...}` line, which Ollama's clients raise.

Model names are the gateway's own (its routed name, each endpoint's name and model id, the embedding model's); a
name with Ollama's default tag (`device:latest`) is that model. The request's trace id is the `x-request-id` header.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute

from app.serving.job import Job
from app.serving.requests import ChatInput, CompletionInput
from app.serving.tool_calls import ToolCall
from clients.base import TokenLogprob, Usage
from endpoints.answer import Collected, answer_headers, begin, collect, while_connected
from endpoints.api_options import ApiOptions, ApiOptionsDep
from endpoints.auth import require_api_key
from endpoints.errors import ApiError
from endpoints.logprobs import chat_logprobs
from endpoints.ollama_schemas import (
    SAMPLING_OPTIONS,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Message,
    Options,
    ShowRequest,
)
from endpoints.serving import KeyAccess, Serving, ServingDep, routing_fields
from endpoints.sse import SSEResponse, stream_answer


class _AnyBodyIsJson(APIRoute):
    """Ollama reads every body as JSON whatever its content type, and its clients and documented examples rely on it
    (`curl …/api/chat -d '{…}'` sends application/x-www-form-urlencoded): so does this door."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            if request.method == "POST" and request.headers.get("content-type", "").partition(";")[0] != _JSON:
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                request.scope["headers"] = [*headers, (b"content-type", _JSON.encode())]
                request = Request(request.scope, request.receive)
            return await handler(request)

        return route


_JSON = "application/json"
router = APIRouter(route_class=_AnyBodyIsJson)
KEYED = [Depends(require_api_key)]  # every route but the probes ("/", /api/version), which Ollama leaves open too

# The Ollama release whose API this door follows (the pinned `ollama` client's): clients gate features on it.
OLLAMA_VERSION = "0.13.0"
IGNORED_HEADER = "x-tandem-ignored-fields"
_LATEST = ":latest"  # Ollama's default tag: `name` and `name:latest` are one model
_FUNCTION_FIELDS = {"name", "description", "parameters"}  # a tool function's fields that chat takes (and an upstream)
_DONE_REASONS = {"length": "length"}  # every other finish (a stop, tool calls, a content filter) is Ollama's "stop"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# -- the request, as the core takes it -------------------------------------------------------------------------------


# Ollama's capabilities, each with the core's that make it (Serving.models()'s `capabilities`).
_CAPABILITIES = {"completion": ("chat", "completions"), "tools": ("tools",), "embedding": ("embeddings",)}


def models(serving: Serving) -> dict[str, dict]:
    """Every model a request may name, by id, as the core describes it (Serving.models(): its `context_length`, its
    `locality`, the `endpoints` that may serve it), with its `capabilities` in Ollama's words."""
    return {card["id"]: {**card, "capabilities": _capabilities(card["capabilities"])} for card in serving.models()}


def _capabilities(core: dict[str, bool]) -> list[str]:
    return [name for name, made_of in _CAPABILITIES.items() if any(core[c] for c in made_of)]


def _model(serving: Serving, name: str) -> str:
    """The gateway's model a name means (`device:latest` is `device`); an unknown name as it is (the core refuses
    it, naming the models there are)."""
    known = models(serving)
    if name.endswith(_LATEST) and name not in known and name[: -len(_LATEST)] in known:
        return name[: -len(_LATEST)]
    return name


def _arguments(arguments: dict | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _answered(message: Message, unanswered: list[dict], index: int) -> str:
    """The id of the call a tool message answers: the one it names, else the earliest unanswered call of its tool,
    else the earliest unanswered call, else an id of its own (a result no call in the conversation asked for)."""
    if message.tool_call_id is not None:
        unanswered[:] = [c for c in unanswered if c["id"] != message.tool_call_id]
        return message.tool_call_id
    match = next((c for c in unanswered if c["function"]["name"] == message.tool_name), None)
    match = match or (unanswered[0] if unanswered else None)
    if match is None:
        return f"call_{index}"
    unanswered.remove(match)
    return match["id"]


def chat_messages(messages: Sequence[Message]) -> tuple[dict, ...]:
    """The conversation in chat's shape: tool calls with ids (a call Ollama sent without one gets `call_<message>_<n>`)
    and their arguments as JSON text, each tool message the id of the call it answers."""
    out, unanswered = [], []
    for i, m in enumerate(messages):
        item = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id or f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for j, c in enumerate(m.tool_calls)
            ]
            unanswered = list(item["tool_calls"])
        elif m.role == "tool":
            item["tool_call_id"] = _answered(m, unanswered, i)
        out.append(item)
    return tuple(out)


def _sampling(body: ChatRequest | GenerateRequest, model: str, key: KeyAccess | None) -> dict:
    """What chat and completions inputs share: the model, the key, Tandem's own options, the sampling options."""
    options = body.options or Options()
    seed = options.seed
    return {
        **routing_fields(model, body.tandem, key),
        "streamed": body.stream is not False,  # Ollama streams unless told not to
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "stop": options.stop_sequences,
        "seed": seed if seed is not None and seed >= 0 else None,  # a negative seed: a random one, as in Ollama
        "logprobs": body.logprobs_top,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "extras": options.sampling_extras(),
    }


def chat_input(body: ChatRequest, model: str, key: KeyAccess | None) -> ChatInput:
    """An /api/chat body as the core takes it. A trailing assistant message (without calls) is continued."""
    last = body.messages[-1]
    return ChatInput(
        **_sampling(body, model, key),
        messages=chat_messages(body.messages),
        tools=tuple(
            {"type": "function", "function": t.function.model_dump(exclude_none=True, include=_FUNCTION_FIELDS)}
            for t in body.tools or ()
        ),
        response_format=body.response_format,
        continue_final=last.role == "assistant" and not last.tool_calls,
    )


def generate_input(body: GenerateRequest, model: str, key: KeyAccess | None) -> ChatInput | CompletionInput:
    """An /api/generate body as the core takes it: the prompt as a user turn (after `system`) in the model's chat
    template, or with `raw: true` the prompt as it is."""
    if body.raw:
        return CompletionInput(**_sampling(body, model, key), prompt=body.prompt)
    system = [{"role": "system", "content": body.system}] if body.system else []
    return ChatInput(
        **_sampling(body, model, key),
        messages=(*system, {"role": "user", "content": body.prompt}),
        response_format=body.response_format,
    )


def _ignored(names: list[str], headers: dict[str, str] | None = None) -> dict[str, str]:
    """`headers` with the fields this door did not apply named, after any the serving endpoint did not apply (its
    sampling extras as this API's clients name them: `options.mirostat`)."""
    headers = dict(headers or {})
    by_endpoint = filter(None, headers.get(IGNORED_HEADER, "").split(", "))
    named = [*(SAMPLING_OPTIONS.get(name, name) for name in by_endpoint), *names]
    if named:
        headers[IGNORED_HEADER] = ", ".join(dict.fromkeys(named))
    return headers


# -- the answer, on this API's wire ----------------------------------------------------------------------------------


def _tool_call(call: ToolCall, index: int) -> dict:
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": json.loads(call.arguments)}}


class Lines:
    """One answer's NDJSON lines, in the order endpoints/sse.py's ChoiceRenderer asks for them: a line per piece of
    text (of thinking, of complete tool calls), then the last line: `done`, `done_reason`, the counts and the timings.
    /api/chat's pieces are in a `message` (`content`, `thinking`, `tool_calls`), /api/generate's at the top
    (`response`, `thinking`). A line is pre-rendered around its text and its time."""

    def __init__(self, model: str, chat: bool, received: float, first_at: float, thinking: bool, logprobs: bool):
        self.model = model  # as the request named it
        self.chat = chat
        self.received = received  # when the request came in: the timings count from it
        self.first_at = first_at  # when its first token did
        self.thinking = thinking  # the endpoint's thinking is shown (unless the request said think: false)
        self.logprobs = logprobs
        self.finished = False  # the stream's last line has been rendered
        self._finish = "stop"
        self._head = '{"model":' + json.dumps(model) + ',"created_at":"'
        self._key = "content" if chat else "response"

    def _line(self, fields: str, rest: str = "") -> bytes:
        piece = '"message":{"role":"assistant",' + fields + "}" if self.chat else fields
        return (self._head + _now() + '",' + piece + rest + ',"done":false}\n').encode()

    def keepalive(self) -> bytes:
        """An empty piece: what a quiet stream sends to keep its connection (NDJSON has no comments)."""
        return self._line(f'"{self._key}":""')

    def opening(self) -> bytes:
        return b""

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes:
        rest = ""
        if self.logprobs and logprobs:
            rest = ',"logprobs":' + json.dumps(chat_logprobs(logprobs)["content"], separators=(",", ":"))
        return self._line(f'"{self._key}":' + json.dumps(text), rest)

    def reasoning(self, text: str) -> bytes:
        return self._line(f'"{self._key}":"","thinking":' + json.dumps(text)) if self.thinking else b""

    def tool_calls(self, calls: Sequence[ToolCall], first_index: int) -> bytes:
        shown = [_tool_call(c, i) for i, c in enumerate(calls, first_index)]
        return self._line('"content":"","tool_calls":' + json.dumps(shown, separators=(",", ":"), ensure_ascii=False))

    def closing(self, text: str, finish: str, logprobs: tuple[TokenLogprob, ...] | None = None) -> bytes:
        self._finish = finish
        return self.text(text, logprobs) if text else b""

    def end(self, usage: Usage) -> bytes:
        self.finished = True
        piece = {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        last = {"model": self.model, "created_at": _now(), **piece, "done": True, **self.done(self._finish, usage)}
        return (json.dumps(last, separators=(",", ":"), ensure_ascii=False) + "\n").encode()

    def failure(self, exc: BaseException) -> bytes:
        self.finished = True
        return (json.dumps({"error": f"the answer failed midway: {exc}"}) + "\n").encode()

    def done(self, finish: str, usage: Usage) -> dict:
        """The last line's (or the whole answer's) end: why it ended, its counts and timings (nanoseconds)."""
        now = time.monotonic()
        return {
            "done_reason": _DONE_REASONS.get(finish, "stop"),
            "total_duration": _ns(now - self.received),
            "load_duration": 0,  # the models stay loaded: nothing was loaded for this request
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": _ns(self.first_at - self.received),
            "eval_count": usage.completion_tokens,
            "eval_duration": _ns(now - self.first_at),
        }

    def whole(self, answer: Collected, usage: Usage) -> dict:
        """A whole answer as one object (`stream: false`)."""
        piece: dict = {self._key: answer.text}
        if answer.reasoning and self.thinking:
            piece["thinking"] = answer.reasoning
        if answer.calls:
            piece["tool_calls"] = [_tool_call(c, i) for i, c in enumerate(answer.calls)]
        out = {"model": self.model, "created_at": _now()}
        out.update({"message": {"role": "assistant", **piece}} if self.chat else piece)
        if self.logprobs:
            out["logprobs"] = chat_logprobs(answer.logprobs)["content"]
        return {**out, "done": True, **self.done(answer.finish, usage)}


class NDJSONResponse(SSEResponse):
    """SSEResponse's delivery (the stream in the request's task, a disconnect cancelling it, the keep-alive when
    quiet) with NDJSON's media type."""

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str], ping: float, **options) -> None:
        super().__init__(body, headers, ping, **options)
        self.raw_headers[0] = (b"content-type", b"application/x-ndjson")  # SSEResponse puts its own first


async def _answer(
    request: Request,
    serving: Serving,
    api: ApiOptions,
    body: ChatRequest | GenerateRequest,
    job: Job,
    chat: bool,
    received: float,
    ignored: list[str],
):
    """Stream or collect one answer; the first token decides between an HTTP error and a 200."""
    first, stream = await begin(request, serving, job)
    lines = Lines(body.model, chat, received, time.monotonic(), body.think is not False, body.logprobs_top is not None)
    headers = _ignored(ignored, answer_headers(job))
    if body.stream:
        deltas = stream_answer(job, first, stream, lines)
        return NDJSONResponse(
            deltas, headers, api.ping_seconds, last=lambda _: lines.finished, keepalive=lines.keepalive()
        )
    answer = await while_connected(request, collect(job, first, stream), "mid-answer")
    return JSONResponse(lines.whole(answer, job.usage), headers=headers)


def _loaded(serving: Serving, body: ChatRequest | GenerateRequest, model: str, chat: bool) -> JSONResponse:
    """Ollama's answer to a request with nothing to answer: the model loaded (or, with keep_alive 0, unloaded).
    Tandem's models are loaded from the start and stay so."""
    if model not in models(serving):
        raise ApiError(404, f"model '{body.model}' not found", param="model", code="model_not_found")
    unload = body.keep_alive in (0, "0", "0s", "0m")
    piece = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return JSONResponse(
        {
            "model": body.model,
            "created_at": _now(),
            **piece,
            "done": True,
            "done_reason": "unload" if unload else "load",
        }
    )


@router.post("/api/chat", dependencies=KEYED)
async def chat(body: ChatRequest, request: Request, serving: ServingDep, api: ApiOptionsDep):
    received = time.monotonic()
    model = _model(serving, body.model)
    if not body.messages:
        return _loaded(serving, body, model, chat=True)
    job = await serving.prepare(chat_input(body, model, request.state.key))
    return await _answer(request, serving, api, body, job, True, received, body.not_applied())


@router.post("/api/generate", dependencies=KEYED)
async def generate(body: GenerateRequest, request: Request, serving: ServingDep, api: ApiOptionsDep):
    received = time.monotonic()
    model = _model(serving, body.model)
    if not body.prompt:
        return _loaded(serving, body, model, chat=False)
    job = await serving.prepare(generate_input(body, model, request.state.key))
    return await _answer(request, serving, api, body, job, False, received, body.not_applied())


# -- embeddings ------------------------------------------------------------------------------------------------------


@router.post("/api/embed", dependencies=KEYED)
async def embed(body: EmbedRequest, serving: ServingDep):
    received = time.monotonic()
    vectors, tokens = await serving.embed(_model(serving, body.model), body.texts)
    return JSONResponse(
        {
            "model": body.model,
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": _ns(time.monotonic() - received),
            "load_duration": 0,
            "prompt_eval_count": tokens,
        },
        headers=_ignored(body.not_applied()),
    )


@router.post("/api/embeddings", dependencies=KEYED)
async def embeddings(body: EmbeddingsRequest, serving: ServingDep):
    (vector,), _ = await serving.embed(_model(serving, body.model), [body.prompt])
    return JSONResponse({"embedding": vector.tolist()}, headers=_ignored(body.not_applied()))


# -- the models ------------------------------------------------------------------------------------------------------


@router.get("/api/tags", dependencies=KEYED)
async def tags(serving: ServingDep):
    modified = _iso(serving.created)
    return {
        "models": [
            {"name": m, "model": m, "modified_at": modified, "tandem": _about(card)}
            for m, card in models(serving).items()
        ]
    }


def _about(card: dict) -> dict:
    """Tandem's own facts of a model, beside Ollama's fields: where it runs and which endpoints serve it."""
    return {"locality": card["locality"], "endpoints": card["endpoints"]}


@router.post("/api/show", dependencies=KEYED)
async def show(body: ShowRequest, serving: ServingDep):
    card = models(serving).get(_model(serving, body.model_name))
    if card is None:
        raise ApiError(404, f"model '{body.model_name}' not found", param="model", code="model_not_found")
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": {},
            # What Ollama's clients read of a model: `<architecture>.context_length`, the window a prompt must fit.
            "model_info": {"general.architecture": "tandem", "tandem.context_length": card["context_length"]},
            "capabilities": card["capabilities"],
            "modified_at": _iso(serving.created),
            "tandem": _about(card),
        },
        headers=_ignored(body.unknown()),
    )


@router.get("/api/ps", dependencies=KEYED)
async def running(serving: ServingDep):
    """The endpoints that can serve now (Tandem loads every model at start-up and keeps it)."""
    ready, _ = await serving.readiness()
    return {
        "models": [
            {"name": e["name"], "model": e["name"], "tandem": {"role": e["role"], "locality": e["locality"]}}
            for e in serving.endpoints()
            if ready.get(e["name"])
        ]
    }


async def _not_served(request: Request):
    raise ApiError(
        501,
        f"{request.url.path} is not served: Tandem serves the models its configuration names ([device], [clouds.*]) "
        "and does not pull, push, create, copy or delete models.",
        code="not_implemented",
    )


for _path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs/{digest}"):
    router.add_api_route(_path, _not_served, methods=["POST", "DELETE", "HEAD"], dependencies=KEYED)


# -- the probes ------------------------------------------------------------------------------------------------------


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
async def root():
    return "Ollama is running"


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version():
    return {"version": OLLAMA_VERSION}
