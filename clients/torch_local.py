"""Device backend on a transformers causal LM (fp32 on CPU), token by token.

Why a manual decode loop instead of `generate`: the gateway needs one event
per token with its id, continuation from an arbitrary prefix (migration), and
cancellation within one token when the client or the orchestrator drops the
stream. `generate` offers none of that cleanly.

Threading: torch calls block, so every model call runs on ONE dedicated thread
per model, never on the event loop. That thread round-robins one step (a
prefill chunk or one decode token) at a time across the active streams, so
concurrent requests queue safely and a second stream is not starved by a long
first one. Each stream has a cancel flag, checked before every step; closing
the async iterator (aclose or task cancellation) sets it.

A request's grammar (tool_choice / response_format, clients/grammar.py) masks the logits before every pick, from
the delivered prefix on when the grammar covers it; the answer ends ("stop") once the grammar is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clients.base import BackendError, Concurrency, GenerationRequest, NoPrefixCache, TokenEvent
from clients.dialects import TORCH
from clients.grammar import HFTokenizerGrammars, TokenMask
from clients.hf_model import (
    UNKNOWN_CONTEXT,
    HFTokenizerMixin,
    IncrementalDetokenizer,
    declared_context,
    open_token_source,
)
from clients.sampling import LogitAdjuster, sample_next, seeded_generator, token_logprob
from clients.token_emitter import TokenEmitter

log = logging.getLogger(__name__)

_PREFILL_CHUNK = 256  # tokens per prefill step: bounds how long a cancel or another stream waits


@dataclass
class _Job:
    """One stream's state, owned by the model thread except for `cancel` (set from the event loop)."""

    request: GenerationRequest
    emit: Callable[[Any], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    steps: Iterator[None] | None = None
    mask: TokenMask | None = None  # the request's grammar, if any


_DONE = object()


class _ModelThread:
    """The one thread that touches the model: runs submitted calls and steps active jobs round-robin."""

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._jobs: list[_Job] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"torch-model-{name}", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def add(self, job: _Job) -> None:
        self._inbox.put(("job", job, None))

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None, None))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _take(self, item: Any) -> None:
        kind, obj, fut = item
        if kind == "call":
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(obj())
                except BaseException as e:
                    fut.set_exception(e)
        elif kind == "job":
            self._jobs.append(obj)

    def _run(self) -> None:
        while not self._stopping:
            try:
                if not self._jobs:
                    self._take(self._inbox.get())
                while True:
                    self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for job in list(self._jobs):
                if self._stopping:
                    break
                if job.cancel.is_set():
                    self._finish(job)
                    continue
                try:
                    next(job.steps)  # type: ignore[arg-type]
                except StopIteration:
                    self._finish(job)
                except Exception as e:
                    log.exception("torch generation failed")
                    job.emit(BackendError(f"torch generation failed: {e}", status=502))
                    self._finish(job)
        for job in self._jobs:
            job.emit(BackendError("backend closed", status=503))
        self._jobs.clear()
        while True:  # nothing submitted after close may wait forever
            try:
                kind, obj, fut = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                fut.cancel()
            elif kind == "job":
                obj.emit(BackendError("backend closed", status=503))

    def _finish(self, job: _Job) -> None:
        if job.steps is not None:
            with contextlib.suppress(Exception):
                job.steps.close()  # type: ignore[attr-defined]
        self._jobs.remove(job)
        job.emit(_DONE)


