"""uvicorn's httptools protocol, writing to the socket as few times as a response allows.

On a small machine a socket write that wakes the client costs the writer ~0.1 ms and the client a wake-up
(BENCHMARKS.md, gateway overhead), so:

- a response's status line and headers go out in the same write as its first body bytes (uvicorn writes
  `http.response.start` at once and the first body chunk in a second write). A streamed answer sends its
  headers and first token back to back anyway (the status is held until the first token exists), so
  nothing reaches the client later than before;
- within one turn of the event loop the first write goes out at once and any later ones are joined and sent
  at the end of the turn: chunks the upstream delivered together (a burst under load, the answer's last
  token with its usage and [DONE]) cost one write, while a token that arrives on its own, as they do from a
  generating model, is written the moment it is relayed.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from endpoints.errors import ApiError
from endpoints.guard import new_request_id


class _CoalescingWrites:
    """Wraps the connection's transport (see the module's docstring). `hold_next_write()` makes the next
    write wait for the one after it (the headers for the first body bytes), or for the end of the turn."""

    __slots__ = ("_held", "_hold_next", "_later", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None  # the headers, waiting for the first body bytes
        self._hold_next = False
        self._later: list[bytes] | None = None  # None: nothing written yet in this turn

    def hold_next_write(self) -> None:
        self._hold_next = True

    def write(self, data: bytes) -> None:
        if self._hold_next:
            self._hold_next = False
            self._held = bytes(data)
            self._end_turn_soon()
            return
        if self._held is not None:  # the first body bytes: out now, behind the headers
            data = b"".join([*(self._later or ()), self._held, data])
            self._held = None
            self._later = []  # the turn's end is already scheduled (by the hold)
            self._transport.write(data)
        elif self._later is None:
            self._transport.write(data)
            self._later = []
            self._end_turn_soon()
        else:
            self._later.append(bytes(data))

    def _end_turn_soon(self) -> None:
        asyncio.get_running_loop().call_soon(self._end_turn)

    def _end_turn(self) -> None:
        parts, self._later = self._later or [], None
        if self._held is not None:
            parts.append(self._held)
            self._held = None
        if parts and not self._transport.is_closing():
            self._transport.write(b"".join(parts))

    def close(self) -> None:
        self._end_turn()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._later or ()))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """`uvicorn.run(..., http=HttpProtocol.reading_within(seconds))`.

    A request must arrive whole (headers and body) within `read_timeout` seconds of the connection being made
    or of its first byte, or the connection is closed: uvicorn bounds only the idle time between requests, so a
    client that connects and sends nothing, or half a request, would hold a connection for good. Past uvicorn's
    `limit_concurrency` (gateway.max_connections) a request is answered 503 in the OpenAI envelope."""

    read_timeout: float = 15.0

    @classmethod
    def reading_within(cls, seconds: float) -> type[HttpProtocol]:
        return type(cls.__name__, (cls,), {"read_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingWrites(transport))  # type: ignore[arg-type]
        self._read_deadline: asyncio.TimerHandle | None = None
        self._start_read_deadline()
        # uvicorn answers a request over its `limit_concurrency` with a bare text/plain 503; this protocol checks
        # the same limit itself and answers in the OpenAI envelope (see on_headers_complete).
        self._concurrency_limit, self.limit_concurrency = self.limit_concurrency, None

    def _start_read_deadline(self) -> None:
        self._stop_read_deadline()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_too_slow)

    def _stop_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_too_slow(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._start_read_deadline()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        # A request is complete enough for the app to answer: its response's first write is the headers.
        self.transport.hold_next_write()
        limit = self._concurrency_limit
        if limit is None or (len(self.connections) < limit and len(self.tasks) < limit):
            super().on_headers_complete()
            return
        app, self.app = self.app, _overloaded
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._stop_read_deadline()
        super().on_message_complete()


async def _overloaded(scope, receive, send) -> None:
    error = ApiError(
        503,
        "Tandem is serving its maximum number of connections and requests (gateway.max_connections); retry shortly.",
        code="overloaded",
        retry=True,
        headers={"Retry-After": "1", "Connection": "close", "x-request-id": new_request_id()},
    )
    response = error.response(scope.get("path", ""))
    await send({"type": "http.response.start", "status": 503, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
