"""Fewer socket writes on the first token's path: the gateway's HTTP protocol sends a response's headers with
its first body bytes (app/http_protocol.py). How many writes happen is pinned on a recording fake (a socket on
an idle machine may merge two writes anyway); that HTTP still works is checked over real loopback sockets.
The cloud transport's one write per request is in test_http_transport.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from app.http_protocol import HttpProtocol, _CoalescingWrites
from app.launcher import free_port


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
    async def main() -> None:
        raw = _RecordingTransport()
        t = _CoalescingWrites(raw)
        t.write(b"before ")  # nothing held, first in its turn: written through
        t.hold_next_write()
        t.write(b"HEADERS ")
        assert raw.writes == [b"before "]
        t.write(b"BODY")  # the first body bytes go out at once, behind the headers
        assert raw.writes == [b"before ", b"HEADERS BODY"]
        t.write(b" more")
        await asyncio.sleep(0)
        assert raw.writes == [b"before ", b"HEADERS BODY", b" more"]

    asyncio.run(main())


def test_writes_of_one_loop_turn_after_its_first_are_joined_in_order() -> None:
    async def main() -> None:
        raw = _RecordingTransport()
        t = _CoalescingWrites(raw)
        t.write(b"a")
        t.write(b"b")
        t.write(b"c")
        assert raw.writes == [b"a"]  # the first of the turn at once, the rest at its end
        await asyncio.sleep(0)
        assert raw.writes == [b"a", b"bc"]
        t.write(b"d")  # a new turn: at once again (a token relayed on its own is never held back)
        assert raw.writes == [b"a", b"bc", b"d"]
        t.write(b"e")
        t.hold_next_write()
        t.write(b"H")
        t.write(b"X")  # what waited goes first, then the headers and their body
        assert raw.writes == [b"a", b"bc", b"d", b"eHX"]
        t.write(b"y")
        t.close()  # closing sends what waits first
        assert raw.writes == [b"a", b"bc", b"d", b"eHX", b"y"] and raw.closed

    asyncio.run(main())


def test_held_headers_are_sent_alone_when_no_body_follows_in_the_same_loop_turn() -> None:
    async def main() -> tuple[list[bytes], list[bytes], _RecordingTransport]:
        raw = _RecordingTransport()
        t = _CoalescingWrites(raw)
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
    assert _CoalescingWrites(raw).get_extra_info("socket") == ("peer", "socket")  # the rest is delegated


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


@contextlib.contextmanager
def _serving(**options) -> Iterator[int]:
    """uvicorn with `_app` on a free loopback port, in a thread; yields the port."""
    port = free_port()
    options = {"http": HttpProtocol, "log_level": "warning", **options}
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def server_url():
    with _serving() as port:
        yield f"http://127.0.0.1:{port}"


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


def test_past_the_concurrency_limit_the_answer_is_a_503_in_the_envelope() -> None:
    with _serving(http=HttpProtocol.reading_within(5), limit_concurrency=2, log_level="error") as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
            idle.sendall(b"GET /?n=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            _read_until(idle, b"0\r\n\r\n")  # served; the connection stays open (kept alive)
            r = httpx.get(f"http://127.0.0.1:{port}/?n=1", timeout=5)  # a second connection: at the limit
            assert r.status_code == 503 and r.headers["content-type"] == "application/json"
            assert r.json()["error"]["code"] == "overloaded" and r.headers["x-request-id"].startswith("req-")
        time.sleep(0.2)  # the idle connection is gone: below the limit again
        assert httpx.get(f"http://127.0.0.1:{port}/?n=1", timeout=5).status_code == 200
