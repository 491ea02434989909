"""Cloud backend on any OpenAI-compatible server (vLLM, SGLang, llama.cpp server, a provider).

One shared `httpx.AsyncClient` per backend with explicit connect / read (the
longest gap between two streamed chunks) / write / pool timeouts. Each stream
owns its upstream response inside `async with`, so the response is closed when
the consumer closes the iterator, is cancelled, or the client disconnects —
an unclosed streaming response would pin a pool connection for good.

Continuation from a delivered prefix goes through raw `/v1/completions` with
the chat template applied in the gateway and token IDs (when the upstream shares
the device model's tokenizer); a plain chat upstream can only start answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable

import httpcore
import httpx

from app.config import CloudSettings
from clients.base import BackendError, GenerationRequest, TokenEvent, Usage
from clients.tokencount import estimate_tokens

log = logging.getLogger(__name__)


class OpenAICompatBackend:
    def __init__(
        self,
        name: str,
        settings: CloudSettings,
        count_exact: Callable[[str], int] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.name = name
        self.model_id = settings.model
        self.settings = settings
        # The device tokenizer when upstream shares it: exact usage without upstream help.
        self._count_exact = count_exact if settings.tokenizer == "device" else None
        self.can_continue = settings.continuation == "completions"
        self.accepts_token_ids = settings.token_id_prompts
        headers = {}
        if settings.api_key is not None:
            headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
        self._client = httpx.AsyncClient(
            base_url=settings.base_url,
            headers=headers,
            timeout=httpx.Timeout(
                connect=settings.connect_timeout,
                read=settings.read_timeout,
                write=settings.write_timeout,
                pool=settings.pool_timeout,
            ),
            transport=transport
            or _OneWriteTransport(
                limits=httpx.Limits(max_connections=settings.max_connections, max_keepalive_connections=16),
                # A reused connection must not hold small writes back (Nagle waits for the server's
                # delayed ACK: milliseconds added to every time to first token).
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            ),
        )
        self.active = 0
        self.tokens_generated = 0  # streamed text pieces received from upstream

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self._client.aclose()

    async def ready(self) -> bool:
        try:
            response = await self._client.get("/models", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def count_tokens(self, text: str) -> tuple[int, bool]:
        if self._count_exact is not None:
            return self._count_exact(text), True
        return estimate_tokens(text), False

    # -- request building --------------------------------------------------------------------
    def _body(self, request: GenerationRequest) -> tuple[str, dict]:
        common = {
            "model": self.settings.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.stop:
            common["stop"] = list(request.stop)
        if request.seed is not None:
            common["seed"] = request.seed
        continuing = bool(request.prefix_text) or bool(request.prefix_ids)
        if self.can_continue and (continuing or request.messages is None):
            if self.accepts_token_ids and request.prompt_ids is not None and (request.prefix_ids or not continuing):
                prompt: str | list[int] = list(request.prompt_ids) + list(request.prefix_ids or ())
            else:
                prompt = request.prompt_text + request.prefix_text
            return "/completions", {**common, "prompt": prompt}
        if continuing:
            raise BackendError(
                f"cloud backend {self.name!r} cannot continue an answer (continuation='chat')",
                status=501,
                backend=self.name,
            )
        if request.messages is None:
            raise BackendError(f"cloud backend {self.name!r} serves chat only", status=400, backend=self.name)
        return "/chat/completions", {**common, "messages": list(request.messages)}

    # -- streaming ---------------------------------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        path, body = self._body(request)
        url = self.settings.base_url + path
        self.active += 1
        try:
            async with self._client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise self._upstream_error(response)
                async for event in self._events(response, request):
                    yield event
        except httpx.ConnectError as exc:
            raise BackendError(f"cloud backend {self.name!r} is unreachable at {url}: {exc}", 503, self.name) from exc
        except httpx.ConnectTimeout as exc:
            raise BackendError(
                f"cloud backend {self.name!r} did not accept a connection in time", 504, self.name
            ) from exc
        except httpx.ReadTimeout as exc:
            raise BackendError(
                f"cloud backend {self.name!r} sent nothing for {self.settings.read_timeout:g} s (stalled)",
                504,
                self.name,
            ) from exc
        except httpx.PoolTimeout as exc:
            raise BackendError(f"cloud backend {self.name!r}: connection pool exhausted", 503, self.name) from exc
        except httpx.HTTPError as exc:
            raise BackendError(f"cloud backend {self.name!r} failed: {exc!r}", 502, self.name) from exc
        finally:
            self.active -= 1

    def _upstream_error(self, response: httpx.Response) -> BackendError:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        status = response.status_code
        # A client-side mistake upstream is the client's; auth trouble upstream is ours (502).
        mapped = status if status in (400, 413, 422, 429) else 502
        return BackendError(f"cloud backend {self.name!r} answered {status}: {message}", mapped, self.name)

    async def _events(self, response: httpx.Response, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        finish: str | None = None
        usage: Usage | None = None
        lines = response.aiter_lines()
        async for line in lines:
            if not line.startswith("data:"):
                continue  # blank separators, comments (keep-alive pings), event names
            data = line[5:].strip()
            if data == "[DONE]":
                # Read the response to its end so the connection goes back to the pool: closing a
                # half-read response costs a new TCP connection on the next request.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        async for _ in lines:
                            pass
                break
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                raise BackendError(f"cloud backend {self.name!r} sent malformed SSE data: {data[:100]!r}") from exc
            if "error" in chunk:
                err = chunk["error"]
                message = err.get("message") if isinstance(err, dict) else str(err)
                raise BackendError(f"cloud backend {self.name!r} failed mid-stream: {message}", 502, self.name)
            if chunk.get("usage"):
                u = chunk["usage"]
                usage = Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0), exact=True)
            for choice in chunk.get("choices") or ():
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    self.tokens_generated += 1
                    yield TokenEvent(text=text)
                finish = choice.get("finish_reason") or finish
        yield TokenEvent(text="", finish_reason=finish or "stop", usage=usage)


class _RequestInOneWrite(httpcore.AsyncNetworkStream):
    """httpcore writes a request as separate writes (headers, body, end of message), each a trip through the
    event loop and a wake-up of the server, which on a small machine often takes the gateway's own core
    before the rest is written. This stream keeps the writes and sends them as one when the response is
    first read (HTTP/1.1: httpcore writes the whole request before it reads)."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._pending: list[bytes] = []
        self._write_timeout: float | None = None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 (httpcore's interface)
        if buffer:
            self._pending.append(buffer)
            self._write_timeout = timeout

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 (httpcore's interface)
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            await self._stream.write(data, timeout=self._write_timeout)
        return await self._stream.read(max_bytes, timeout=timeout)

    async def aclose(self) -> None:
        self._pending = []
        await self._stream.aclose()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.AsyncNetworkStream:  # noqa: ASYNC109 (httpcore's interface)
        return _RequestInOneWrite(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _OneWriteBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()  # what httpcore's default picks on asyncio

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):  # noqa: ASYNC109 (httpcore's interface)
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _RequestInOneWrite(stream)

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):  # noqa: ASYNC109 (httpcore's interface)
        return _RequestInOneWrite(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _OneWriteTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with each request sent in one write (`_RequestInOneWrite`). httpx does not take a
    network backend, so the pool it builds gets ours (httpx and httpcore are pinned; a test covers this)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        pool = self._pool
        if not isinstance(getattr(pool, "_network_backend", None), httpcore.AsyncNetworkBackend):
            raise RuntimeError("httpcore's connection pool changed: cannot send requests in one write")
        pool._network_backend = _OneWriteBackend()
