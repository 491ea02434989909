"""The gateway's SSE response (endpoints/sse.py): keep-alive pings while quiet, disconnect stops the stream."""

from __future__ import annotations

import asyncio

from endpoints.sse import PING, SSEResponse


def _run(body_gen, disconnect_after: float | None, ping: float = 0.1) -> tuple[list[dict], bool]:
    sent: list[dict] = []
    closed = asyncio.Event()

    async def receive() -> dict:
        if disconnect_after is None:
            await asyncio.Event().wait()  # never: the client stays
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        response = SSEResponse(body_gen(closed), {"x-request-id": "r1"}, ping)
        await response({"type": "http"}, receive, send)

    asyncio.run(main())
    return sent, closed.is_set()


def test_pings_fill_quiet_gaps_and_the_stream_ends_cleanly() -> None:
    async def body(closed: asyncio.Event):
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(0.35)
            yield b"data: 2\n\n"
        finally:
            closed.set()

    sent, closed = _run(body, disconnect_after=None)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert (b"x-request-id", b"r1") in sent[0]["headers"]
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == b"data: 1\n\n" and bodies[-2:] == [b"data: 2\n\n", b""]
    assert 2 <= bodies.count(PING) <= 4 and PING == b": ping\n\n"
    assert sent[-1]["more_body"] is False and closed


def test_client_disconnect_closes_the_stream_without_an_error() -> None:
    async def body(closed: asyncio.Event):
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(30)  # a long answer the client will not wait for
            yield b"data: never\n\n"
        finally:
            closed.set()

    sent, closed = _run(body, disconnect_after=0.2, ping=10)
    assert closed  # the generator's cleanup ran: the backend is told to stop
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]


def test_done_goes_out_with_the_end_of_the_body() -> None:
    async def body(closed: asyncio.Event):
        try:
            yield b"data: 1\n\n"
            yield b"data: last\n\ndata: [DONE]\n\n"
            yield b"data: never\n\n"  # nothing may follow [DONE]
        finally:
            closed.set()

    sent, closed = _run(body, disconnect_after=None, ping=10)
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"data: last\n\ndata: [DONE]\n\n", False),  # one write: the last chunk, [DONE] and the body's end
    ]
    assert closed
