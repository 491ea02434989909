"""The device half's two transports to a HAT worker: WebSocket (ws://, wss://) and POST + SSE (http://, https://).

Both carry the same binary frames (clients/hat/wire.py; endpoints/hidden.py serves them) in order, through the
link emulator (clients/hat/link.py) when a LinkProfile is given: frames go up through its uplink, replies come
down through its downlink. A transport that fails or closes leaves a marker in the downlink, so every later
receive raises the same BackendError instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from clients.base import BackendError
from clients.hat import wire
from clients.hat.link import Link, LinkProfile

_CLOSE_MESSAGES = {
    4401: "the worker rejected the auth token",
    4408: "the worker dropped the session as idle",
    1013: "the worker is full or not ready",
    1008: "the worker refused the session",
}


@dataclass(frozen=True)
class LinkOptions:
    """What the transports and the frame session need to know: names, secrets, limits and timeouts."""

    name: str  # the backend's, for error messages
    auth_token: str | None = None
    connect_timeout: float = 10.0
    round_timeout: float = 60.0
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES
    wire_dtype: torch.dtype = torch.float32
    profile: LinkProfile | None = None
    noise: float = 0.0  # relative std of the Gaussian noise on sent hidden states (clients/hat/noise.py)
    noise_seed: int | None = None  # None: each session's noise generator is seeded from the OS


@dataclass(frozen=True)
class WorkerAddress:
    """A worker URL: ws:// or wss:// selects the WebSocket (at /v1/hidden/ws unless the URL has a path), http:// or
    https:// POST + SSE; `http_base` serves /health/ready either way."""

    kind: str  # "ws" | "sse"
    ws_url: str
    http_base: str

    @classmethod
    def parse(cls, worker_url: str) -> WorkerAddress:
        url = urlsplit(worker_url)
        if url.scheme not in ("ws", "wss", "http", "https") or not url.netloc:
            raise ValueError(f"worker_url must be ws://, wss://, http:// or https://host:port, got {worker_url!r}")
        http_scheme = {"ws": "http", "wss": "https"}.get(url.scheme, url.scheme)
        ws_url = worker_url if url.path not in ("", "/") else worker_url.rstrip("/") + "/v1/hidden/ws"
        return cls("ws" if url.scheme in ("ws", "wss") else "sse", ws_url, f"{http_scheme}://{url.netloc}")

    def transport(self, opts: LinkOptions) -> Transport:
        return WSTransport(opts, self.ws_url) if self.kind == "ws" else SSETransport(opts, self.http_base)


class _LinkClosed:
    """Marker in the downlink: the transport failed or closed (carries the error to raise)."""

    def __init__(self, error: BackendError) -> None:
        self.error = error


class Transport:
    """Ordered frames to the worker through the uplink emulator, replies back through the downlink one."""

    def __init__(self, opts: LinkOptions) -> None:
        self.opts = opts
        self.link = Link(opts.profile)
        self.bytes_up = self.bytes_down = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self.closed = False

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise BackendError(f"{self.opts.name}: link to the worker is closed", status=502, backend=self.opts.name)
        self.link.up.put(frame, len(frame))
        self.bytes_up += len(frame)

    async def recv(self) -> bytes:
        item = await self.link.down.get()
        if isinstance(item, _LinkClosed):
            self.link.down.put(item, 0)  # every later recv fails the same way
            raise item.error
        self.bytes_down += len(item)
        return item

    def _fail(self, message: str, status: int = 502) -> None:
        self.link.down.put(_LinkClosed(BackendError(f"{self.opts.name}: {message}", status, self.opts.name)), 0)

    async def open(self, frame: bytes) -> bytes:
        raise NotImplementedError

    async def close(self, close_frame: bytes | None) -> None:
        raise NotImplementedError

    async def _deliver(self, data: bytes) -> bool:
        """Hand one frame to the worker; False stops the uplink (the failure is already in the downlink)."""
        raise NotImplementedError

    async def _start(self, frame: bytes, *tasks: Coroutine[Any, Any, None]) -> bytes:
        """Run the uplink (and any other `tasks`), send the OPEN `frame` and return the worker's reply to it."""
        self._tasks = [asyncio.create_task(self._uplink()), *(asyncio.create_task(t) for t in tasks)]
        self.send(frame)
        return await self.recv()

    async def _uplink(self) -> None:
        while True:
            data = await self.link.up.get()
            if data is None or not await self._deliver(data):
                return

    async def _cancel_tasks(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t


class WSTransport(Transport):
    def __init__(self, opts: LinkOptions, url: str) -> None:
        super().__init__(opts)
        self.url = url
        self.ws: Any = None

    async def open(self, frame: bytes) -> bytes:
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.opts.auth_token}"} if self.opts.auth_token else None
        try:
            self.ws = await connect(
                self.url,
                additional_headers=headers,
                max_size=None,
                compression=None,
                open_timeout=self.opts.connect_timeout,
            )
        except Exception as e:
            raise BackendError(f"{self.opts.name}: cannot reach worker {self.url}: {e}", 503, self.opts.name) from None
        return await self._start(frame, self._downlink())

    async def _deliver(self, data: bytes) -> bool:
        try:
            await self.ws.send(data)
        except Exception as e:
            self._fail(f"sending to the worker failed: {e}", 503)
            return False
        return True

    async def _downlink(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for msg in self.ws:
                if isinstance(msg, str):
                    self._fail("the worker sent a text message; expected binary frames")
                    return
                self.link.down.put(msg, len(msg))
            code = self.ws.close_code
            reason = self.ws.close_reason or ""
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd is not None else 1006
            reason = e.rcvd.reason if e.rcvd is not None else "connection lost"
        except Exception as e:
            code, reason = 1006, str(e)
        if not self.closed:
            what = _CLOSE_MESSAGES.get(code or 1006, "the worker closed the connection")
            self._fail(f"{what} (close code {code}{': ' + reason if reason else ''})", 503 if code == 1013 else 502)

    async def close(self, close_frame: bytes | None) -> None:
        if self.ws is not None and close_frame is not None and not self.closed:
            with contextlib.suppress(BackendError):
                self.send(close_frame)
        self.closed = True
        self.link.up.put(None, 0)  # type: ignore[arg-type]
        uplink = self._tasks[0] if self._tasks else None
        if uplink is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(uplink), timeout=1.0 + self.link.profile.latency)
        if self.ws is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.ws.close(), timeout=2.0)
        await self._cancel_tasks()


