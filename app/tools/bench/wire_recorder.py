"""A recording proxy on loopback between a coding-agent CLI and the gateway (`tandem bench agents`).

Every request the CLI sends is forwarded to the gateway as it came (method, path and query, headers, body) and its
answer streamed back as the gateway sends it, chunk by chunk; beside the wire each exchange is recorded: what the
request asked (its route, its JSON body's fields, tools and their kinds, sizes: `shape`), the status, the gateway's
`x-request-id` (its trace: GET /v1/requests/{id}) and `x-tandem-*` headers, the time to the first byte of the answer
(the gateway holds the status until the first token), the refusal's message, and an error event inside a stream.
With `transcripts`, each request body and answer is also written to that folder (the bench's transcript of a task).

Standard library only; one thread per connection (the CLIs keep few open).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import select
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host",
     "content-length"}
)  # fmt: skip
# What an answer's stream says when it failed after its status: OpenAI's error chunk, Anthropic's error event, the
# Responses API's failure events.
_STREAM_ERRORS = (b'data: {"error"', b"event: error", b'"type":"response.failed"', b'"type": "response.failed"')
_BASIC_FIELDS = frozenset({"model", "messages", "input", "system", "instructions", "tools", "stream", "max_tokens"})


@dataclass
class Exchange:
    index: int
    method: str
    path: str
    started_s: float  # since the recorder started
    request_bytes: int
    shape: dict = field(default_factory=dict)
    status: int | None = None
    request_id: str | None = None
    # The gateway's own headers on the answer (`x-tandem-*`: the endpoint that answered, a clamped max_tokens, the
    # fields it ignored), lower-cased names.
    tandem_headers: dict[str, str] = field(default_factory=dict)
    first_byte_s: float | None = None  # from the request's end to the answer's first byte
    seconds: float | None = None
    response_bytes: int = 0
    message: str | None = None  # a refusal's message (its error envelope), or the transport's failure
    stream_error: bool = False
    folder: Path | None = field(default=None, repr=False)  # where its bodies go: the recorder's at its start

    @property
    def generation(self) -> bool:
        """A request for an answer (a turn), not a listing or a count."""
        return self.method == "POST" and self.route in ("/v1/messages", "/v1/responses", "/v1/chat/completions",
                                                         "/v1/completions")  # fmt: skip

    @property
    def route(self) -> str:
        return self.path.split("?", 1)[0]

    @property
    def refused(self) -> bool:
        """Answered with a 4xx or 5xx, or an error event inside the answer's stream."""
        return (self.status is not None and self.status >= 400) or self.stream_error

    @property
    def answered(self) -> bool:
        """Answered in full: a status below 400, the stream to its end without an error event (not cut off by the
        CLI leaving, nor by the gateway's connection failing)."""
        return self.status is not None and self.status < 400 and not self.stream_error and self.message is None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "folder"}


def shape_of(body: bytes, headers: dict[str, str]) -> dict:
    """What a request asked, without its texts: its JSON fields beyond the basics, the tools' count and kinds, the
    messages' count and roles, max_tokens, stream, the Anthropic beta headers. Never a prompt."""
    shape: dict = {}
    beta = headers.get("anthropic-beta")
    if beta:
        shape["anthropic_beta"] = beta.split(",")
    if not body:
        return shape
    try:
        data = json.loads(body)
    except ValueError:
        return {**shape, "json": False}
    if not isinstance(data, dict):
        return {**shape, "json": type(data).__name__}
    shape["fields"] = sorted(data)
    shape["extra_fields"] = sorted(set(data) - _BASIC_FIELDS)
    for name in ("model", "stream", "max_tokens", "max_output_tokens", "tool_choice", "thinking", "reasoning",
                 "include", "store", "parallel_tool_calls", "output_config"):  # fmt: skip
        if name in data:
            shape[name] = data[name]
    tools = data.get("tools")
    if isinstance(tools, list):
        shape["tools"] = len(tools)
        shape["tool_kinds"] = sorted({str(t.get("type", "(none)")) for t in tools if isinstance(t, dict)})
    turns = data.get("messages", data.get("input"))
    if isinstance(turns, list):
        shape["messages"] = len(turns)
        shape["roles"] = [str(t.get("role", t.get("type", "?"))) for t in turns if isinstance(t, dict)]
    return shape


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode(errors="replace")
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or data)[:500]


