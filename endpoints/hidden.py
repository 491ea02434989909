"""The worker's HTTP surface: hidden-state transports, health and metrics.

Two transports carry the same binary frames (clients/hat/wire.py; protocol in app/worker/engine.py):

WebSocket `/v1/hidden/ws` — one session per connection. Binary messages only, one frame per message. The first
message is the device's OPEN frame; the worker answers with its OPEN frame (JSON session info), then one reply
per tensor frame as it is computed, in the order the frames were sent (a device may send chunk k+1 before chunk
k's reply: that is the prefill pipelining of HAT §3.3). Close codes: 4401 bad/missing token, 4408 session idle
for longer than the idle timeout, 1013 worker full or not ready, 1008 bad OPEN, 1000 after the device's CLOSE.

POST + SSE, for networks that block WebSockets:

    POST /v1/hidden/sessions              body: the OPEN frame (application/octet-stream)
                                          200 body: the worker's OPEN reply frame (binary); header x-tandem-session
    POST /v1/hidden/sessions/{id}/frames  body: one device frame (binary)
                                          200 text/event-stream: one `event: frame` per reply frame, its data the
                                          frame in standard base64, then `event: end`. A ROLLBACK or CLOSE gives no
                                          frame events. Frame-level errors (bad dtype, position...) are ERROR frames
                                          in the stream, exactly as on the WebSocket.
    DELETE /v1/hidden/sessions/{id}       close the session (same as a CLOSE frame)

Several frame POSTs of one session may be in flight at once; the engine applies them in seq order.

    POST /v1/drain                        body (optional): {"timeout": seconds}; 202: the drain's state. No new
                                          session from then on (OPEN: 503 "draining"; /health/ready: 503), out of
                                          the registry; open sessions finish, or after `timeout` are handed over
                                          (an ERROR 503 each: their devices move them). `tandem worker` drains the
                                          same way on SIGTERM, then exits.
HTTP-level failures use the OpenAI error envelope: 401 (token), 404 (unknown or expired session), 413 (body
larger than twice the frame limit), 503 (not ready, worker full).

Auth: `Authorization: Bearer <token>` when the worker has a token, compared in constant time.
`/health`, `/health/ready` and `/metrics` are open, as on the gateway.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any, Protocol

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.websockets import WebSocketDisconnect, WebSocketState

from app.worker.engine import Engine
from app.worker.sessions import EngineError, Reason, Session
from clients.hat import wire
from endpoints.errors import ApiError


class WorkerState(Protocol):
    """What the routes need of the worker process (app/worker/server.py's Worker, which includes this router:
    named here as a protocol so that the two modules do not import each other)."""

    settings: Any
    engine: Engine | None
    startup_error: str | None
    drained: dict[str, int] | None

    @property
    def ready(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    def drain(self, timeout: float) -> Any: ...

    @property
    def failure(self) -> str | None: ...

    def authorized(self, header: str | None) -> bool: ...

    def metrics(self) -> bytes: ...


log = logging.getLogger(__name__)
router = APIRouter()

_NO_SESSION = b"\0" * 16
_OPEN_LIMIT = 16 * 1024
CLOSE_UNAUTHORIZED = 4401
CLOSE_IDLE = 4408


def _worker(scope_app) -> WorkerState:
    return scope_app.state.worker


def _body_limit(engine: Engine) -> int:
    return 2 * engine.limits.max_frame_bytes + 64 * 1024


# --- WebSocket -------------------------------------------------------------------------------------


@router.websocket("/v1/hidden/ws")
async def hidden_ws(ws: WebSocket) -> None:
    worker = _worker(ws.app)
    await ws.accept()
    if not worker.authorized(ws.headers.get("authorization")):
        await ws.close(code=CLOSE_UNAUTHORIZED, reason="unauthorized: missing or wrong worker token")
        return
    engine = worker.engine
    if engine is None or not worker.ready:
        why = f"not ready: {worker.failure}" if worker.failure else "not ready: the worker is still loading its model"
        await _send_error_and_close(ws, 503, why, 1013)
        return
    try:
        msg = await asyncio.wait_for(ws.receive(), timeout=engine.limits.idle_timeout)
    except TimeoutError:
        await _send_error_and_close(ws, 408, "no OPEN frame within the idle timeout", CLOSE_IDLE)
        return
    if msg["type"] == "websocket.disconnect":
        return
    data = msg.get("bytes")
    if data is None:
        await _send_error_and_close(ws, 400, "malformed: send binary frames, not text", 1003)
        return
    try:
        session, reply = engine.open(data)
    except EngineError as e:
        code = 1013 if e.status == 503 else 1008
        await _send_error_and_close(ws, e.status, f"{e.reason.value}: {e.message}", code)
        return
    await ws.send_bytes(reply)
    await _serve_session(ws, engine, session)


async def _serve_session(ws: WebSocket, engine: Engine, session: Session) -> None:
    loop = asyncio.get_running_loop()
    expired: asyncio.Future[tuple[str, int]] = loop.create_future()

    def on_expire(message: str, status: int) -> None:  # engine thread
        loop.call_soon_threadsafe(lambda: expired.done() or expired.set_result((message, status)))

    session.on_expire = on_expire
    replies: asyncio.Queue[Future[list[bytes]] | None] = asyncio.Queue()

    async def writer() -> None:
        while True:
            fut = await replies.get()
            if fut is None:
                return
            for frame in await asyncio.wrap_future(fut):
                await ws.send_bytes(frame)

    writer_task = asyncio.create_task(writer())
    close_code, close_reason = 1000, ""
    try:
        while True:
            recv = asyncio.ensure_future(ws.receive())
            done, _ = await asyncio.wait({recv, expired, writer_task}, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                if expired in done:
                    message, status = expired.result()
                    replies.put_nowait(_done([wire.encode_error(session.id, 0, message, status)]))
                    if status == 408:
                        close_code, close_reason = CLOSE_IDLE, "session idle"
                    else:
                        close_code, close_reason = 1011, message[:120]
                break  # expired, or the writer failed (peer gone)
            msg = recv.result()
            if msg["type"] == "websocket.disconnect":
                close_code = -1
                break
            data = msg.get("bytes")
            if data is None:
                err = wire.encode_error(session.id, 0, "malformed: send binary frames, not text", 400)
                engine.count_rejection(Reason.MALFORMED)
                replies.put_nowait(_done([err]))
                continue
            replies.put_nowait(engine.submit(session, data))
            if wire.peek_kind(data) == wire.Kind.CLOSE:
                break
    except WebSocketDisconnect:
        close_code = -1
    finally:
        engine.close(session)
        replies.put_nowait(None)
        if close_code != -1 and not writer_task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer_task, timeout=5.0)
        writer_task.cancel()
        with contextlib.suppress(BaseException):
            await writer_task
        if close_code != -1 and ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.close(code=close_code, reason=close_reason)


def _done(frames: list[bytes]) -> Future[list[bytes]]:
    fut: Future[list[bytes]] = Future()
    fut.set_result(frames)
    return fut


async def _send_error_and_close(ws: WebSocket, status: int, message: str, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_bytes(wire.encode_error(_NO_SESSION, 0, message, status))
        await ws.close(code=code, reason=message[:120])


# --- POST + SSE ------------------------------------------------------------------------------------


def _require_token(worker: WorkerState, request: Request) -> None:
    if not worker.authorized(request.headers.get("authorization")):
        raise ApiError(
            401,
            "Missing or wrong worker token: send 'Authorization: Bearer <token>'.",
            code="invalid_worker_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _check(request: Request) -> Engine:
    worker = _worker(request.app)
    _require_token(worker, request)
    if worker.engine is None or not worker.ready:
        failure = worker.failure
        why = f"The worker is not ready: {failure}" if failure else "The worker is still loading its model."
        raise ApiError(503, why, code="not_ready", retry=True)
    return worker.engine


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"Frame body of {declared} bytes is larger than {limit} bytes.", code="frame_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise ApiError(413, f"Frame body is larger than {limit} bytes.", code="frame_too_large")
    return bytes(buf)


@router.post("/v1/hidden/sessions")
async def open_session(request: Request) -> Response:
    engine = _check(request)
    data = await _read_body(request, _OPEN_LIMIT)
    try:
        session, reply = engine.open(data)
    except EngineError as e:
        raise ApiError(e.status, e.message, code=e.reason.value, retry=e.status == 503) from None
    return Response(reply, media_type="application/octet-stream", headers={"x-tandem-session": session.hex})


def _session(engine: Engine, sid: str) -> Session:
    session = engine.session(sid)
    if session is None:
        raise ApiError(404, f"No open session {sid} (closed, expired or never opened).", code="unknown_session")
    return session


@router.post("/v1/hidden/sessions/{sid}/frames")
async def post_frame(sid: str, request: Request) -> StreamingResponse:
    engine = _check(request)
    session = _session(engine, sid)
    data = await _read_body(request, _body_limit(engine))
    fut = engine.submit(session, data)

    async def events() -> AsyncIterator[bytes]:
        for frame in await asyncio.wrap_future(fut):
            yield b"event: frame\ndata: " + base64.b64encode(frame) + b"\n\n"
        yield b"event: end\ndata: {}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-store"})


@router.delete("/v1/hidden/sessions/{sid}", status_code=204)
async def delete_session(sid: str, request: Request) -> Response:
    engine = _check(request)
    engine.close(_session(engine, sid), "closed by the device")
    return Response(status_code=204)


# --- health and metrics ----------------------------------------------------------------------------


# --- draining ---------------------------------------------------------------------------------------


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout: float | None = Field(default=None, ge=0, le=86400)  # seconds before hand-over (None: drain_timeout)


@router.post("/v1/drain", status_code=202)
async def drain(request: Request, body: DrainBody | None = None) -> dict:
    """Stop taking sessions, leave the registry, let the open sessions finish for up to `timeout` seconds, then hand
    the rest over (app/worker/server.py's Worker.drain). Idempotent: a second call changes nothing. The worker
    token is required, as for frames. `GET /health` says when it is done."""
    worker = _worker(request.app)
    _require_token(worker, request)
    timeout = body.timeout if body is not None else None
    worker.drain(worker.settings.drain_timeout if timeout is None else timeout)
    return _drain_state(worker)


def _drain_state(worker: WorkerState) -> dict:
    sessions = worker.engine.session_count if worker.engine is not None else 0
    return {"draining": worker.draining, "drained": worker.drained, "sessions": sessions}


# --- health and metrics ----------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> dict:
    worker = _worker(request.app)
    body: dict = {"status": "ok", "ready": worker.ready, "model": worker.settings.model}
    if worker.engine is not None:
        body["sessions"] = worker.engine.session_count
    if worker.draining:
        body.update(_drain_state(worker))
    return body


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    worker = _worker(request.app)
    if worker.draining:  # up, but placing a new session here would be refused
        return JSONResponse({"status": "draining", **_drain_state(worker)}, status_code=503)
    if worker.ready and worker.engine is not None:
        return JSONResponse({"status": "ready", **worker.engine.info()})
    failure = worker.failure
    body = {"status": "failed" if failure else "loading"}
    if failure:
        body["error"] = failure
    return JSONResponse(body, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_worker(request.app).metrics(), media_type=CONTENT_TYPE_LATEST)
