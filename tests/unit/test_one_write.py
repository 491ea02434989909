"""Fewer socket writes on the first token's path: the gateway's HTTP protocol sends a response's headers with
its first body bytes (app/http_protocol.py), and the cloud backend's transport sends a request in one write
(clients/openai_compat.py). How many writes happen is pinned on recording fakes (a socket on an idle machine
may merge two writes anyway); that HTTP still works is checked over real loopback sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from app.http_protocol import HttpProtocol, _HeadersWithFirstBody
from app.launcher import free_port
from clients.openai_compat import _OneWriteTransport, _RequestInOneWrite
from tests.conftest import dead_port


class _RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default=None):
        return ("peer", name)


def test_held_headers_go_out_with_the_first_body_write() -> None:
    async def main() -> list[bytes]:
        raw = _RecordingTransport()
        t = _HeadersWithFirstBody(raw)
        t.write(b"before ")  # nothing held: written through
        t.hold_next_write()
        t.write(b"HEADERS ")
        assert raw.writes == [b"before "]
        t.write(b"BODY")
        t.write(b" more")  # only the one write after the headers is joined
        await asyncio.sleep(0)  # the end-of-turn flush finds nothing left to send
        return raw.writes

    assert asyncio.run(main()) == [b"before ", b"HEADERS BODY", b" more"]


def test_held_headers_are_sent_alone_when_no_body_follows_in_the_same_loop_turn() -> None:
    async def main() -> tuple[list[bytes], list[bytes], _RecordingTransport]:
        raw = _RecordingTransport()
        t = _HeadersWithFirstBody(raw)
        t.hold_next_write()
        t.write(b"HEADERS")
        await asyncio.sleep(0.01)
        after_turn = list(raw.writes)
        t.hold_next_write()
        t.write(b"H2")
        t.close()  # closing sends what is held first
        return after_turn, raw.writes, raw

    after_turn, writes, raw = asyncio.run(main())
    assert after_turn == [b"HEADERS"]
    assert writes == [b"HEADERS", b"H2"] and raw.closed
    assert _HeadersWithFirstBody(raw).get_extra_info("socket") == ("peer", "socket")  # the rest is delegated


async def _app(scope, receive, send) -> None:
    """Streams `n` events; `gap` seconds before the first, so the headers must go out on their own."""
    if scope["type"] != "http":
        return
    query = dict(p.split("=") for p in scope["query_string"].decode().split("&") if p)
    gap, n = float(query.get("gap", 0)), int(query.get("n", 3))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    if gap:
        await asyncio.sleep(gap)
    for i in range(n):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, http=HttpProtocol, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _read_until(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {data!r}"
        data += chunk
    return data


def test_streamed_responses_arrive_whole_on_a_kept_alive_connection(server_url: str) -> None:
    port = int(server_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for _ in range(3):  # every response on the connection is held and released, not just the first
            sock.sendall(b"GET /?n=3 HTTP/1.1\r\nHost: x\r\n\r\n")
            response = _read_until(sock, b"0\r\n\r\n")
            assert response.startswith(b"HTTP/1.1 200 OK\r\n")
            assert response.count(b"data: ") == 3 and b"data: 2\n\n" in response


def test_headers_still_arrive_while_the_body_is_late(server_url: str) -> None:
    with httpx.Client(timeout=5) as client, client.stream("GET", server_url + "/?gap=0.5&n=1") as response:
        t_headers = time.monotonic()
        assert response.status_code == 200
        body = response.read()
        t_body = time.monotonic()
    assert body == b"data: 0\n\n"
    assert t_body - t_headers > 0.3  # the headers did not wait for the body


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise AssertionError(f"no content-length in {head!r}")


class _RecordingStream:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        self.writes.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return b"HTTP/1.1 200 OK\r\n"

    async def aclose(self) -> None:
        self.closed = True


def test_a_request_is_one_write_at_the_first_read_and_dropped_on_close() -> None:
    async def main() -> None:
        raw = _RecordingStream()
        stream = _RequestInOneWrite(raw)  # type: ignore[arg-type]
        for part in (b"POST / HTTP/1.1\r\n\r\n", b'{"a": 1}', b""):  # headers, body, end of message
            await stream.write(part, timeout=1.0)
        assert raw.writes == []
        assert await stream.read(100) == b"HTTP/1.1 200 OK\r\n"
        assert raw.writes == [b'POST / HTTP/1.1\r\n\r\n{"a": 1}']
        await stream.read(100)
        assert len(raw.writes) == 1  # nothing new to send
        await stream.write(b"abandoned")
        await stream.aclose()
        assert raw.closed and len(raw.writes) == 1

    asyncio.run(main())


def test_a_request_arrives_whole_and_its_answer_comes_back() -> None:
    """Over a real socket: the server reads headers and JSON body intact."""
    received: list[bytes] = []

    async def main() -> None:
        got = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                received.append(data)
                if b"\r\n\r\n" in b"".join(received):
                    head, _, body = b"".join(received).partition(b"\r\n\r\n")
                    if len(body) >= _content_length(head):
                        break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
            await writer.drain()
            got.set()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(transport=_OneWriteTransport()) as client:
            payload = {"messages": [{"role": "user", "content": "x" * 2000}]}
            response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=payload)
            assert response.status_code == 200 and response.json() == {}
            await asyncio.wait_for(got.wait(), 5)
            head, _, body = b"".join(received).partition(b"\r\n\r\n")
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1") and json.loads(body) == payload

    asyncio.run(main())


def test_large_requests_and_refused_connections_behave_as_with_plain_httpx() -> None:
    async def main() -> None:
        async def echo_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(_content_length(head))
            reply = str(len(body)).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo_length, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(transport=_OneWriteTransport()) as client:
            big = b"y" * (3 << 20)  # larger than any socket buffer: written while the server reads
            response = await client.post(f"http://127.0.0.1:{port}/", content=big)
            assert response.text == str(len(big))
        async with httpx.AsyncClient(transport=_OneWriteTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{dead_port()}/")

    asyncio.run(main())
