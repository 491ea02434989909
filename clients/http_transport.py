"""The cloud backends' HTTP/1.1 transport for httpx: asyncio protocols and httptools' parser (llhttp, the
parser uvicorn uses), with a keep-alive connection pool.

Why not httpx's default transport (httpcore + h11 + anyio): the gateway's own cost is the time its Python
spends on the first token's path, and about half of that was the upstream request — building it, writing
it, parsing the answer's head and first chunk through three libraries of layers (timeline and A/B in
BENCHMARKS.md, gateway overhead). This transport does the same HTTP in one asyncio protocol: a request's
head and body go out in one write, the answer's bytes are parsed as they arrive, and its body chunks are
handed to httpx unchanged. httpx keeps everything above the transport (URLs, headers, timeouts, errors,
`Response`); proxies configured in the environment still go through httpx's own proxy transports.

A request that meets a kept-alive connection as the server closes it is sent once more, on a new connection, when
not one byte of an answer came back: a server may close an idle connection at any moment (its keep-alive timeout)
or after a streamed answer (llama.cpp's llama-server does, though it said keep-alive), and the close can cross the
request on the wire. httpcore and urllib3 look for a close before they reuse a connection, which the same race
defeats; Go's net/http retries exactly this case (a reused connection, nothing read), as here. A request that got
any byte of an answer, or failed on a new connection, is never sent again.

Timeouts are httpx's per request: connect, write, read (each wait for the next bytes), pool (waiting for a
connection slot). Failures raise httpx's exceptions, so callers cannot tell the transports apart. A
connection goes back to the pool only after its answer was read to the end with keep-alive; an answer
closed early (a client gone, a cancelled race) closes its connection. HEAD requests and upgrades are not
supported (an OpenAI-compatible API has neither).
"""

from __future__ import annotations

import asyncio
import collections
import ssl

import httptools
import httpx

from clients.deadline import Deadline

