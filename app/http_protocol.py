"""uvicorn's httptools protocol, with a response's status line and headers sent in the same `send()` as its
first body bytes.

uvicorn writes `http.response.start` to the socket at once and the first body chunk in a second write. On
loopback each write wakes the client, and on a small machine the kernel often runs the woken client on the
gateway's own core, ahead of the gateway: the gateway then waits ~0.4 ms before it can write the first token
behind the headers (BENCHMARKS.md, gateway overhead). Holding the headers until the first body write, or at
most until the end of the current event-loop turn, makes that one write and one wake-up. A streamed answer
sends its headers and first token back to back (the status is held until the first token exists anyway), so
nothing reaches the client later than before.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _HeadersWithFirstBody:
    """Wraps the connection's transport. After `hold_next_write()`, the next write is held back and sent
    together with the write after it, or alone when the loop turn ends without one."""

    __slots__ = ("_held", "_hold_next", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._hold_next = False

    def hold_next_write(self) -> None:
        self._hold_next = True

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif self._hold_next:
            self._hold_next = False
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self._flush)
            return
        self._transport.write(data)

    def _flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """`uvicorn.run(..., http=HttpProtocol)`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadersWithFirstBody(transport))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        # A request is complete enough for the app to answer: its response's first write is the headers.
        self.transport.hold_next_write()
        super().on_headers_complete()
