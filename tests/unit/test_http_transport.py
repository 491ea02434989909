"""The cloud backends' HTTP/1.1 transport (clients/http_transport.py) against real loopback servers that
write raw bytes, so every answer shape and failure is exactly what the test says."""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx
import pytest
import trustme

from clients.http_transport import AsyncioHTTPTransport, _Connection
from tests.conftest import dead_port


class _Server:
    """A loopback server answering the n-th request with `answer(n, head, body)`: raw bytes, or a list of
    bytes, pauses (float seconds), b"<close>" and b"<silent>" (nothing more until the client closes).
    Counts connections and records what each request looked like on the wire."""

    def __init__(self, answer, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.tls = tls
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed_by_client = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> _Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()

    @property
    def url(self) -> str:
        port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://{'localhost' if self.tls else '127.0.0.1'}:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client += 1
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                reply = self.answer(len(self.requests), head, body)
                for part in reply if isinstance(reply, list) else [reply]:
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                    elif part == b"<close>":
                        return
                    elif part == b"<silent>":  # say nothing more until the client gives up
                        if not await reader.read(1):
                            self.closed_by_client += 1
                        return
                    else:
                        writer.write(part)
                        await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_client += 1
        finally:
            writer.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def _chunked(*parts: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return out + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_a_request_goes_out_in_one_write_and_arrives_whole() -> None:
    class Recording:
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return False

    connection = _Connection(AsyncioHTTPTransport(), ("http", "x", 80))
    recording = Recording()
    connection.connection_made(recording)  # type: ignore[arg-type]
    sending = asyncio.ensure_future(connection.send(b"POST / HTTP/1.1\r\n\r\n", b'{"a":1}', {"read": 1.0}))
    await asyncio.sleep(0)
    assert recording.writes == [b'POST / HTTP/1.1\r\n\r\n{"a":1}']  # head and body: one write, one wake-up
    connection.data_received(b"HTTP/1.1 204 No Content\r\n\r\n")
    await sending

    payload = {"messages": [{"role": "user", "content": "x" * 2000}]}
    async with (
        _Server(lambda n, head, body: _ok(b"{}")) as server,
        httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client,
    ):
        response = await client.post(server.url + "/v1/chat/completions?x=1", json=payload)
        assert response.status_code == 200 and response.json() == {}
        head, body = server.requests[0]
        assert head.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
        assert b"\r\nhost: 127.0.0.1:" in head.lower() and json.loads(body) == payload


async def test_kept_alive_connections_are_reused_for_both_body_framings() -> None:
    def answer(n, head, body):
        return _ok(b"plain %d" % n) if n % 2 else _chunked(b"data: a\n\n", b"data: b\n\n")

    async with _Server(answer) as server, httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
        for n in range(1, 5):
            response = await client.get(server.url + "/")
            assert response.text == (f"plain {n}" if n % 2 else "data: a\n\ndata: b\n\n")
        async with client.stream("GET", server.url + "/") as response:
            assert [line async for line in response.aiter_lines() if line] == ["plain 5"]
        assert server.connections == 1


async def test_connection_close_and_close_delimited_bodies() -> None:
    def answer(n, head, body):
        if n == 1:
            return [_ok(b"once", b"connection: close\r\n"), b"<close>"]
        return [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil ", b"the end", b"<close>"]

    async with _Server(answer) as server, httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
        assert (await client.get(server.url + "/")).text == "once"
        assert (await client.get(server.url + "/")).text == "until the end"  # no length: the close ends it
        assert server.connections == 2


async def test_broken_answers_raise_httpx_errors_and_the_transport_serves_on() -> None:
    def answer(n, head, body):
        if n == 1:  # chunked body cut short by the server
            return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", b"<close>"]
        if n == 2:
            return [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", b"<close>"]
        if n == 3:
            return [b"NOT HTTP AT ALL\r\n\r\n", b"<close>"]
        if n == 4:
            return [
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
                b"<silent>",
            ]
        if n == 5:
            return b"<close>"
        return _ok(b"fine")

    async with _Server(answer) as server, httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
        for expected in ("before the end", "before the end", "malformed", "switched protocols", "without sending"):
            with pytest.raises(httpx.RemoteProtocolError, match=expected):
                await client.get(server.url + "/")
        assert (await client.get(server.url + "/")).text == "fine"


async def test_timeouts_are_httpx_timeouts() -> None:
    def answer(n, head, body):
        if n == 1:
            return b"<silent>"
        return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n", b"<silent>"]  # stalls

    async with (
        _Server(answer) as server,
        httpx.AsyncClient(transport=AsyncioHTTPTransport(), timeout=httpx.Timeout(5.0, read=0.3)) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await client.get(server.url + "/")
        async with client.stream("GET", server.url + "/") as response:
            chunks = []
            with pytest.raises(httpx.ReadTimeout):
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
            assert chunks == [b"abc"]
    await asyncio.sleep(0.05)
    assert server.closed_by_client == 2  # both connections were closed, not left hanging

    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
            await client.get(f"http://127.0.0.1:{dead_port()}/")


async def test_the_pool_limit_waits_times_out_and_frees_slots() -> None:
    def answer(n, head, body):
        return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n", 0.3, b"0\r\n\r\n"]

    transport = AsyncioHTTPTransport(max_connections=1)
    async with (
        _Server(answer) as server,
        httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, pool=0.1)) as client,
    ):
        async with client.stream("GET", server.url + "/") as held:
            assert held.status_code == 200
            with pytest.raises(httpx.PoolTimeout):
                await client.get(server.url + "/")
        assert transport._open == 0  # the held answer was closed half-read: its connection closed, slot free
        # A waiter gets the slot as soon as the answer before it is read to its end.
        slow = asyncio.ensure_future(client.get(server.url + "/"))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(client.get(server.url + "/", timeout=httpx.Timeout(5.0, pool=2.0)))
        assert (await slow).text == "hi" and (await waiting).text == "hi"
        assert server.connections == 2  # the second connection served both


async def test_a_woken_waiter_that_leaves_passes_the_slot_on() -> None:
    def answer(n, head, body):
        return (
            [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n", b"<silent>"] if n == 1 else _ok(b"ok")
        )

    transport = AsyncioHTTPTransport(max_connections=1)
    async with (
        _Server(answer) as server,
        httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, pool=1.0)) as client,
    ):
        held = await client.send(client.build_request("GET", server.url + "/"), stream=True)
        first = asyncio.ensure_future(client.get(server.url + "/"))
        second = asyncio.ensure_future(client.get(server.url + "/"))
        await asyncio.sleep(0.05)  # both wait for the one slot
        await held.aclose()  # frees the slot and wakes the first waiter...
        first.cancel()  # ...which leaves before it can take it
        assert (await second).text == "ok"
        assert first.cancelled()


async def test_cancelling_a_request_closes_its_connection_and_frees_its_slot() -> None:
    def answer(n, head, body):
        return b"<silent>" if n == 1 else _ok(b"next")

    transport = AsyncioHTTPTransport(max_connections=1)
    async with _Server(answer) as server, httpx.AsyncClient(transport=transport) as client:
        task = asyncio.ensure_future(client.get(server.url + "/"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.get(server.url + "/", timeout=httpx.Timeout(5.0, pool=1.0))).text == "next"
        await asyncio.sleep(0.05)
        assert server.closed_by_client == 1 and transport._open == 1


async def test_a_server_closing_an_idle_connection_costs_nothing() -> None:
    async with (
        _Server(lambda n, head, body: [_ok(b"r%d" % n), b"<close>"]) as server,
        httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client,
    ):
        assert (await client.get(server.url + "/")).text == "r1"
        await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        assert (await client.get(server.url + "/")).text == "r2"
        assert server.connections == 2


async def test_a_request_crossing_the_servers_close_of_a_kept_alive_connection_goes_again_on_a_new_one() -> None:
    # The server said keep-alive, then closes the connection when the next request arrives, answering nothing (its
    # idle timeout fired as the request came): the request is sent once more, on a new connection.
    def answer(n, head, body):
        return b"<close>" if n == 2 else _ok(b"r%d" % n)

    async with _Server(answer) as server, httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
        assert (await client.post(server.url + "/", content=b"one")).text == "r1"
        assert (await client.post(server.url + "/", content=b"two")).text == "r3"
        assert [body for _, body in server.requests] == [b"one", b"two", b"two"] and server.connections == 2

    # As llama.cpp's llama-server does after a streamed answer: keep-alive said, the connection closed at once; the
    # next request, sent straight after, may cross the close on the wire. Every one is answered.
    async with (
        _Server(lambda n, head, body: [_chunked(b"data: %d\n\n" % n), b"<close>"]) as server,
        httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client,
    ):
        answered = [(await client.post(server.url + "/", content=b"x")).text for _ in range(20)]
        assert len(set(answered)) == 20 and all(text.startswith("data: ") for text in answered)


async def test_a_request_is_never_sent_again_after_an_answers_first_byte_nor_twice() -> None:
    def answer(n, head, body):
        if n == 2:  # on the kept-alive connection the answer begins, then the server closes it
            return [b"HTTP/1.1 200", b"<close>"]
        if n in (4, 5):  # a kept-alive connection closed unanswered, then the new connection closed unanswered too
            return b"<close>"
        return _ok(b"r%d" % n)

    async with _Server(answer) as server, httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
        assert (await client.get(server.url + "/")).text == "r1"
        with pytest.raises(httpx.RemoteProtocolError):  # a byte came: the server may have begun on it
            await client.get(server.url + "/")
        assert len(server.requests) == 2
        assert (await client.get(server.url + "/")).text == "r3"
        with pytest.raises(httpx.RemoteProtocolError, match="without sending"):
            await client.get(server.url + "/")
        assert len(server.requests) == 5 and server.connections == 3  # sent again once, on a new connection
        assert (await client.get(server.url + "/")).text == "r6"


async def test_connections_idle_past_their_expiry_are_not_reused() -> None:
    async with (
        _Server(lambda n, head, body: _ok(b"r%d" % n)) as server,
        httpx.AsyncClient(transport=AsyncioHTTPTransport(keepalive_expiry=0.2)) as client,
    ):
        assert (await client.get(server.url + "/")).text == "r1"
        assert (await client.get(server.url + "/")).text == "r2"
        assert server.connections == 1
        await asyncio.sleep(0.3)  # the server still holds it open, but it may be about to close it
        assert (await client.get(server.url + "/")).text == "r3"
        assert server.connections == 2


async def test_large_bodies_both_ways_survive_flow_control() -> None:
    big_answer = bytes(range(256)) * (24 << 10)  # 6 MiB: reading pauses and resumes

    def answer(n, head, body):
        if n == 1:
            reply = str(len(body)).encode()
            return _ok(reply)
        return _ok(big_answer)

    async with _Server(answer) as server, httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:
        big = b"y" * (3 << 20)  # larger than any socket buffer: written while the server reads
        assert (await client.post(server.url + "/", content=big)).text == str(len(big))
        received = bytearray()
        async with client.stream("GET", server.url + "/") as response:
            async for chunk in response.aiter_raw():
                if not received:
                    await asyncio.sleep(0.3)  # a slow reader: the answer piles up and reading pauses
                received += chunk
        assert bytes(received) == big_answer


async def test_https_verifies_the_server() -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)

    async with _Server(lambda n, head, body: _ok(b"secret"), tls=server_tls) as server:
        async with httpx.AsyncClient(transport=AsyncioHTTPTransport(ssl_context=client_tls)) as client:
            assert (await client.get(server.url + "/")).text == "secret"
            assert (await client.get(server.url + "/")).text == "secret"
        assert server.connections == 1
        async with httpx.AsyncClient(transport=AsyncioHTTPTransport()) as client:  # the system's CAs only
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(server.url + "/")
