"""What every HTTP request to the gateway passes through before any route (pure ASGI, so a streamed answer's
chunks pay one function call here, nothing more):

- a request id: every response carries `x-request-id`. A route that keeps a trace sets the trace's id itself
  (`GET /v1/requests/{id}` finds it); any other response — a validation error, an unknown route — gets a fresh
  one, so a user can always quote one;
- a body-size limit (`gateway.max_body_bytes`): a larger body is refused with 413 by its Content-Length before
  it is read; a body sent without one (chunked) is read here first, and refused as soon as it grows past it;
- the error envelope (OpenAI's, or Anthropic's under its paths: endpoints/errors.py) for anything that escapes a
  route: a bug answers 500 with the envelope, never a bare `text/plain` 500, and the process keeps serving.
"""

from __future__ import annotations

import logging
import uuid

from endpoints.errors import ApiError

log = logging.getLogger(__name__)

_REQUEST_ID = b"x-request-id"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


class RequestGuard:
    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = message.get("headers") or []
                if not any(name == _REQUEST_ID for name, _ in headers):
                    message = {**message, "headers": [*headers, (_REQUEST_ID, new_request_id().encode())]}
            await send(message)

        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(send_with_id, _too_large(declared, limit), scope)
            return
        if declared is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # A body without a Content-Length (chunked) is read here, up to the limit, before any route sees it.
            body = await _read_body(receive, limit)
            if body is None:
                await self._refuse(send_with_id, _too_large(None, limit), scope)
                return
            receive = _replay(body, receive)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise  # mid-body: the server can only drop the connection
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            error = ApiError(500, f"Internal error: {type(exc).__name__}: {exc}", code="internal_error")
            await self._refuse(send_with_id, error, scope)

    @staticmethod
    async def _refuse(send, error: ApiError, scope) -> None:
        response = error.response(scope.get("path", ""))
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None once it grows past `limit` (or the client leaves)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _too_large(size: int | None, limit: int) -> ApiError:
    what = f"{size} bytes" if size is not None else "larger"
    return ApiError(
        413, f"The request body is {what}; this gateway accepts at most {limit} bytes.", code="request_too_large"
    )
