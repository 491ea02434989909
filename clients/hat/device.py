"""The HAT device half: a Backend that keeps raw tokens on the device and borrows a worker's middle layers.

On the device: the input submodel (embedding + layers 0..m-1), the output submodel (final norm + LM head) and the
adapter Lambda, which together form the draft model w_S = H o Lambda o w^m. On the worker (app/worker/engine.py): the
middle layers m..n-1 and their KV cache. Only hidden states and control frames cross the link — never token ids
or text (the OPEN frame carries structural facts only: hidden size, layer counts, m, dtype, model name).

One generation = one worker session:

1. Prefill (HAT §3.3). The prompt (+ any prefix being continued) is cut into chunks of X tokens, X from Eq. 3
   (policies/chunking.py) given the measured upload bandwidth and the worker's g(.) and mu (sent in its OPEN
   reply). For each chunk the device runs the input submodel (and the adapter, to fill its KV cache), and
   sends the shallow states at once, without waiting for earlier chunks' replies: the upload of chunk k+1
   overlaps the worker's compute of chunk k. The deep state of the last prompt position gives the first token.
2. Decode rounds (HAT §3.4). Starting from the last accepted token, the draft model drafts greedily (or samples,
   at temperature > 0) until the draft token's probability falls below eta (Eq. 5, default 0.6; the
   low-confidence token is kept as the last draft) or max_draft (8) is reached. The device sends the shallow
   states of [last accepted token + drafts] (DRAFT), gets their deep states back (VERIFY_RESULT), and its output
   submodel verifies: greedy accepts the longest matching prefix plus the LLM's own next token; sampling uses
   speculative rejection sampling (accept d with prob min(1, p(d)/q(d)), else resample from max(0, p - q)), so
   the output is distributed exactly as the LLM's (with the same temperature / top-p). Rejected positions are
   removed from the worker's cache with ROLLBACK and from the device's own caches with crop.
3. Greedy output equals plain U-shape greedy decoding token for token, up to float reassociation: verifying
   k+1 positions in one pass computes the same math as k+1 one-token passes in a different order (~1e-5
   relative), which can flip an exact near-tie between the top two logits. Tests report such ties' gaps.

4. Parallel drafting (HAT §3.5, Eq. 6; opt-in, `parallel_drafting=True`): while the worker verifies, the device
   drafts ahead from the top-k alternatives to the last draft token (one batched step per candidate set, as many
   steps as Eq. 6 says fit the round trip and never past the reply's arrival). If the verified correction is
   one of the candidates, the next round starts with that branch's drafts and caches. It changes no output
   (drafts are only proposals); with sampling, it makes seeded runs timing-dependent (not reproducible run to
   run), while keeping the output distribution exact.

The link emulator (clients/hat/link.py) sits on the device's send and receive paths when a LinkProfile is given.
Transports: ws:// or wss:// worker URLs use the WebSocket; http:// or https:// use POST + SSE
(endpoints/hidden.py documents both).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from clients.base import BackendError, GenerationRequest, TokenEvent
from clients.hat import wire
from clients.hat.link import Link, LinkProfile
from clients.hat.split import SplitKVCache
from clients.hf_model import HFTokenizerMixin, open_token_source
from clients.sampling import choose, probabilities, sample_next, seeded_generator, speculative_sample
from clients.stops import StopMatcher
from clients.torch_local import IncrementalDetokenizer
from policies.chunking import chunk_bounds, chunk_size, split_prompt
from policies.drafting import DEFAULT_ETA, DraftStopRule, MovingAverage, parallel_draft_steps

log = logging.getLogger(__name__)

_NO_SESSION = b"\0" * 16
_REPLY_KINDS = frozenset({wire.Kind.OPEN, wire.Kind.DEEP_STATE, wire.Kind.VERIFY_RESULT, wire.Kind.ERROR})
_CLOSE_MESSAGES = {
    4401: "the worker rejected the auth token",
    4408: "the worker dropped the session as idle",
    1013: "the worker is full or not ready",
    1008: "the worker refused the session",
}


# --- statistics -------------------------------------------------------------------------------------


@dataclass
class HATStats:
    """Cumulative counters of one HATBackend (all streams)."""

    sessions: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    prefill_seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_tokens: int = 0  # tokens produced by rounds: accepted drafts + one LLM token each
    round_seconds: float = 0.0
    draft_seconds: float = 0.0  # device: input submodel + adapter + head while drafting
    wait_seconds: float = 0.0  # send -> deep states back (link + worker)
    verify_seconds: float = 0.0  # device: head over the deep states + acceptance
    bytes_up: int = 0
    bytes_down: int = 0
    parallel_steps: int = 0  # batched parallel-drafting steps run while waiting for the worker
    parallel_hits: int = 0  # rounds whose draft came ready-made from parallel drafting
    last_chunk_size: int = 0

    def summary(self) -> dict[str, float]:
        r = max(self.rounds, 1)
        return {
            "rounds": self.rounds,
            "accept_length": self.round_tokens / r,  # tokens per verification round (accepted + 1)
            "accepted_per_round": self.accepted / r,
            "drafted_per_round": self.drafted / r,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "ms_per_round": 1e3 * self.round_seconds / r,
            "draft_ms_per_round": 1e3 * self.draft_seconds / r,
            "wait_ms_per_round": 1e3 * self.wait_seconds / r,
            "verify_ms_per_round": 1e3 * self.verify_seconds / r,
            "prefill_seconds": self.prefill_seconds,
            "parallel_hits": self.parallel_hits,
            "parallel_steps": self.parallel_steps,
        }


# --- transports -------------------------------------------------------------------------------------


class _LinkClosed:
    """Marker in the downlink: the transport failed or closed (carries the error to raise)."""

    def __init__(self, error: BackendError) -> None:
        self.error = error


class _Transport:
    """Ordered frames to the worker through the uplink emulator, replies back through the downlink one."""

    def __init__(self, backend: HATBackend) -> None:
        self.b = backend
        self.link = Link(backend.link_profile)
        self._tasks: list[asyncio.Task[Any]] = []
        self.closed = False

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise BackendError(f"{self.b.name}: link to the worker is closed", status=502, backend=self.b.name)
        self.link.up.put(frame, len(frame))
        self.b.stats.bytes_up += len(frame)

    async def recv(self) -> bytes:
        item = await self.link.down.get()
        if isinstance(item, _LinkClosed):
            self.link.down.put(item, 0)  # every later recv fails the same way
            raise item.error
        self.b.stats.bytes_down += len(item)
        return item

    def _fail(self, message: str, status: int = 502) -> None:
        self.link.down.put(_LinkClosed(BackendError(f"{self.b.name}: {message}", status, self.b.name)), 0)

    async def open(self, frame: bytes) -> bytes:
        raise NotImplementedError

    async def close(self, close_frame: bytes | None) -> None:
        raise NotImplementedError

    async def _cancel_tasks(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t


class _WSTransport(_Transport):
    def __init__(self, backend: HATBackend, url: str) -> None:
        super().__init__(backend)
        self.url = url
        self.ws: Any = None

    async def open(self, frame: bytes) -> bytes:
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.b.auth_token}"} if self.b.auth_token else None
        try:
            self.ws = await connect(
                self.url,
                additional_headers=headers,
                max_size=None,
                compression=None,
                open_timeout=self.b.connect_timeout,
            )
        except Exception as e:
            raise BackendError(f"{self.b.name}: cannot reach worker {self.url}: {e}", 503, self.b.name) from None
        self._tasks = [asyncio.create_task(self._uplink()), asyncio.create_task(self._downlink())]
        self.send(frame)
        return await self.recv()

    async def _uplink(self) -> None:
        while True:
            data = await self.link.up.get()
            if data is None:
                return
            try:
                await self.ws.send(data)
            except Exception as e:
                self._fail(f"sending to the worker failed: {e}", 503)
                return

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


class _SSETransport(_Transport):
    """POST + SSE: each frame is one POST; replies come back as base64 frames in its SSE stream."""

    def __init__(self, backend: HATBackend, base: str) -> None:
        super().__init__(backend)
        self.base = base
        self.client: Any = None
        self.sid: str | None = None
        self._posts: set[asyncio.Task[Any]] = set()

    async def open(self, frame: bytes) -> bytes:
        import httpx

        headers = {"Authorization": f"Bearer {self.b.auth_token}"} if self.b.auth_token else {}
        timeout = httpx.Timeout(self.b.round_timeout, connect=self.b.connect_timeout)
        self.client = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=timeout)
        self._tasks = [asyncio.create_task(self._uplink())]
        self.send(frame)
        return await self.recv()

    async def _uplink(self) -> None:
        while True:
            data = await self.link.up.get()
            if data is None:
                return
            if self.sid is None:
                await self._open(data)
            else:
                task = asyncio.create_task(self._post(data))
                self._posts.add(task)
                task.add_done_callback(self._posts.discard)

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


# --- one generation's state -------------------------------------------------------------------------


@dataclass
class _Draft:
    tokens: list[int]
    dists: list[torch.Tensor]  # the distribution each draft was chosen from (softmax at temperature 0)
    shallow: torch.Tensor  # [k+1, hidden]: last accepted token + drafts


@dataclass
class _Branches:
    """Parallel drafting (Eq. 6): drafts continuing each top-k candidate for the last draft position, batched."""

    position: int  # where the candidates go (the last draft's position)
    candidates: list[int]
    input_cache: SplitKVCache  # K rows (one per candidate), sharing positions
    adapter_cache: SplitKVCache
    tokens: list[list[int]] = field(default_factory=list)  # per step: the K rows' chosen drafts
    probs: list[list[float]] = field(default_factory=list)  # per step: their probabilities
    dists: list[torch.Tensor] = field(default_factory=list)  # per step: [K, vocab]
    shallows: list[torch.Tensor] = field(default_factory=list)  # per fed step: [K, hidden] (step 0 = candidates)


class _Session:
    """One stream's link + caches. Caches are touched only on the model thread; the rest on the event loop."""

    def __init__(self, backend: HATBackend, transport: _Transport) -> None:
        self.b = backend
        self.t = transport
        self.sid = _NO_SESSION
        self.seq = 0
        self.early: dict[int, wire.Frame] = {}
        self.info: dict[str, Any] = {}
        self.input_cache = backend._input.new_cache()
        self.adapter_cache = backend.adapter.new_cache()
        self.prepared: _Draft | None = None  # the next round's draft, from parallel drafting
        self.prepared_at: tuple[int, int] | None = None  # (token, position) it continues

    async def open(self) -> dict[str, Any]:
        b = self.b
        params = {
            "protocol": 1,
            "hidden_size": b.hidden_size,
            "num_layers": b.num_layers,
            "m": b.m,
            "dtype": b.wire_dtype_name,
            "model": b.model_id,
        }
        reply = await asyncio.wait_for(
            self.t.open(wire.encode_text(wire.Kind.OPEN, _NO_SESSION, 0, json.dumps(params))), b.connect_timeout + 5
        )
        frame = self._decode(reply)
        if frame.kind != wire.Kind.OPEN:
            raise BackendError(f"{b.name}: worker answered OPEN with {frame.kind.name}", 502, b.name)
        info = json.loads(frame.text())
        for key, mine in (("hidden_size", b.hidden_size), ("num_layers", b.num_layers), ("m", b.m)):
            if info.get(key) != mine:
                raise BackendError(f"{b.name}: worker's {key} {info.get(key)} != device's {mine}", 502, b.name)
        self.sid = frame.session
        self.info = info
        return info

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send_tensor(self, kind: wire.Kind, tensor: torch.Tensor, arg: int) -> int:
        seq = self.next_seq()
        self.t.send(wire.encode_tensor(kind, self.sid, seq, tensor, arg=arg, wire_dtype=self.b.wire_dtype))
        return seq

    def send_control(self, kind: wire.Kind, arg: int = 0) -> int:
        seq = self.next_seq()
        self.t.send(wire.encode_control(kind, self.sid, seq, arg=arg))
        return seq

    def _decode(self, data: bytes) -> wire.Frame:
        try:
            frame = wire.decode_frame(
                data,
                max_frame_bytes=self.b.max_frame_bytes,
                hidden_size=self.b.hidden_size,
                expected_dtype=self.b.wire_dtype,
                expected_kinds=_REPLY_KINDS,
            )
        except wire.FrameError as e:
            raise BackendError(f"{self.b.name}: bad frame from the worker: {e}", 502, self.b.name) from None
        if frame.kind == wire.Kind.ERROR:
            raise _worker_error(self.b.name, frame)
        return frame

    async def reply(self, seq: int, kind: wire.Kind) -> wire.Frame:
        """The reply to frame `seq` (replies to other frames are kept until asked for)."""
        while seq not in self.early:
            try:
                data = await asyncio.wait_for(self.t.recv(), self.b.round_timeout)
            except TimeoutError:
                raise BackendError(
                    f"{self.b.name}: no reply from the worker within {self.b.round_timeout:g} s", 504, self.b.name
                ) from None
            frame = self._decode(data)
            if frame.session != self.sid:
                raise BackendError(f"{self.b.name}: reply for another session", 502, self.b.name)
            self.early[frame.seq] = frame
        frame = self.early.pop(seq)
        if frame.kind != kind:
            got = frame.kind.name
            raise BackendError(f"{self.b.name}: expected {kind.name} for frame {seq}, got {got}", 502, self.b.name)
        return frame