class SSETransport(Transport):
    """POST + SSE: each frame is one POST; replies come back as base64 frames in its SSE stream."""

    def __init__(self, opts: LinkOptions, base: str) -> None:
        super().__init__(opts)
        self.base = base
        self.client: Any = None
        self.sid: str | None = None
        self._posts: set[asyncio.Task[Any]] = set()

    async def open(self, frame: bytes) -> bytes:
        import httpx

        headers = {"Authorization": f"Bearer {self.opts.auth_token}"} if self.opts.auth_token else {}
        timeout = httpx.Timeout(self.opts.round_timeout, connect=self.opts.connect_timeout)
        self.client = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=timeout)
        return await self._start(frame)

    async def _deliver(self, data: bytes) -> bool:
        if self.sid is None:
            await self._open(data)
        else:
            task = asyncio.create_task(self._post(data))
            self._posts.add(task)
            task.add_done_callback(self._posts.discard)
        return True

    async def _open(self, data: bytes) -> None:
        import httpx

        try:
            r = await self.client.post(
                "/v1/hidden/sessions", content=data, headers={"content-type": "application/octet-stream"}
            )
        except httpx.HTTPError as e:
            self._fail(f"cannot reach worker {self.base}: {e}", 503)
            return
        if r.status_code != 200:
            self._fail(f"worker refused the session: HTTP {r.status_code} {_envelope_message(r.content)}", _st(r))
            return
        self.sid = r.headers.get("x-tandem-session")
        self.link.down.put(r.content, len(r.content))

    async def _post(self, data: bytes) -> None:
        import httpx

        url = f"/v1/hidden/sessions/{self.sid}/frames"
        try:
            async with self.client.stream(
                "POST", url, content=data, headers={"content-type": "application/octet-stream"}
            ) as r:
                if r.status_code != 200:
                    body = await r.aread()
                    self._fail(f"worker refused a frame: HTTP {r.status_code} {_envelope_message(body)}", _st(r))
                    return
                event = None
                async for line in r.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:") and event == "frame":
                        frame = base64.b64decode(line[5:].strip(), validate=True)
                        self.link.down.put(frame, len(frame))
        except (httpx.HTTPError, ValueError) as e:
            if not self.closed:
                self._fail(f"frame POST failed: {e}", 503)

    async def close(self, close_frame: bytes | None) -> None:
        if self.sid is not None and close_frame is not None and not self.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.client.post(
                        f"/v1/hidden/sessions/{self.sid}/frames",
                        content=close_frame,
                        headers={"content-type": "application/octet-stream"},
                    ),
                    timeout=2.0,
                )
        self.closed = True
        self.link.up.put(None, 0)  # type: ignore[arg-type]
        for t in list(self._posts):
            t.cancel()
        await self._cancel_tasks()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()


def _st(response: Any) -> int:
    return 503 if response.status_code in (429, 503) else 502


def _envelope_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except Exception:
        return body[:200].decode("utf-8", "replace")
