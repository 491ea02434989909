"""Device backend on llama-cpp-python.

All model calls run on one dedicated thread per model, never on the event loop.
Requests queue on that thread (a llama.cpp context is not safe to share), and
each checks a cancel flag between tokens, so closing a stream stops generation
within one token.

The thread computes a token only once the reader has taken the previous one
(lockstep, as llama-cpp-python's own server does). On a machine with as many
cores as llama.cpp has threads, a thread that ran ahead would compute the next
token while the event loop relays the last one: three busy threads on two
cores, and llama.cpp's threads wait for each other at every barrier, so a
preempted one stalls them all (BENCHMARKS.md, device decode speed).

Continuation from a delivered prefix is native: the prompt token IDs plus the
prefix token IDs are fed to `generate`, which also reuses the KV cache for the
longest common prefix with the previous request.

Two evaluation paths (`reproducible`). Greedy output is bit-identical only along the same computation path: the
logits of a prompt evaluated in one batch, taken from the KV cache plus one new token, or evaluated in other
batches differ in their last bits, and where two tokens are nearly tied the answer forks (which way depends on the
CPU's kernels). The fast path (the default) reuses the longest cached prefix and evaluates the rest in one batch.
The reproducible path evaluates the input (prompt + delivered prefix) in fixed chunks of `CANONICAL_CHUNK` tokens
from position 0 and then one token at a time, reusing only whole chunks that the cache holds from that same
path: the same input gives the same greedy answer whatever the cache held and however the request arrived (fresh,
repeated, or as a migration onto the device). Its price is re-evaluating up to one chunk of a repeated prompt
(BENCHMARKS.md, "Reproducible device path").

The prompt cache (`prompt_cache`, clients/prompt_cache.py; docs/prompt-cache.md) keeps the states of earlier
prefixes beside the live KV cache: before an input is evaluated, a stored state that serves more of it than the
live cache does is restored in its place (`_take_from_cache`); a live state about to be overwritten is saved first,
and so is one left idle (`IDLE_SNAPSHOT_SECONDS`), which is also when a long one goes to disk. On the reproducible
path only whole canonical chunks are stored and restored: the restored positions hold the bits the same path would
compute, so the answer is the same.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import random
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clients.base import BackendError, Concurrency, GenerationRequest, TokenEvent
from clients.chat_template import render_chat
from clients.dialects import LLAMA_CPP
from clients.grammar import LlamaVocabGrammars, TokenMask
from clients.llamacpp_state import identity_of, restore_state, take_state, trim_state
from clients.logprobs import NumpyLogitAdjuster, confidence_of, entry_from_logprobs, log_softmax
from clients.prompt_cache import CacheIdentity, PromptCache, PromptCacheOptions, StoredState, as_tokens
from clients.prompt_tokens import PromptTokenizer
from clients.token_emitter import TokenEmitter
from policies.lookup import common_prefix

log = logging.getLogger(__name__)

_END = object()

# Tokens per evaluation batch on the reproducible path. Small enough that a repeated prompt re-evaluates little
# (at most this many tokens), large enough that a long prompt is still evaluated in efficient batches.
CANONICAL_CHUNK = 32
# A live state idle this long is saved to the prompt cache (and a long one written to disk): off the requests' path,
# and at most once between two generations however fast turns come.
IDLE_SNAPSHOT_SECONDS = 1.0
# A stored state is restored when it serves at least this many more positions than the live KV cache; one read from
# disk (its bytes read and hashed) when it also spares at least 1/32 of its own length.
RESTORE_MIN_GAIN = 32
DISK_RESTORE_SHARE = 32


class LlamaCppBackend:
    can_continue = True
    dialect = LLAMA_CPP
    device_vocabulary = True  # it is the device model
    locality = "device"
    structured_output = "grammar"  # clients/grammar.py, in the sampling loop
    accepts_token_ids = True  # the device model's own vocabulary

    def __init__(
        self,
        name: str,
        model_path: Path,
        model_id: str,
        n_ctx: int = 4096,
        n_threads: int = 2,
        reproducible: bool = False,
        chunk: int = CANONICAL_CHUNK,
        prompt_cache: PromptCacheOptions | None = None,
    ):
        self.name = name
        self.model_id = model_id
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self._llm = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"llama-{name}")
        # Generation jobs that are running or queued; the disconnect tests count them.
        self.active = 0
        self._count_lock = threading.Lock()
        self.tokens_generated = 0
        self._generations = 0
        self._pieces: dict[int, bytes] = {}  # token id -> its bytes (logprobs), filled on the model thread
        self.reproducible = reproducible
        self.chunk = chunk  # the reproducible path's evaluation batch
        # Reproducible path: the KV cache's leading positions that were evaluated as whole canonical chunks.
        self._canonical_end = 0
        self._cache_options = prompt_cache
        self.prompt_cache: PromptCache | None = None  # built once the model is loaded (its identity needs it)
        self._live_saved = False  # the live KV cache is held by a stored state (nothing to save before it changes)
        self._idle_timer: threading.Timer | None = None

    @property
    def evaluations(self) -> int:
        """Moves whenever what `cached_prefix` counts may have changed: a generation started, a stored state left."""
        return self._generations + (self.prompt_cache.changes if self.prompt_cache is not None else 0)

    @property
    def context_window(self) -> int:
        """Its n_ctx: the prompt, the delivered prefix and the answer share it."""
        return self.n_ctx

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        from llama_cpp import Llama

        self._llm = Llama(
            model_path=str(self.model_path),
            n_ctx=self.n_ctx,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads,
            verbose=False,
        )
        meta = self._llm.metadata
        self.chat_template = meta.get("tokenizer.chat_template")
        vocab = self._llm._model.vocab
        import llama_cpp

        self._is_eog = lambda tok: bool(llama_cpp.llama_vocab_is_eog(vocab, tok))
        self._grammars = LlamaVocabGrammars(vocab, self._llm.n_vocab())
        self._prompt_tokens = PromptTokenizer(self._llm)
        self._bos = self._token_text(self._llm.token_bos())
        self._eos = self._token_text(self._llm.token_eos())
        if self._cache_options is not None and self._cache_options.enabled:
            self.prompt_cache = self._open_prompt_cache(self._cache_options)
        log.info("device model %s loaded (%s)", self.model_id, self.model_path.name)

    def _open_prompt_cache(self, options: PromptCacheOptions) -> PromptCache:
        """The prompt cache; its disk part under the identity of this model, tokenizer, context and build."""
        if options.persists:
            identity = identity_of(self._llm, self.model_path, self.n_ctx, options.folder / "identity")
        else:  # RAM only: the states never leave this context, which is all they must match
            identity = CacheIdentity("", "", self.n_ctx, "", "")
        return PromptCache(identity, options)

    def _token_text(self, tok: int) -> str:
        if tok is None or tok < 0:
            return ""
        return self._llm.detokenize([tok], special=True).decode("utf-8", errors="replace")

    async def close(self) -> None:
        cache = self.prompt_cache
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if cache is not None and cache.persists and self.active == 0 and self._llm is not None:
            # The live state, if not saved yet, goes to disk before the process does (a restart finds it).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(self._executor.submit(self._save_live)), 10)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if cache is not None:
            await asyncio.to_thread(cache.close)

    async def ready(self) -> bool:
        return self._llm is not None

    # -- tokenizer ---------------------------------------------------------------------------
    def render_chat(self, messages, tools=None) -> str:
        if not self.chat_template:
            raise BackendError(f"model {self.model_id} has no chat template", status=400, backend=self.name)
        return render_chat(self.chat_template, messages, bos_token=self._bos, eos_token=self._eos, tools=tools)

    @property
    def template_knows_tools(self) -> bool:
        return bool(self.chat_template) and "tools" in self.chat_template

    def special_token(self, text: str) -> int | None:
        """The id of `text` when the vocabulary has it as one special or user-defined token (e.g. <tool_call>)."""
        ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return ids[0] if len(ids) == 1 else None

    def tokenize_prompt(self, text: str) -> list[int]:
        """Tokenise a rendered prompt: special tokens in it (e.g. <|im_start|>) are honoured; the text
        between them is remembered (clients/prompt_tokens.py)."""
        return self._prompt_tokens(text)

    def tokenize(self, text: str) -> list[int]:
        """Tokenise generated text: no BOS, special-token text stays plain text."""
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    @property
    def vocab_size(self) -> int:
        return self._llm.n_vocab()

    def detokenize(self, ids) -> str:
        return self._llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def count_tokens(self, text: str) -> tuple[int, bool]:
        return len(self.tokenize(text)), True

    def concurrency(self) -> Concurrency:
        return Concurrency(lanes=1, limit=1)  # generations queue on the model thread: one at a time

    def cached_prefix(self, ids) -> int:
        """How many leading tokens of `ids` will be taken from a cache instead of evaluated: from the live KV cache,
        the longest common prefix with the last sequence evaluated (llama.cpp always evaluates at least the last
        token), or on the reproducible path the whole canonical chunks of it; from the prompt cache, what a stored
        state it would restore serves. Exact when read on the model thread."""
        if self._llm is None:
            return 0
        live, _, restored = self._plan(ids)
        return max(live, restored)

    def _live_reuse(self, ids) -> int:
        """What the live KV cache serves of `ids`."""
        llm = self._llm
        if self.reproducible:
            return self._reusable_chunks(ids)
        return common_prefix(llm.input_ids[: llm.n_tokens].tolist(), ids[:-1])  # a snapshot of the cache

    def _plan(self, ids) -> tuple[int, StoredState | None, int]:
        """(what the live KV cache serves of `ids`, the stored state worth restoring instead or None, what it
        serves)."""
        live = self._live_reuse(ids)
        cache = self.prompt_cache
        if cache is None or len(ids) < 2:
            return live, None, 0
        limit = self._last_chunk_start(len(ids)) if self.reproducible else len(ids) - 1
        entry, served = cache.best(as_tokens(ids), limit, self.reproducible, self.chunk)
        if entry is None:
            return live, None, 0
        on_disk_only = entry.payload is None
        need = max(RESTORE_MIN_GAIN, entry.n_tokens // DISK_RESTORE_SHARE) if on_disk_only else RESTORE_MIN_GAIN
        return (live, entry, served) if served - live >= need else (live, None, 0)

    def _take_from_cache(self, ids) -> int:
        """Before `ids` are evaluated (model thread): restore the stored state that serves more of them than the live
        KV cache, saving the live state first where it is about to be lost; returns the positions taken from a
        cache (the trace's cached tokens)."""
        cache = self.prompt_cache
        if cache is None:
            return self._live_reuse(ids)
        live, entry, _ = self._plan(ids)
        source = None
        if entry is not None:
            self._save_live()
            from_disk = entry.payload is None
            payload = cache.load(entry)
            if payload is not None and restore_state(self._llm, payload, entry.tokens):
                self._canonical_end = entry.usable(self.reproducible, self.chunk) if self.reproducible else 0
                self._live_saved = True
                source = "disk" if from_disk else "ram"
            elif payload is not None:  # llama.cpp refused the bytes: the live cache is gone with them
                log.warning("prompt cache: llama.cpp refused a stored state; removed")
                cache.forget(entry)
                self._canonical_end = 0
            live = self._live_reuse(ids)
        elif self._live_end() - live >= RESTORE_MIN_GAIN:
            self._save_live()  # this input overwrites a long stretch of the live cache: keep it
        cache.record_lookup(len(ids), live, source, live if source else 0)
        self._live_saved = False  # the evaluation that follows changes the live cache
        return live

    def _live_end(self) -> int:
        """The live KV cache's positions that a later input could reuse."""
        return min(self._canonical_end, self._llm.n_tokens) if self.reproducible else self._llm.n_tokens

    def _save_live(self) -> None:
        """Keep the live KV cache's state in the prompt cache (model thread), unless a stored state holds it already;
        on the reproducible path only its canonical chunks (the rest is dropped: no input could reuse it)."""
        cache = self.prompt_cache
        if cache is None or self._live_saved:
            return
        if self.reproducible:
            trim_state(self._llm, self._live_end())
        n = self._llm.n_tokens
        self._live_saved = True
        if n < cache.ram_min_tokens:
            return
        tokens = as_tokens(self._llm.input_ids[:n])
        canonical = n if self.reproducible else 0
        if not cache.covers(tokens, canonical):
            cache.put(tokens, canonical, self.chunk, take_state(self._llm))

    def _after_generation(self) -> None:
        """Once this generation is over and nothing else has run for IDLE_SNAPSHOT_SECONDS, save the live state."""
        if self.prompt_cache is None:
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = threading.Timer(IDLE_SNAPSHOT_SECONDS, self._submit_idle_snapshot, (self._generations,))
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _submit_idle_snapshot(self, generation: int) -> None:
        def snapshot() -> None:
            if self._generations == generation and self.active == 0:
                self._save_live()

        if self._generations == generation and self.active == 0:
            with contextlib.suppress(RuntimeError):  # the executor is shut down: the gateway is closing
                self._executor.submit(snapshot)

    def _reusable_chunks(self, ids) -> int:
        """Reproducible path: the cached positions a request for `ids` may keep — whole canonical chunks whose
        tokens match, short of the chunk holding the last token (which is evaluated again, as a fresh request
        would)."""
        last_start = self._last_chunk_start(len(ids))
        end = min(self._canonical_end, self._llm.n_tokens, last_start)
        n = common_prefix(self._llm.input_ids[:end].tolist(), ids)
        return n - n % self.chunk

    def _last_chunk_start(self, n: int) -> int:
        """Where the last canonical chunk of an n-token input starts (it holds the last token, which is evaluated
        for the logits the first pick needs)."""
        return (n - 1) // self.chunk * self.chunk

    def _evaluate_canonically(self, ids: list[int], keep: int) -> list[int]:
        """Reproducible path: bring the KV cache to the start of the last canonical chunk of `ids`, chunk by chunk
        from `keep` (its reusable chunks, `cached_prefix`); returns that last chunk, for `generate` to evaluate in
        one batch."""
        llm = self._llm
        self._canonical_end = keep
        llm.n_tokens = keep  # the next eval drops every cached position from here on
        last_start = self._last_chunk_start(len(ids))
        for start in range(keep, last_start, self.chunk):
            llm.eval(ids[start : start + self.chunk])
            self._canonical_end = start + self.chunk
        return ids[last_start:]

    # -- generation --------------------------------------------------------------------------
    def _input_ids(self, request: GenerationRequest) -> tuple[list[int], list[int]]:
        """(prompt ids, delivered prefix ids)."""
        prompt = (
            list(request.prompt_ids) if request.prompt_ids is not None else self.tokenize_prompt(request.prompt_text)
        )
        if request.prefix_ids is not None:
            prefix = list(request.prefix_ids)
        elif request.prefix_text:
            prefix = self.tokenize(request.prefix_text)
        else:
            prefix = []
        return prompt, prefix

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self._llm is None:
            raise BackendError(f"device model {self.model_id} is not loaded yet", status=503, backend=self.name)
        prompt, prefix = self._input_ids(request)
        ids = prompt + prefix
        mask = await self._grammars.for_request(request, lambda: prefix, self.name)
        room = self.n_ctx - len(ids)
        if room <= 0:
            raise BackendError(
                f"prompt is {len(ids)} tokens but the device model's context is {self.n_ctx}",
                status=400,
                backend=self.name,
            )
        max_tokens = min(request.max_tokens, room)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        taken = threading.Semaphore(0)  # released when the reader has taken a token and wants the next

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def run() -> None:
            try:
                if not cancel.is_set():
                    self._generate(ids, request, max_tokens, cancel, emit, taken, mask)
            except BaseException as exc:
                emit(exc)
            finally:
                with self._count_lock:
                    self.active -= 1
                emit(_END)
                self._after_generation()

        with self._count_lock:
            self.active += 1
        self._executor.submit(run)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise BackendError(f"device model failed: {item}", status=500, backend=self.name) from item
                yield item
                if item.finish_reason is not None:
                    return
                taken.release()
        finally:
            cancel.set()
            taken.release()  # a thread waiting for the reader sees the cancel at once

    def _piece(self, tok: int) -> bytes:
        piece = self._pieces.get(tok)
        if piece is None:
            piece = self._pieces[tok] = self._llm.detokenize([tok], special=True)
        return piece

    def _logits_processors(self, request: GenerationRequest, mask: TokenMask | None):
        """What runs on the raw logits before llama.cpp samples (None for a plain request: no numpy work per
        token then): the logprobs' capture (of the raw logits), then penalties and logit_bias, then the grammar's
        mask (clients/grammar.py). Penalties are
        applied here, not by llama.cpp's own sampler (which counts only its last 64 sampled tokens), so they
        count the whole answer, a continued prefix included, as every other backend does."""
        procs = []
        captured: list = [None]
        if request.logprobs is not None or request.confidence:

            def capture(_ids, scores):
                captured[0] = log_softmax(scores)
                return scores

            procs.append(capture)
        adjuster = None
        if request.adjusts_logits:
            if request.prefix_ids is not None:
                answer = list(request.prefix_ids)
            else:
                answer = self.tokenize(request.prefix_text) if request.prefix_text else []
            adjuster = NumpyLogitAdjuster(
                self._llm.n_vocab(),
                request.presence_penalty,
                request.frequency_penalty,
                request.logit_bias,
                answer,
            )
            procs.append(lambda _ids, scores: adjuster.apply(scores))
        if mask is not None:
            procs.append(lambda _ids, scores: mask.apply(scores))
        return (procs or None), captured, adjuster

    def _generate(
        self,
        ids,
        request: GenerationRequest,
        max_tokens: int,
        cancel: threading.Event,
        emit,
        taken: threading.Semaphore,
        mask: TokenMask | None = None,
    ) -> None:
        llm = self._llm
        seed = request.seed if request.seed is not None else random.getrandbits(31)
        llm.set_seed(seed)
        greedy = request.temperature <= 0
        extras = request.extras
        emitter = TokenEmitter(PieceDetokenizer(lambda tok: llm.detokenize([tok])), self._is_eog, max_tokens, mask)
        cached: int | None = self._take_from_cache(ids)
        self._generations += 1
        processors, captured, adjuster = self._logits_processors(request, mask)
        if self.reproducible:
            tail = self._evaluate_canonically(list(ids), cached)
            whole_tail = len(tail) == self.chunk  # once evaluated, the last chunk is a canonical one too
        for token in llm.generate(
            tail if self.reproducible else ids,
            temp=0.0 if greedy else request.temperature,
            top_p=1.0 if greedy else request.top_p,
            top_k=0 if greedy else request.top_k,  # 0: no cut
            # llama.cpp's own sampling extras, when the request sent them (clients/dialects.py); off otherwise.
            min_p=float(extras.get("min_p", 0.0)),
            typical_p=float(extras.get("typical_p", 1.0)),
            repeat_penalty=float(extras.get("repeat_penalty", 1.0)),
            mirostat_mode=int(extras.get("mirostat_mode", 0)),
            mirostat_tau=float(extras.get("mirostat_tau", 5.0)),
            mirostat_eta=float(extras.get("mirostat_eta", 0.1)),
            reset=not self.reproducible,
            logits_processor=processors,
        ):
            if self.reproducible and cached is not None and whole_tail:
                self._canonical_end = len(ids)
            if cancel.is_set():
                return
            lps = None
            if processors is not None:
                if adjuster is not None:
                    adjuster.accept(token)
                if captured[0] is not None and request.logprobs is not None:
                    lps = (entry_from_logprobs(captured[0], token, request.logprobs, self._piece),)
            sure = confidence_of(captured[0]) if request.confidence and captured[0] is not None else None
            event = emitter.emit(token, lps, cached_tokens=cached, confidence=sure)
            if event.token_id is not None:  # an end token is not emitted
                self.tokens_generated += 1
            emit(event)
            cached = None
            if event.finish_reason is not None:
                return
            taken.acquire()  # the next token is computed once the reader has this one (lockstep)
            if cancel.is_set():
                return


class PieceDetokenizer:
    """llama.cpp's token pieces are raw bytes: an incremental UTF-8 decoder holds back a character split over
    tokens until its last byte is here (clients/token_emitter.py's Detokenizer)."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._piece(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