_PAUSE_READING_AT = 1 << 18  # bytes received but not yet taken by the reader
_RESUME_READING_AT = 1 << 16


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: at most one request at a time."""

    def __init__(self, pool: AsyncioHTTPTransport, key: tuple) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.state = "connecting"  # connecting | active | idle | closed
        self.idle_since = 0.0  # loop time
        self.reused = False  # taken from the idle pool for the request in flight
        self._received = 0  # bytes of an answer to the request in flight
        self.read_timeout: float | None = None  # httpx's read timeout of the request in flight: each wait for bytes
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._status: int | None = None
        self._head_ready = False
        self._complete = False  # the answer's last byte has arrived
        self._length_known = False  # content-length or chunked: the end is not the connection's close
        self._keep_alive = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._reading_paused = False
        self._error: httpx.TransportError | None = None
        self._lost = False
        self._waiter: asyncio.Future | None = None
        self._read_deadline = Deadline(None)  # the request in flight's read timeout, for each wait for bytes
        self._writable: asyncio.Future | None = None

    # -- asyncio protocol ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        if self._parser is None or self._complete:
            # Bytes nobody asked for (a server talking out of turn): this connection cannot be trusted again.
            self._fail(httpx.RemoteProtocolError("the server sent data outside an answer"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the server switched protocols, which this transport does not do"))
            return
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP answer from the server: {exc}"))
            return
        if self._buffered > _PAUSE_READING_AT and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._read_deadline.close()
        if self._head_ready and not self._complete and self._error is None:
            if self._length_known:
                self._error = httpx.RemoteProtocolError("the server closed the connection before the end of its answer")
            else:
                self._complete = True  # a body delimited by the connection's close has ended
                self._keep_alive = False
        elif not self._head_ready and self._parser is not None and self._error is None:
            self._error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
        writable = self._writable
        if writable is not None and not writable.done():
            writable.set_result(None)
        self._wake()
        if self.state == "idle":
            self.pool._discard(self)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- httptools callbacks -------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._length_known = True

    def on_headers_complete(self) -> None:
        if self._complete:  # a second answer to one request: keep the first, never reuse the connection
            self._keep_alive = False
            return
        status = self._parser.get_status_code()  # type: ignore[union-attr]
        if 100 <= status < 200:  # an interim answer (e.g. 100 Continue): the real one follows
            self._headers = []
            self._length_known = False
            return
        self._status = status
        self._head_ready = True

    def on_body(self, body: bytes) -> None:
        if self._complete:
            return
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._head_ready and not self._complete:
            self._complete = True
            self._keep_alive = self._parser.should_keep_alive()  # type: ignore[union-attr]

    # -- used by the pool and the response stream ----------------------------------------------------
    def _fail(self, error: httpx.TransportError) -> None:
        if self._error is None:
            self._error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, what: str) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            with self._read_deadline:  # per read on the hot path: not asyncio.timeout (clients/deadline.py)
                await self._waiter
        except TimeoutError:
            raise httpx.ReadTimeout(f"no {what} from the server within {self.read_timeout:g} s") from None
        finally:
            self._waiter = None

    async def send(self, head: bytes, body: bytes, timeouts: dict) -> None:
        self.read_timeout = timeouts.get("read")
        self._read_deadline.close()
        self._read_deadline = Deadline(self.read_timeout)
        self._parser = httptools.HttpResponseParser(self)
        self._headers, self._status, self._head_ready = [], None, False
        self._complete = self._length_known = self._keep_alive = False
        self._chunks.clear()
        self._buffered = 0
        self._received = 0
        if self._lost or self.transport is None or self.transport.is_closing():
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        self.transport.write(head + body)
        if self._writable is not None:  # the kernel's buffer is full: wait for it to drain
            try:
                async with asyncio.timeout(timeouts.get("write")):
                    await self._writable
            except TimeoutError:
                raise httpx.WriteTimeout("the server did not take the request in time") from None
        while not self._head_ready:
            if self._error is not None:
                raise self._error
            await self._wait("answer")

    def response(self) -> httpx.Response:
        return httpx.Response(
            self._status,  # type: ignore[arg-type]
            headers=self._headers,
            stream=_Body(self),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._reading_paused and self._buffered < _RESUME_READING_AT and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
                return chunk
            if self._complete:
                return None
            if self._error is not None:
                raise self._error
            await self._wait("data")

    @property
    def closed_unanswered(self) -> bool:
        """The server closed this reused connection before a byte of an answer to the request in flight: it
        cannot have begun on the request, which may go again on a new connection."""
        return self.reused and self._lost and self._received == 0

    @property
    def reusable(self) -> bool:
        return (
            self._complete
            and self._keep_alive
            and self._error is None
            and not self._lost
            and self.transport is not None
            and not self.transport.is_closing()
        )


class _Body(httpx.AsyncByteStream):
    def __init__(self, connection: _Connection) -> None:
        self._connection: _Connection | None = connection

    async def __aiter__(self):
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        while (chunk := await connection.next_chunk()) is not None:
            yield chunk

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.pool._check_in(connection)


class AsyncioHTTPTransport(httpx.AsyncBaseTransport):
    """`httpx.AsyncClient(transport=AsyncioHTTPTransport(...))`: HTTP/1.1 over http:// and https://."""

    def __init__(
        self,
        max_connections: int = 100,
        max_keepalive_connections: int = 20,
        # Below the 5 s after which uvicorn (llama.cpp's Python server, vLLM) closes an idle connection: a
        # request must not go out on a connection the server is closing at that moment.
        keepalive_expiry: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._max = max_connections
        self._max_idle = max_keepalive_connections
        self._expiry = keepalive_expiry
        self._ssl_context = ssl_context
        self._idle: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self._open = 0  # connections counted against max_connections: connecting, active or idle
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
        if request.method == "HEAD":
            raise httpx.UnsupportedProtocol("HEAD requests are not supported by this transport")
        timeouts = request.extensions.get("timeout") or {}
        body = b"".join([part async for part in request.stream])
        if request.headers.get("transfer-encoding", "").lower() == "chunked":
            body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), url.raw_path)]
        head += [b"%s: %s\r\n" % (name, value) for name, value in request.headers.raw]
        head.append(b"\r\n")
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        head_bytes = b"".join(head)
        connection = await self._check_out(key, timeouts)
        try:
            await self._send(connection, head_bytes, body, timeouts)
        except httpx.RemoteProtocolError:
            if not connection.closed_unanswered:
                raise
            connection = await self._check_out(key, timeouts, fresh=True)  # once: a new connection is not retried
            await self._send(connection, head_bytes, body, timeouts)
        return connection.response()

    async def _send(self, connection: _Connection, head: bytes, body: bytes, timeouts: dict) -> None:
        try:
            await connection.send(head, body, timeouts)
        except BaseException:
            self._discard(connection)
            raise

    async def aclose(self) -> None:
        self._closed = True
        for connection in list(self._idle):
            self._discard(connection)

    # -- the pool ------------------------------------------------------------------------------------
    async def _check_out(self, key: tuple, timeouts: dict, fresh: bool = False) -> _Connection:
        """A connection for `key`: an idle one kept alive (unless `fresh`), else a new one once a slot is free."""
        loop = asyncio.get_running_loop()
        pool_timeout = timeouts.get("pool")
        deadline = None if pool_timeout is None else loop.time() + pool_timeout
        while True:
            now = loop.time()
            for connection in list(self._idle):
                if now - connection.idle_since > self._expiry or connection.transport.is_closing():
                    self._discard(connection)  # the server may be about to close it, or has
            for connection in () if fresh else reversed(self._idle):
                if connection.key == key:
                    del self._idle[connection]
                    connection.state = "active"
                    connection.reused = True
                    return connection
            if self._open >= self._max and self._idle:
                self._discard(next(iter(self._idle)))  # an idle connection elsewhere gives up its slot
            if self._open < self._max:
                self._open += 1
                return await self._connect(key, timeouts.get("connect"))
            waiter = loop.create_future()
            self._slot_waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake_slot_waiter()  # woken but leaving: the next one gets the free slot
                if isinstance(exc, TimeoutError):
                    raise httpx.PoolTimeout(f"no connection became free within {pool_timeout:g} s") from None
                raise
            finally:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)

    async def _connect(self, key: tuple, connect_timeout: float | None) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = httpx.create_ssl_context()
            tls = self._ssl_context
        connection = _Connection(self, key)
        try:
            async with asyncio.timeout(connect_timeout):
                await loop.create_connection(
                    lambda: connection, host, port, ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError:
            self._release_slot()
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {connect_timeout:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            self._release_slot()
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        except BaseException:
            self._release_slot()
            if connection.transport is not None:
                connection.transport.close()
            raise
        connection.state = "active"
        return connection

    def _check_in(self, connection: _Connection) -> None:
        if connection.state != "active":
            return
        if not connection.reusable or self._closed or len(self._idle) >= self._max_idle:
            self._discard(connection)
            return
        connection.state = "idle"
        connection.idle_since = asyncio.get_running_loop().time()
        connection._parser = None  # bytes arriving now are out of turn
        self._idle[connection] = None
        self._wake_slot_waiter()

    def _discard(self, connection: _Connection) -> None:
        if connection.state == "closed":
            return
        connection.state = "closed"
        self._idle.pop(connection, None)
        if connection.transport is not None:
            connection.transport.close()
        self._release_slot()

    def _release_slot(self) -> None:
        self._open -= 1
        self._wake_slot_waiter()

    def _wake_slot_waiter(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