class TorchBackend(NoPrefixCache, HFTokenizerMixin):
    """Backend protocol (clients.base) on a transformers causal LM converted from a bundled GGUF.

    Pass `gguf_path` (loaded through clients.hf_model, cached) or an already-loaded `model` + `tokenizer`.

    Event contract: one TokenEvent per generated token, and how the answer ends: clients/token_emitter.py (which
    says why stop sequences are the relay's, not a backend's).
    """

    can_continue = True
    dialect = TORCH
    device_vocabulary = True  # it is the device model
    locality = "device"
    structured_output = "grammar"  # clients/grammar.py, in the decode loop
    accepts_token_ids = True  # the device model's own vocabulary

    def __init__(
        self,
        gguf_path: str | os.PathLike[str] | None = None,
        *,
        name: str = "torch",
        model_id: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        cache_root: str | os.PathLike[str] | None = None,
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        prefill_chunk: int = _PREFILL_CHUNK,
    ) -> None:
        if gguf_path is None and (model is None or tokenizer is None):
            raise ValueError("TorchBackend needs gguf_path or both model and tokenizer")
        self.name = name
        self.model_id = model_id or (Path(gguf_path).stem if gguf_path is not None else name)
        self._gguf_path = gguf_path
        self._cache_root = cache_root
        self._dtype = dtype
        self._num_threads = num_threads
        self._prefill_chunk = max(1, prefill_chunk)
        self.model = model
        self.tokenizer = tokenizer
        self._tok_lock = threading.Lock()  # the Rust tokenizer is shared by the loop and the model thread
        self._grammars: HFTokenizerGrammars | None = None
        self._thread: _ModelThread | None = None
        self._ready = False
        self.eos_ids: frozenset[int] = frozenset()
        self.max_context: int | None = declared_context(gguf_path, model)  # the loaded model's config's, once loaded
        # Counters (written on the model thread; read anywhere): for metrics and tests.
        self.tokens_generated = 0
        self.forward_calls = 0
        self.load_seconds: float | None = None

    @property
    def context_window(self) -> int:
        """The model's context (max_position_embeddings): the prompt, the delivered prefix and the answer share it."""
        return self.max_context or UNKNOWN_CONTEXT

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._ready:
            return
        if self._thread is None:
            self._thread = _ModelThread(self.name)
        await asyncio.wrap_future(self._thread.call(self._load))
        self._ready = True

    def _load(self) -> None:
        t0 = time.monotonic()
        src = open_token_source(
            self._gguf_path,
            self._cache_root,
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self._dtype,
            num_threads=self._num_threads,
        )
        self.model, self.tokenizer = src.model, src.tokenizer
        self.eos_ids, self.max_context = src.eos_ids, src.max_context
        self._grammars = HFTokenizerGrammars(self.tokenizer, self.eos_ids, self._tok_lock)
        self.load_seconds = time.monotonic() - t0
        log.info(
            "%s: model %s ready in %.1f s (eos ids %s)",
            self.name,
            self.model_id,
            self.load_seconds,
            sorted(self.eos_ids),
        )

    async def close(self) -> None:
        self._ready = False
        if self._thread is not None:
            thread, self._thread = self._thread, None
            thread.stop()
            await asyncio.to_thread(thread.join, 10.0)

    async def ready(self) -> bool:
        return self._ready

    def concurrency(self) -> Concurrency:
        return Concurrency(lanes=1, limit=1)  # generations queue on the model thread: one at a time

    async def wait_idle(self) -> None:
        """Resolve once every job submitted before this call has finished or been dropped (tests, shutdown)."""
        if self._thread is None:
            return
        while self._thread._jobs:  # noqa: ASYNC110 - a test/shutdown helper polling a thread-owned list
            await asyncio.sleep(0.005)
        await asyncio.wrap_future(self._thread.call(lambda: None))

    # --- what the gateway needs of a device backend (the tokenizer: HFTokenizerMixin) ---------

    @property
    def model_path(self) -> Path | None:
        return None if self._gguf_path is None else Path(self._gguf_path)

    @property
    def active(self) -> int:
        """Generations running or queued on the model thread."""
        return len(self._thread._jobs) if self._thread is not None else 0

    @property
    def vocab_size(self) -> int:
        return len(self._require_tokenizer())

    # --- generation -----------------------------------------------------------------------------

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self._ready or self._thread is None:
            raise BackendError(f"{self.name}: model not loaded", status=503, backend=self.name)
        context = self.context_ids(request)
        if self.max_context is not None and len(context) >= self.max_context:
            raise BackendError(
                f"{self.name}: prompt of {len(context)} tokens does not fit the {self.max_context}-token context",
                status=400,
                backend=self.name,
            )
        assert self._grammars is not None
        mask = await self._grammars.for_request(request, lambda: self.answer_prefix_ids(request), self.name)

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def emit(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # loop already closed: nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, item)

        job = _Job(request=request, emit=emit, mask=mask)
        job.steps = self._steps(job, context)
        self._thread.add(job)
        try:
            while True:
                item = await events.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, BackendError) and item.backend is None:
                        item.backend = self.name
                    raise item
                yield item
        finally:
            job.cancel.set()  # aclose / cancellation / normal end: the model thread drops the job before its next step

    def _steps(self, job: _Job, context: list[int]) -> Iterator[None]:
        """Generator run on the model thread: one model call per `next()`, events pushed through job.emit."""
        from transformers import DynamicCache

        req = job.request
        model = self.model
        max_tokens = req.max_tokens
        if self.max_context is not None:
            max_tokens = min(max_tokens, self.max_context - len(context))
        generator = seeded_generator(req.temperature, req.seed)
        emitter = TokenEmitter(
            IncrementalDetokenizer(self.detokenize, context), self.eos_ids.__contains__, max_tokens, job.mask
        )
        adjust = LogitAdjuster(req, self.answer_prefix_ids(req)) if req.adjusts_logits else None
        lps = None
        if max_tokens <= 0:
            job.emit(TokenEvent(text="", finish_reason="length"))
            return

        # No `yield` inside an inference_mode block: other jobs' steps run on this thread while we are suspended.
        cache = DynamicCache(config=model.config)
        logits: torch.Tensor | None = None
        for start in range(0, len(context), self._prefill_chunk):
            chunk = torch.tensor([context[start : start + self._prefill_chunk]], dtype=torch.long)
            with torch.inference_mode():
                out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.forward_calls += 1
            logits = out.logits[0, -1]
            yield  # lets other streams and the cancel flag in between prefill chunks
        assert logits is not None
        mask = job.mask
        while True:
            scores = logits if adjust is None else adjust.apply(logits)
            if mask is not None:
                scores = mask.apply(scores)
            token = sample_next(scores, req.temperature, req.top_p, generator, req.top_k, req.min_p)
            if adjust is not None:
                adjust.accept(token)
            if req.logprobs is not None:
                lps = (token_logprob(logits, token, req.logprobs, self.token_bytes),)
            self.tokens_generated += 1
            event = emitter.emit(token, lps)
            job.emit(event)
            if event.finish_reason is not None:
                return
            yield  # the cancel flag is checked here, before the next forward pass
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            self.forward_calls += 1
            logits = out.logits[0, -1]