def _worker_error(name: str, frame: wire.Frame) -> BackendError:
    try:
        text = frame.text()
    except wire.FrameError:
        text = "(unreadable message)"
    status = frame.arg
    if status == 413 and text.startswith("context"):
        mapped = 400  # the prompt does not fit the worker's context: the request's fault
    else:
        mapped = {503: 503, 408: 504}.get(status, 502)
    return BackendError(f"{name}: worker error {status}: {text}", mapped, name)


# --- the backend ------------------------------------------------------------------------------------


class HATBackend(HFTokenizerMixin):
    """Backend protocol (clients.base) over a HAT worker: the device half of a U-shaped split with drafting.

    worker_url: ws://host:port (WebSocket at /v1/hidden/ws; a full ws URL with a path is used as is) or
        http://host:port (POST + SSE).
    gguf_path: the bundled model's GGUF (loaded through clients.hf_model, cached) — or pass model + tokenizer.
        Must be the model the worker splits (checked: hidden size, layer count, m).
    adapter_path: a trained adapter (safetensors, clients.hat.adapter.Adapter.save); None = untrained adapter
        initialised from layer m's attention (correct output, low accept length).
    draft_vocab_path: a reduced draft vocabulary (JSON {"token_ids": [...]}, `tandem train-adapter
        --save-draft-vocab`): drafts are chosen among these tokens (plus the end tokens) only, so a draft step's
        LM head multiplies a few thousand rows instead of the whole vocabulary. Verification always uses the
        full head, so the output is unchanged (greedy) or still exactly the LLM's distribution (sampling: the
        draft distribution is simply zero outside the subset). None = draft over the full vocabulary.
    auth_token: the worker's token (sent as "Authorization: Bearer ...").
    wire_dtype: "float32" | "float16" — must match the worker's dtype.
    eta, max_draft, include_low_confidence: the drafting stop rule (Eq. 5). speculative=False: plain U-shape
        (one token per round, no drafting) — the baseline HAT is compared against.
    parallel_drafting: while the worker verifies, draft ahead from the top `parallel_candidates` alternatives to
        the last draft token, for as many steps as Eq. 6 says fit in the round trip (and never past the reply);
        when the verified correction is one of them, the next round starts with that branch's drafts ready.
    chunk_size: fixed prefill chunk; None = Eq. 3 with min_chunk..max_chunk.
    beta_up / beta_down: initial link bandwidth estimates in bytes/s (HAT's devices measure them, e.g. with
        iperf3); the upload estimate is refined from prefill timings. With a LinkProfile the emulated
        bandwidths are the initial estimates.
    link: a LinkProfile to emulate latency / jitter / bandwidth on this device's send and receive paths.
    """

    def __init__(
        self,
        worker_url: str,
        gguf_path: str | os.PathLike[str] | None = None,
        *,
        name: str = "hat",
        model_id: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        m: int = 2,
        adapter_path: str | os.PathLike[str] | None = None,
        draft_vocab_path: str | os.PathLike[str] | None = None,
        auth_token: str | None = None,
        wire_dtype: str = "float32",
        eta: float = DEFAULT_ETA,
        max_draft: int = 8,
        include_low_confidence: bool = True,
        speculative: bool = True,
        parallel_drafting: bool = False,
        parallel_candidates: int = 3,
        chunk_size: int | None = None,
        min_chunk: int = 16,
        max_chunk: int = 256,
        beta_up: float = 10e6,
        beta_down: float = 15e6,
        link: LinkProfile | None = None,
        connect_timeout: float = 10.0,
        round_timeout: float = 60.0,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        cache_root: str | os.PathLike[str] | None = None,
        num_threads: int | None = None,
    ) -> None:
        if gguf_path is None and (model is None or tokenizer is None):
            raise ValueError("HATBackend needs gguf_path or both model and tokenizer")
        url = urlsplit(worker_url)
        if url.scheme not in ("ws", "wss", "http", "https") or not url.netloc:
            raise ValueError(f"worker_url must be ws://, wss://, http:// or https://host:port, got {worker_url!r}")
        self.name = name
        self.model_id = model_id or (Path(gguf_path).stem if gguf_path is not None else name)
        self.model_path = Path(gguf_path) if gguf_path is not None else None
        self.worker_url = worker_url
        self.transport = "ws" if url.scheme in ("ws", "wss") else "sse"
        http_scheme = {"ws": "http", "wss": "https"}.get(url.scheme, url.scheme)
        self.http_base = f"{http_scheme}://{url.netloc}"
        self.ws_url = worker_url if url.path not in ("", "/") else worker_url.rstrip("/") + "/v1/hidden/ws"
        self.m = m
        self.adapter_path = adapter_path
        self.draft_vocab_path = draft_vocab_path
        self._draft_ids: torch.Tensor | None = None  # reduced draft vocabulary (sorted token ids), if any
        self._draft_weight: torch.Tensor | None = None  # the LM head's rows for them
        self.auth_token = auth_token
        self.wire_dtype_name = wire_dtype
        self.wire_dtype = wire.dtype_by_name(wire_dtype)
        self.rule = DraftStopRule(eta=eta, max_draft=max_draft, include_low_confidence=include_low_confidence)
        self.speculative = speculative
        self.parallel_drafting = parallel_drafting
        self.parallel_candidates = max(1, parallel_candidates)
        self.pd_gamma = MovingAverage()  # seconds per batched parallel-drafting step
        self.fixed_chunk = chunk_size
        self.min_chunk, self.max_chunk = min_chunk, max_chunk
        self.link_profile = link
        self.beta_up = MovingAverage(value=(link.up_bandwidth if link and link.up_bandwidth else beta_up))
        self.beta_down = MovingAverage(value=(link.down_bandwidth if link and link.down_bandwidth else beta_down))
        self.gamma = MovingAverage()  # seconds per draft step (HAT's gamma_i)
        self.connect_timeout = connect_timeout
        self.round_timeout = round_timeout
        self.max_frame_bytes = max_frame_bytes
        self._gguf_path = gguf_path
        self._cache_root = cache_root
        self._num_threads = num_threads
        self._owns_model = model is None
        self.model = model
        self.tokenizer = tokenizer
        self._tok_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._ready = False
        self._worker_ok: tuple[float, bool] = (0.0, False)
        self.eos_ids: frozenset[int] = frozenset()
        self.max_context: int | None = None
        self.hidden_size = self.num_layers = self.vocab_size = 0
        self.adapter: Any = None
        self._input: Any = None
        self._output: Any = None
        self.active = 0
        self.tokens_generated = 0
        self.stats = HATStats()

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._ready:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hat-{self.name}")
        await self._run(self._load)
        self._ready = True

    def _load(self) -> None:
        from torch import nn

        from clients.hat.adapter import Adapter
        from clients.hat.split import split_model

        t0 = time.monotonic()
        src = open_token_source(
            self._gguf_path,
            self._cache_root,
            model=self.model,
            tokenizer=self.tokenizer,
            num_threads=self._num_threads,
        )
        self.model, self.tokenizer = src.model, src.tokenizer
        model = src.model
        split = split_model(model, self.m)
        self.adapter = Adapter.load(model, self.adapter_path) if self.adapter_path else Adapter(model, self.m)
        if self.adapter.m != self.m:
            raise ValueError(f"adapter {self.adapter_path} was trained for m={self.adapter.m}, not m={self.m}")
        self.adapter.eval()
        self._input, self._output = split.input, split.output
        self.hidden_size, self.num_layers, self.vocab_size = split.hidden_size, split.num_layers, split.vocab_size
        if self._owns_model:  # the device never runs the middle layers: drop them (most of the model's weights)
            model.model.layers = nn.ModuleList(list(model.model.layers)[: self.m])
        del split
        self.eos_ids, self.max_context = src.eos_ids, src.max_context
        if self.draft_vocab_path:
            self._load_draft_vocab(self.draft_vocab_path)
        log.info("%s: device half of %s ready in %.1f s", self.name, self.model_id, time.monotonic() - t0)

    def _load_draft_vocab(self, path: str | os.PathLike[str]) -> None:
        ids = json.loads(Path(path).read_text())["token_ids"]
        if not ids or any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"draft vocabulary {path}: token_ids must be token ids below {self.vocab_size}")
        chosen = torch.tensor(sorted(set(ids) | self.eos_ids), dtype=torch.long)
        self._draft_ids = chosen
        self._draft_weight = self._output.lm_head.weight[chosen].contiguous()

    async def close(self) -> None:
        self._ready = False
        if self._executor is not None:
            ex, self._executor = self._executor, None
            await asyncio.to_thread(ex.shutdown, True)

    async def ready(self) -> bool:
        """Local half loaded and the worker's /health/ready answered 200 (cached for 5 s)."""
        if not self._ready:
            return False
        checked, ok = self._worker_ok
        if time.monotonic() - checked < 5.0:
            return ok
        import httpx

        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                ok = (await client.get(self.http_base + "/health/ready")).status_code == 200
        except httpx.HTTPError:
            ok = False
        self._worker_ok = (time.monotonic(), ok)
        return ok

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            raise BackendError(f"{self.name}: backend closed", status=503, backend=self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # --- tokenizer ------------------------------------------------------------------------------

    # --- generation -----------------------------------------------------------------------------

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request)

    def _transport(self) -> _Transport:
        return _WSTransport(self, self.ws_url) if self.transport == "ws" else _SSETransport(self, self.http_base)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self._ready:
            raise BackendError(f"{self.name}: model not loaded", status=503, backend=self.name)
        prompt = list(request.prompt_ids) if request.prompt_ids is not None else self.tokenize(request.prompt_text)
        if request.prefix_ids is not None:
            prefix = list(request.prefix_ids)
        else:
            prefix = self.tokenize(request.prefix_text) if request.prefix_text else []
        context = prompt + prefix
        if not context:
            raise BackendError(f"{self.name}: empty prompt", status=400, backend=self.name)
        self.active += 1
        session = _Session(self, self._transport())
        try:
            info = await session.open()
            limit = min(int(info.get("max_context") or 1 << 30), self.max_context or 1 << 30)
            if len(context) >= limit:
                raise BackendError(
                    f"{self.name}: prompt of {len(context)} tokens does not fit the {limit}-token context",
                    status=400,
                    backend=self.name,
                )
            self.stats.sessions += 1
            async for event in self._generate(session, request, context, limit):
                yield event
        except TimeoutError:
            raise BackendError(f"{self.name}: the worker did not answer in time", 504, self.name) from None
        except (BackendError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # a bug or a torch failure: still a backend failure for the gateway
            log.exception("%s: generation failed", self.name)
            raise BackendError(f"{self.name}: HAT generation failed: {e}", 502, self.name) from e
        finally:
            self.active -= 1
            bye = (
                None
                if session.sid == _NO_SESSION
                else wire.encode_control(wire.Kind.CLOSE, session.sid, session.seq + 1)
            )
            await session.t.close(bye)

    async def _generate(
        self, s: _Session, req: GenerationRequest, context: list[int], limit: int
    ) -> AsyncIterator[TokenEvent]:
        max_tokens = min(req.max_tokens, limit - len(context))
        if max_tokens <= 0:
            yield TokenEvent(text="", finish_reason="length")
            return
        generator = seeded_generator(req.temperature, req.seed)
        detok = IncrementalDetokenizer(self.detokenize, context)
        stops = StopMatcher(req.stop)
        emitted = 0

        logits = await self._prefill(s, context)
        pending = [await self._run(sample_next, logits, req.temperature, req.top_p, generator)]
        position = len(context)  # where the last pending token goes
        while True:
            for token in pending:
                emitted += 1
                self.tokens_generated += 1
                if token in self.eos_ids:
                    tail, hit = stops.feed(detok.flush())
                    yield TokenEvent(text=tail if hit else tail + stops.flush(), finish_reason="stop")
                    return
                text, stopped = stops.feed(detok.push(token))
                if stopped:
                    yield TokenEvent(text=text, token_id=token, finish_reason="stop")
                    return
                if emitted >= max_tokens:
                    tail, hit = stops.feed(detok.flush())
                    text += tail if hit else tail + stops.flush()
                    yield TokenEvent(text=text, token_id=token, finish_reason="stop" if hit else "length")
                    return
                yield TokenEvent(text=text, token_id=token)
            last = pending[-1]
            cap = min(self.rule.max_draft, max_tokens - emitted - 1, limit - position - 1) if self.speculative else 0
            pending = await self._round(s, last, position, max(cap, 0), req, generator)
            position += len(pending)

    # --- prefill --------------------------------------------------------------------------------

    def _chunk(self, length: int, info: dict[str, Any]) -> int:
        """Prefill chunk size: fixed, or Eq. 3; never more than fits one of the worker's frames."""
        token_bytes = self._token_bytes()
        fits = max(1, int(info.get("max_frame_bytes") or self.max_frame_bytes) // token_bytes)
        if self.fixed_chunk:
            return max(1, min(self.fixed_chunk, fits))
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        x = chunk_size(
            token_bytes=token_bytes,
            beta_up=self.beta_up.get(10e6),
            g=(slope, intercept),
            mu=float(info.get("mu", 0.0)),
            pipeline=int(info.get("pipeline", 1)),
            min_chunk=self.min_chunk,
            max_chunk=self.max_chunk,
        )
        return max(1, min(x, length, fits))

    async def _prefill(self, s: _Session, context: list[int]) -> torch.Tensor:
        """Chunked, pipelined prefill; returns the logits at the last context position."""
        t0 = time.perf_counter()
        chunk = self._chunk(len(context), s.info)
        bounds = chunk_bounds(split_prompt(len(context), chunk))
        seqs, sent_at, sizes = [], [], []
        for start, end in bounds:
            shallow = await self._run(self._prefill_chunk, s, context[start:end], start)
            seqs.append(s.send_tensor(wire.Kind.PREFILL_CHUNK, shallow, start))
            sent_at.append(time.perf_counter())
            sizes.append(end - start)
        last = None
        for i, seq in enumerate(seqs):
            last = await s.reply(seq, wire.Kind.DEEP_STATE)
            if i == 0:
                self._observe_upload(sizes[0], time.perf_counter() - sent_at[0], s.info)
        assert last is not None
        if last.arg != len(context) - 1:
            raise BackendError(f"{self.name}: worker returned position {last.arg}, expected {len(context) - 1}", 502)
        deep = last.tensor().reshape(-1, self.hidden_size)
        logits = await self._run(self._head_last, deep)
        st = self.stats
        st.prefill_tokens += len(context)
        st.prefill_chunks += len(bounds)
        st.prefill_seconds += time.perf_counter() - t0
        st.last_chunk_size = chunk
        return logits

    def _observe_upload(self, tokens: int, rtt: float, info: dict[str, Any]) -> None:
        """Refine the upload bandwidth estimate from a large chunk's round trip minus the worker's predicted compute."""
        nbytes = tokens * self.hidden_size * torch.empty((), dtype=self.wire_dtype).element_size()
        if nbytes < 64 * 1024:
            return  # small frames measure latency, not bandwidth
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        transfer = rtt - max(0.0, slope * (float(info.get("mu", 0.0)) + tokens) + intercept)
        if transfer > 1e-4:
            self.beta_up.update(nbytes / transfer)

    def _prefill_chunk(self, s: _Session, ids: list[int], start: int) -> torch.Tensor:
        with torch.inference_mode():
            shallow = self._input(torch.tensor([ids], dtype=torch.long), s.input_cache, positions=start)
            self.adapter(shallow, s.adapter_cache, positions=start)  # the draft model attends to the prompt too
        return shallow[0]

    def _head_last(self, deep: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self._output(deep[-1:])[0].float()

    # --- decode rounds --------------------------------------------------------------------------

    async def _round(
        self, s: _Session, token: int, position: int, cap: int, req: GenerationRequest, gen: torch.Generator | None
    ) -> list[int]:
        """One speculative round from `token` at `position`; returns the new tokens (accepted drafts + 1)."""
        t0 = time.perf_counter()
        temperature, top_p = req.temperature, req.top_p
        if s.prepared is not None and s.prepared_at == (token, position):
            draft = await self._run(self._take_prepared, s, s.prepared, position, cap)
            self.stats.parallel_hits += 1
        else:
            if s.prepared is not None:  # stale branch (cannot happen unless the caller skipped a round): drop it
                raise BackendError(f"{self.name}: internal error: unused parallel draft", 500, self.name)
            draft = await self._run(self._draft, s, token, position, cap, temperature, top_p, gen)
        s.prepared = s.prepared_at = None
        t1 = time.perf_counter()
        k = len(draft.tokens)
        seq = s.send_tensor(wire.Kind.DRAFT, draft.shallow, position)
        parallel: asyncio.Task[_Branches | None] | None = None
        stop = threading.Event()
        if self.parallel_drafting and k >= 1:
            timing = self._pd_window(k, s.info)
            parallel = asyncio.create_task(self._parallel(s, draft, position, temperature, top_p, gen, stop, timing))
        try:
            frame = await s.reply(seq, wire.Kind.VERIFY_RESULT)
        finally:
            stop.set()  # parallel drafting never delays verification by more than one step
        t2 = time.perf_counter()
        branches = await parallel if parallel is not None else None
        deep = frame.tensor().reshape(-1, self.hidden_size)
        if frame.arg != position or deep.shape[0] != k + 1:
            raise BackendError(
                f"{self.name}: worker verified {deep.shape[0]} positions from {frame.arg}, "
                f"sent {k + 1} from {position}",
                502,
                self.name,
            )
        new, accepted = await self._run(self._verify, s, deep, draft, position, temperature, top_p, gen)
        if accepted < k:
            s.send_control(wire.Kind.ROLLBACK, position + accepted + 1)
        if branches is not None and accepted == k - 1 and new[-1] in branches.candidates and branches.shallows:
            row = branches.candidates.index(new[-1])
            s.prepared = await self._run(self._adopt, s, branches, row)
            s.prepared_at = (new[-1], branches.position)
        t3 = time.perf_counter()
        st = self.stats
        st.rounds += 1
        st.drafted += k
        st.accepted += accepted
        st.round_tokens += len(new)
        st.draft_seconds += t1 - t0
        st.wait_seconds += t2 - t1
        st.verify_seconds += t3 - t2
        st.round_seconds += t3 - t0
        if k and t1 - t0 > 1e-3:
            self.gamma.update((t1 - t0) / k)
        return new

    def _draft_logits(self, feats: torch.Tensor, position: int) -> torch.Tensor:
        """Draft head: features [rows, hidden] of tokens fed at `position` -> logits [rows, vocab] for position+1.

        With a reduced draft vocabulary only its rows of the head are computed; the other logits are -inf."""
        if self._draft_ids is None:
            return self._output(feats).float()
        normed = self._output.norm(feats.to(self._draft_weight.dtype))
        logits = torch.full((feats.shape[0], self.vocab_size), float("-inf"))
        logits[:, self._draft_ids] = torch.nn.functional.linear(normed, self._draft_weight).float()
        return logits

    def _draft(
        self,
        s: _Session,
        token: int,
        position: int,
        cap: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | None,
    ) -> _Draft:
        """Draft up to `cap` tokens after `token` (Eq. 5 stop rule); shallow states of token + drafts."""
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        shallows: list[torch.Tensor] = []
        cur, pos = token, position
        stop = cap <= 0
        with torch.inference_mode():
            while True:
                shallow = self._input(torch.tensor([[cur]], dtype=torch.long), s.input_cache, positions=pos)
                shallows.append(shallow[0])
                feats = self.adapter(shallow, s.adapter_cache, positions=pos)
                if stop:
                    break
                d, probs = choose(self._draft_logits(feats[:, -1], pos)[0], temperature, top_p, gen)
                keep, stop = self.rule.decide(float(probs[d]), len(tokens))
                if not keep:
                    break
                tokens.append(d)
                dists.append(probs)
                stop = stop or len(tokens) >= cap
                cur, pos = d, pos + 1
        return _Draft(tokens, dists, torch.cat(shallows))

    # --- parallel drafting (Eq. 6) --------------------------------------------------------------

    def _pd_window(self, k: int, info: dict[str, Any]) -> tuple[float, float]:
        """(g, window): the worker's predicted compute g(mu + k+1) for this round's k+1 positions, and the seconds
        until the deep states are expected back, (k+1)A/beta_up + g + (k+1)A/beta_down (Eq. 6's numerator)."""
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        g = max(0.0, slope * (float(info.get("mu", 0.0)) + k + 1) + intercept)
        transfer = (k + 1) * self._token_bytes() * (1 / self.beta_up.get(10e6) + 1 / self.beta_down.get(15e6))
        return g, transfer + g

    def _token_bytes(self) -> int:
        return self.hidden_size * torch.empty((), dtype=self.wire_dtype).element_size()

    async def _parallel(
        self,
        s: _Session,
        draft: _Draft,
        position: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | None,
        stop: threading.Event,
        timing: tuple[float, float],
    ) -> _Branches | None:
        start = time.perf_counter()
        g, window = timing
        branches = await self._run(self._pd_start, s, draft, position)
        if branches is None:
            return None
        step = self.pd_gamma.get(self.gamma.get(0.05))
        steps = parallel_draft_steps(  # Eq. 6, with the measured time of one batched candidate step as gamma
            draft_len=len(draft.tokens) + 1,
            token_bytes=self._token_bytes(),
            beta_up=self.beta_up.get(10e6),
            beta_down=self.beta_down.get(15e6),
            g_mu=g,
            gamma=max(step, 1e-4),
            max_steps=self.rule.max_draft,
        )
        for _ in range(max(steps, 1)):
            if stop.is_set() or time.perf_counter() - start + step > window:
                break
            t = time.perf_counter()
            await self._run(self._pd_step, branches, temperature, top_p, gen)
            self.pd_gamma.update(time.perf_counter() - t)
            self.stats.parallel_steps += 1
            step = self.pd_gamma.get(step)
        return branches

    def _pd_start(self, s: _Session, draft: _Draft, position: int) -> _Branches | None:
        """Candidates: the top alternatives to the last draft at its position; caches forked before that position."""
        k = len(draft.tokens)
        at = position + k
        dist = draft.dists[-1]
        top = torch.topk(dist, min(self.parallel_candidates + 1, dist.numel())).indices.tolist()
        candidates = [t for t in top if t != draft.tokens[-1]][: self.parallel_candidates]
        rows = len(candidates)
        if not rows:
            return None
        return _Branches(at, candidates, s.input_cache.fork(rows, at), s.adapter_cache.fork(rows, at))

    def _pd_step(self, b: _Branches, temperature: float, top_p: float, gen: torch.Generator | None) -> None:
        """Feed every branch's newest token (the candidates first) and draft one more token per branch."""
        pos = b.position + len(b.shallows)
        cur = b.candidates if not b.tokens else b.tokens[-1]
        with torch.inference_mode():
            ids = torch.tensor(cur, dtype=torch.long)[:, None]
            shallow = self._input(ids, b.input_cache, positions=pos)
            feats = self.adapter(shallow, b.adapter_cache, positions=pos)
            logits = self._draft_logits(feats[:, -1], pos)
            chosen, probs, dists = [], [], []
            for row in logits:
                d, dist = choose(row, temperature, top_p, gen)
                chosen.append(d)
                probs.append(float(dist[d]))
                dists.append(dist)
        b.shallows.append(shallow[:, -1])
        b.tokens.append(chosen)
        b.probs.append(probs)
        b.dists.append(torch.stack(dists))

    def _adopt(self, s: _Session, b: _Branches, row: int) -> _Draft:
        """Make branch `row` the session's state: its caches, and its drafts (cut by Eq. 5) as the next draft."""
        n = 0
        for step_probs in b.probs:
            keep, stop = self.rule.decide(step_probs[row], n)
            if not keep:
                break
            n += 1
            if stop:
                break
        n = min(n, len(b.tokens))
        s.input_cache = b.input_cache.row(row)
        s.adapter_cache = b.adapter_cache.row(row)
        tokens = [b.tokens[i][row] for i in range(n)]
        shallows = [b.shallows[i][row : row + 1] for i in range(min(n + 1, len(b.shallows)))]
        with torch.inference_mode():
            keep_len = b.position + len(shallows)
            s.input_cache.crop(keep_len)
            s.adapter_cache.crop(keep_len)
            if len(shallows) < n + 1:  # the last draft was chosen but never fed: its shallow state is one step away
                ids = torch.tensor([[tokens[-1]]], dtype=torch.long)
                fed = self._input(ids, s.input_cache, positions=keep_len)
                self.adapter(fed, s.adapter_cache, positions=keep_len)
                shallows.append(fed[0])
        return _Draft(tokens, [b.dists[i][row] for i in range(n)], torch.cat(shallows))

    def _take_prepared(self, s: _Session, draft: _Draft, position: int, cap: int) -> _Draft:
        """A ready-made draft, cut to this round's cap (its caches cut to match)."""
        k = min(len(draft.tokens), max(cap, 0))
        if k < len(draft.tokens):
            s.input_cache.crop(position + k + 1)
            s.adapter_cache.crop(position + k + 1)
        return _Draft(draft.tokens[:k], draft.dists[:k], draft.shallow[: k + 1])

    def _verify(
        self,
        s: _Session,
        deep: torch.Tensor,
        draft: _Draft,
        position: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | None,
    ) -> tuple[list[int], int]:
        with torch.inference_mode():
            k = len(draft.tokens)
            rows: list[torch.Tensor] = []

            def target(i: int) -> torch.Tensor:
                # The LM head is the device's biggest cost. Run it on the first position alone: if the first draft is
                # rejected (the common case with a weak adapter) the other positions' logits are never needed.
                if i >= len(rows):
                    part = deep[:1] if not rows else deep[len(rows) :]
                    logits = self._output(part).float()
                    rows.extend(logits if temperature <= 0 else probabilities(logits, temperature, top_p))
                return rows[i]

            if temperature <= 0:
                a = 0
                while a < k and draft.tokens[a] == int(target(a).argmax()):
                    a += 1
                nxt = int(target(a).argmax())
            else:
                a, nxt = speculative_sample(target, draft.dists, draft.tokens, gen)
            keep = position + a + 1
            s.input_cache.crop(keep)
            s.adapter_cache.crop(keep)
        return [*draft.tokens[:a], nxt], a