class WireRecorder:
    """`with WireRecorder(gateway_url) as wire:` point the CLI at `wire.url`; `wire.exchanges` holds the records."""

    def __init__(self, upstream: str, read_timeout: float = 1800.0):
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.transcripts: Path | None = None  # set per task: where each exchange's bodies go
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        parts = urlsplit(self.upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.read_timeout = read_timeout
        self._t0 = time.monotonic()
        recorder = self

        class Handler(_Handler):
            owner = recorder

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="wire-recorder", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> WireRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def since(self, mark: int) -> list[Exchange]:
        """The exchanges recorded after the first `mark` (a task's, given len(exchanges) before it)."""
        with self._lock:
            return list(self.exchanges[mark:])

    def settle(self, mark: int, timeout: float = 10.0) -> None:
        """Wait (up to `timeout` s) until every exchange after `mark` has ended: one cut off by its CLI's time cap ends
        once the watcher has closed its gateway side."""
        deadline = time.monotonic() + timeout
        while any(e.seconds is None for e in self.since(mark)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _new(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Exchange:
        with self._lock:
            exchange = Exchange(next(self._ids), method, path, time.monotonic() - self._t0, len(body),
                                shape_of(body, headers), folder=self.transcripts)  # fmt: skip
            self.exchanges.append(exchange)
            return exchange

    def _write(self, exchange: Exchange, suffix: str, data: bytes) -> None:
        folder = exchange.folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{exchange.index:03d}-{suffix}").write_bytes(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # a CLI closed a kept-alive connection: its own business
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: WireRecorder

    def log_message(self, format, *args) -> None:  # the record is the log
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self) -> None:
        owner = self.owner
        body = self._body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        exchange = owner._new(self.command, self.path, body, headers)
        owner._write(exchange, f"request{_suffix(self.path)}.json", body)
        sent = time.monotonic()
        answer = bytearray()
        upstream = http.client.HTTPConnection(owner.host, owner.port, timeout=owner.read_timeout)
        left = threading.Event()  # the CLI closed its connection (or was stopped)
        done = threading.Event()
        threading.Thread(target=self._watch, args=(upstream, left, done), daemon=True).start()
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            upstream.putheader("Host", f"{owner.host}:{owner.port}")
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body)
            response = upstream.getresponse()
            exchange.status = response.status
            exchange.request_id = response.getheader("x-request-id")
            exchange.tandem_headers = {
                name.lower(): value for name, value in response.getheaders() if name.lower().startswith("x-tandem-")
            }
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(65536):
                if exchange.first_byte_s is None:
                    exchange.first_byte_s = time.monotonic() - sent
                answer += chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError as exc:  # http.client's errors are OSErrors or HTTPExceptions
            self._failed(exchange, left, exc)
        except http.client.HTTPException as exc:
            self._failed(exchange, left, exc)
        finally:
            done.set()
            upstream.close()
            exchange.seconds = time.monotonic() - sent
            exchange.response_bytes = len(answer)
            if exchange.status is not None and exchange.status >= 400:
                exchange.message = _error_message(bytes(answer))
            exchange.stream_error = any(marker in answer for marker in _STREAM_ERRORS)
            owner._write(exchange, "response.txt", bytes(answer))

    def _failed(self, exchange: Exchange, left: threading.Event, exc: Exception) -> None:
        self.close_connection = True
        if left.is_set() or isinstance(exc, BrokenPipeError | ConnectionResetError):
            exchange.message = "the client closed the connection"
            return
        exchange.message = f"gateway unreachable: {type(exc).__name__}: {exc}"
        if exchange.status is None:
            with contextlib.suppress(OSError):
                self.send_error(502, exchange.message)

    def _watch(self, upstream: http.client.HTTPConnection, left: threading.Event, done: threading.Event) -> None:
        """While the gateway works on the answer, watch the CLI's connection: when the CLI closes it (a CLI stopped at
        its time cap), close the one to the gateway, which then stops the answer as it would for the CLI itself. A
        request's body is read whole before, so anything readable now is the connection's end (or a pipelined
        request, which these CLIs never send)."""
        client = self.connection
        while not done.wait(0.25):
            try:
                readable, _, _ = select.select([client], [], [], 0)
                if readable and not client.recv(1, socket.MSG_PEEK):
                    left.set()
            except (OSError, ValueError):
                left.set()
            if left.is_set():
                with contextlib.suppress(OSError):
                    if upstream.sock is not None:
                        upstream.sock.shutdown(socket.SHUT_RDWR)  # wakes the read blocked on it
                return

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward


def _suffix(path: str) -> str:
    route = path.split("?", 1)[0].strip("/").replace("/", "-")
    return f"-{route}" if route else ""
