"""A real OpenAI-compatible upstream on loopback that fails exactly as a test scripts it.

Raw asyncio sockets on a thread of its own (not a framework), so a test can choose the bytes: close the
connection mid-chunk or at a chunk boundary, reset it, stall, send only pings, garbage, JSON of the wrong
shape, an error event, a clean end without `[DONE]`, an HTTP error or a hang before the first byte, or a
200 HTML page. Each request takes the next scripted `Answer` (a normal answer when none is left) and is
recorded, so a test can also assert what reached the upstream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

PIECES = (" The", " answer", " is", " forty", " two", ",", " as", " everyone", " knows", ".")


@dataclass
class Answer:
    """How to answer one request.

    status: an HTTP status other than 200 answers with the OpenAI error envelope and nothing else.
    before: what happens before any byte of a 200 answer: "" (nothing), "hang" or "html".
    pieces: the text pieces streamed, one SSE chunk each, `gap` seconds apart.
    then: how the stream ends after them: "done" (finish reason + [DONE]), "close" (connection closed at a
      chunk boundary), "close-mid-chunk", "reset", "stall", "pings" (keep-alive comments only), "end" (a clean
      end of the body without a finish reason or [DONE]), or "raw" (the bytes in `raw`, then a clean end).
    """

    status: int = 200
    retry_after: str | None = None  # the `Retry-After` header of a non-200 answer
    before: str = ""
    pieces: tuple[str, ...] = PIECES
    gap: float = 0.01
    then: str = "done"
    raw: bytes = b""
    calls: tuple[dict, ...] = ()  # chat tool-call delta pieces ({"index", "id", "function": {...}}), after `pieces`
    reasoning: tuple[str, ...] = ()  # chat `reasoning_content` delta pieces, before `pieces` (a reasoning model)
    usage: dict | None = None  # the usage chunk sent before [DONE] when the request asked for it (include_usage)
    # Logprobs as llama-cpp-python's server sends them when the sampled token is not among the k likeliest: the k
    # alternatives above it and the sampled token too (k + 1 entries).
    sampled_below_top: bool = False


@dataclass
class Request:
    path: str
    body: dict = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)  # when it arrived


class ScriptedUpstream:
    def __init__(self, sock: socket.socket | None = None) -> None:
        """`sock`: a loopback socket bound already and not listening, whose connections are refused until this
        upstream starts on it (a test of a retry after a refused connection); None: a fresh port."""
        self.script: deque[Answer] = deque()
        self.requests: list[Request] = []
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        if sock is None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def push(self, *answers: Answer) -> None:
        self.script.extend(answers)

    def completions(self) -> list[Request]:
        return [r for r in self.requests if r.path.endswith("/completions")]

    def reset(self) -> None:
        self.script.clear()
        self.requests.clear()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- server ------------------------------------------------------------------------------------
    def _run(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=sock))
        self._ready.set()
        self._loop.run_forever()

    async def _stop(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # stalled and hanging answers
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET":
                    payload = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]})
                    writer.write(_response(200, "application/json", payload.encode()))
                    await writer.drain()
                    continue
                self.requests.append(Request(path, json.loads(body or b"{}")))
                answer = self.script.popleft() if self.script else Answer()
                if not await self._answer(answer, path, writer, self.requests[-1].body):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            if not writer.transport.is_closing():
                writer.close()

    async def _answer(self, answer: Answer, path: str, writer: asyncio.StreamWriter, body: dict) -> bool:
        """Writes one answer; False when the connection is finished with."""
        if answer.status != 200:
            err = {"error": {"message": f"scripted {answer.status}", "type": "server_error", "code": None}}
            extra = f"retry-after: {answer.retry_after}\r\n" if answer.retry_after is not None else ""
            writer.write(_response(answer.status, "application/json", json.dumps(err).encode(), extra))
            await writer.drain()
            return True
        if answer.before == "hang":
            await asyncio.sleep(3600)
        if answer.before == "html":
            writer.write(_response(200, "text/html", b"<html><body>Service maintenance</body></html>"))
            await writer.drain()
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n"
        )
        chat = path.endswith("/chat/completions")
        # Asked for logprobs: each piece is one token with logprob -(k+1)/10, its alternatives " alt<j>" below it.
        top = (body.get("top_logprobs") or 0) if chat else body.get("logprobs")
        top = top if body.get("logprobs") not in (None, False) else None
        for piece in answer.reasoning:
            chunk = _chunk("", None, chat)
            chunk["choices"][0]["delta"] = {"role": "assistant", "content": None, "reasoning_content": piece}
            writer.write(_chunked(_event(chunk)))
            await writer.drain()
            await asyncio.sleep(answer.gap)
        for k, piece in enumerate(answer.pieces):
            lps = None if top is None else (k, top, answer.sampled_below_top)
            writer.write(_chunked(_event(_chunk(piece, None, chat, lps))))
            await writer.drain()
            await asyncio.sleep(answer.gap)
        for piece in answer.calls:
            chunk = _chunk("", None, chat)
            chunk["choices"][0]["delta"] = {"tool_calls": [piece]}
            writer.write(_chunked(_event(chunk)))
            await writer.drain()
            await asyncio.sleep(answer.gap)
        then = answer.then
        if then == "done":
            usage = b""
            if answer.usage is not None and (body.get("stream_options") or {}).get("include_usage"):
                usage = _event({"id": "scripted-1", "object": "chunk", "model": "scripted", "choices": [],
                                "usage": answer.usage})  # fmt: skip
            writer.write(_chunked(_event(_chunk("", "stop", chat)) + usage + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif then == "close-mid-chunk":
            event = _event(_chunk(" half", None, chat))
            writer.write(f"{len(event):x}\r\n".encode() + event[: len(event) // 2])
        elif then == "reset":
            writer.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            writer.transport.abort()
            return False
        elif then == "stall":
            await asyncio.sleep(3600)
        elif then == "pings":
            for _ in range(3600):
                writer.write(_chunked(b": ping\n\n"))
                await writer.drain()
                await asyncio.sleep(0.2)
        elif then == "end":
            writer.write(b"0\r\n\r\n")
        elif then == "raw":
            writer.write(_chunked(answer.raw) + b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        return False


def _response(status: int, kind: str, body: bytes, extra_headers: str = "") -> bytes:
    head = f"HTTP/1.1 {status} Scripted\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n{extra_headers}\r\n"
    return head.encode() + body


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def piece_logprob(k: int) -> float:
    return -(k + 1) / 10


def _chunk(text: str, finish: str | None, chat: bool, logprobs: tuple[int, int, bool] | None = None) -> dict:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    choice["finish_reason"] = finish
    if logprobs is not None:
        k, top, below = logprobs
        lp = piece_logprob(k)
        if below:
            alts = [(f" alt{j}", lp + j / 100) for j in range(top, 0, -1)] + [(text, lp)]
        else:
            alts = ([(text, lp)] + [(f" alt{j}", lp - j) for j in range(1, top)])[:top]
        if chat:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": text,
                        "logprob": lp,
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts],
                    }
                ]
            }
        else:
            choice["logprobs"] = {
                "tokens": [text],
                "token_logprobs": [lp],
                "top_logprobs": [dict(alts)],
                "text_offset": [0],
            }
    return {"id": "scripted-1", "object": "chunk", "model": "scripted", "choices": [choice]}
