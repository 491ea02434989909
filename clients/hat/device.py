"""The HAT device half: a Backend that keeps raw tokens on the device and borrows a worker's middle layers.

On the device: the input submodel (embedding + layers 0..m-1), the output submodel (final norm + LM head) and the
adapter Lambda, which together form the draft model w_S = H o Lambda o w^m. On the worker (app/worker/engine.py): the
middle layers m..n-1 and their KV cache. Only hidden states and control frames cross the link — never token ids
or text (the OPEN frame carries structural facts only: hidden size, layer counts, m, dtype, model name).

One generation = one worker session, on the worker of its pool (`worker_urls`, clients/hat/pool.py) with the lowest
predicted delay. When that worker dies or stalls mid-answer, the generation opens a session on another and rebuilds
the lost KV cache by prefilling the delivered context (prompt + every token already emitted) there, recomputed from
the token ids the device holds (only hidden states leave the device, as always), then goes on: no token lost or
repeated, greedy output the uninterrupted run's. When no worker is left, the error reaches the gateway, whose fault
migration moves the answer to another endpoint.

1. Prefill (HAT §3.3). The prompt (+ any prefix being continued) is cut into chunks of X tokens, X from Eq. 3
   (policies/chunking.py) given the measured upload bandwidth and the worker's g(.) and mu (sent in its OPEN
   reply). For each chunk the device runs the input submodel (and the adapter, to fill its KV cache), and
   sends the shallow states at once, without waiting for earlier chunks' replies: the upload of chunk k+1
   overlaps the worker's compute of chunk k. The deep state of the last prompt position gives the first token.
2. Decode rounds (HAT §3.4). Starting from the last accepted token, the draft model drafts greedily (or samples,
   at temperature > 0) until the draft token's probability falls below eta (Eq. 5, default 0.6; the
   low-confidence token is kept as the last draft) or max_draft (8) is reached — or, with draft_length "eq7" /
   "eq7+eta", exactly / at most l* tokens, l* chosen per round from Eq. 7 and the measured round time
   (policies.drafting.DraftLengthController; the worker's mu and g arrive at OPEN and in STATUS frames while the
   session runs, and every round's outcome feeds the acceptance estimate). The device sends the shallow
   states of [last accepted token + drafts] (DRAFT), gets their deep states back (VERIFY_RESULT), and its output
   submodel verifies: greedy accepts the longest matching prefix plus the LLM's own next token; sampling uses
   speculative rejection sampling (accept d with prob min(1, p(d)/q(d)), else resample from max(0, p - q)), so
   the output is distributed exactly as the LLM's (with the same temperature / top-p). Rejected positions are
   removed from the worker's cache with ROLLBACK and from the device's own caches with crop.
3. Greedy output equals plain U-shape greedy decoding token for token, up to float reassociation: verifying
   k+1 positions in one pass computes the same math as k+1 one-token passes in a different order (~1e-5
   relative), which can flip an exact near-tie between the top two logits. Tests report such ties' gaps.

4. Parallel drafting (HAT §3.5, Eq. 6; `parallel_drafting`; clients/hat/rounds.py): while the worker verifies, the
   device drafts ahead from the top-k alternatives to the last draft token. Proactive drafting (SpecEdge;
   `proactive_drafting`): it drafts the next round as if all drafts were accepted, from the draft head's guess for
   the token verification adds. Both opt-in, greedy rounds only; neither changes the output.
5. Grammars (tool_choice / response_format: GenerationRequest.grammar, clients/grammar.py). The head's logits are
   masked before every pick, after penalties / logit_bias; the grammar is advanced over the delivered prefix when
   it covers it; the answer ends ("stop") once the grammar is complete, and EOS can only be picked where the
   grammar allows it. Speculative decoding stays on and exact: the draft model picks each draft from its masked
   logits (the matcher walked over the drafts tentatively, then rolled back), and verification masks position j
   with the matcher advanced over drafts 0..j-1, so greedy output equals plain masked U-shape decoding token for
   token and sampling keeps the masked distribution. Parallel drafting is off under a grammar (each branch would
   need its own grammar state). Logprobs come from the head's raw logits. Requests without a grammar do no mask
   work at all.
6. Token trees (`tree_width` >= 3; clients/hat/tree.py, clients/hat/rounds.py, policies/trees.py): a greedy round
   drafts a tree of w nodes over the draft head's top-k and keeps the verified path in both caches (KEEP to the
   worker). Output is still greedy U-shape's. Rounds that sample, adjust logits, follow a grammar or return
   logprobs stay chains.

Here: the backend — loading, a generation's session, its prefill and the emitted tokens. Beside it:
clients/hat/half.py (the device's parts and heads: DeviceHalf), clients/hat/model_thread.py (the thread they run
on), clients/hat/prefill_plan.py (the chunks), clients/hat/rounds.py (decode rounds: chains, trees, parallel
drafting), clients/hat/verify.py (verification, a function of the head's logits), clients/hat/request_sampling.py
(a request's Sampling), clients/hat/drafting.py (the draft model), clients/hat/station.py (several streams' device
work batched), clients/hat/link_model.py (bandwidth estimates, the worker's mu and g), clients/hat/session.py (a
generation's frames), clients/hat/transport.py (WebSocket for ws:// and wss:// worker URLs, POST + SSE for http://
and https://, through the link emulator of clients/hat/link.py when a LinkProfile is given), clients/hat/options.py
(settings, counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clients.base import BackendError, Concurrency, GenerationRequest, NoPrefixCache, TokenEvent
from clients.dialects import TORCH
from clients.grammar import HFTokenizerGrammars, TokenMask
from clients.hat import wire
from clients.hat.drafting import Drafter, DraftState
from clients.hat.half import DeviceHalf
from clients.hat.link_model import LinkModel
from clients.hat.model_thread import ModelThread
from clients.hat.options import HATOptions, HATStats
from clients.hat.pool import PoolWorker, WorkerPool
from clients.hat.prefill_plan import PrefillPlanner, fit_device_tau
from clients.hat.profile import load_profile
from clients.hat.registry import WorkerRegistry
from clients.hat.request_sampling import Sampling
from clients.hat.rounds import DecodeRounds
from clients.hat.session import FrameSession
from clients.hat.station import DraftingStation, StreamSlot
from clients.hat.transport import LinkOptions
from clients.hf_model import (
    UNKNOWN_CONTEXT,
    HFTokenizerMixin,
    IncrementalDetokenizer,
    declared_context,
    open_token_source,
)
from clients.sampling import LogitAdjuster, sample_next, seeded_generator, token_logprob
from clients.token_emitter import TokenEmitter
from policies.drafting import DraftLengthController, DraftStopRule
from policies.estimate import MovingAverage
from policies.trees import DraftTree, best_tree, from_paths, prior_probabilities

log = logging.getLogger(__name__)

# A session that fails with one of these moves to another worker of the pool: the worker or the link failed
# (502: it broke off or sent nonsense; 503: unreachable or full; 504: it stalled). 4xx: the request itself.
_WORKER_FAULTS = (502, 503, 504)


@dataclass
class _Answer:
    """One generation's state that outlives a worker session: what was delivered, and how each next token is
    picked (the emitter, penalties and sampling carry on across a failover as if nothing happened)."""

    request: GenerationRequest
    context: list[int]
    mask: TokenMask | None
    emitted: list[int] = field(default_factory=list)
    emitter: TokenEmitter | None = None
    adjust: LogitAdjuster | None = None
    sampling: Sampling | None = None
    generator: Any = None


class HATBackend(NoPrefixCache, HFTokenizerMixin):
    """Backend protocol (clients.base) over a HAT worker: the device half of a U-shaped split with drafting.

    Run as `options` (HATOptions) say, on:
    gguf_path: the bundled model's GGUF (loaded through clients.hf_model, cached) — or give a loaded `model` +
        `tokenizer`, which is then shared rather than trimmed to the device's layers. Must be the model the worker
        splits (checked: hidden size, layer count, m). `cache_root`: where converted models are kept.
    name, model_id: the backend's name (threads, logs, errors) and its model's (default: the GGUF's stem).
    adapter_path: a trained adapter (safetensors, clients.hat.adapter.Adapter.save); None = untrained adapter
        initialised from layer m's attention (correct output, low accept length).
    draft_vocab_path: a reduced draft vocabulary (JSON {"token_ids": [...]}, `tandem train-adapter
        --save-draft-vocab`): drafts are chosen among these tokens (plus the end tokens) only, so a draft step's
        LM head multiplies a few thousand rows instead of the whole vocabulary. Verification always uses the
        full head, so the output is unchanged (greedy) or still exactly the LLM's distribution (sampling: the
        draft distribution is simply zero outside the subset). None = draft over the full vocabulary. The draft
        head's rows and the adapter's projections run as int8 unless options.draft_precision = "fp32"; the verification
        head of argmax-only picks as int8 exact for the argmax unless options.head_precision = "fp32".
    """

    can_continue = True
    locality = "split"
    structured_output = "grammar"  # clients/grammar.py: the head's logits masked before every pick, drafts included
    accepts_token_ids = False  # True when the worker's model shares the device's vocabulary (set by the gateway)
    dialect = TORCH

    @property
    def device_vocabulary(self) -> bool:
        return self.accepts_token_ids

    def __init__(
        self,
        options: HATOptions,
        *,
        gguf_path: str | os.PathLike[str] | None = None,
        name: str = "hat",
        model_id: str | None = None,
        adapter_path: str | os.PathLike[str] | None = None,
        draft_vocab_path: str | os.PathLike[str] | None = None,
        cache_root: str | os.PathLike[str] | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        if gguf_path is None and (model is None or tokenizer is None):
            raise ValueError("HATBackend needs gguf_path or both model and tokenizer")
        o = self.options = options
        registry = WorkerRegistry(o.worker_registry, o.worker_registry_prefix) if o.worker_registry else None
        static = list(o.worker_urls) or ([] if registry is not None else [o.worker_url])
        self.pool = WorkerPool(static, registry, o.m)
        self.transport = self.pool.workers[0].address.kind if self.pool.workers else "ws"
        self.name = name
        self.model_path = Path(gguf_path) if gguf_path is not None else None
        self.model_id = model_id or (self.model_path.stem if self.model_path is not None else name)
        self._adapter_path = adapter_path
        self._draft_vocab_path = draft_vocab_path
        self._cache_root = cache_root
        self.wire_dtype = wire.dtype_by_name(o.wire_dtype)
        self.link_options = LinkOptions(
            name=name,
            auth_token=o.auth_token.get_secret_value() if o.auth_token is not None else None,
            connect_timeout=o.connect_timeout,
            round_timeout=o.round_timeout,
            max_frame_bytes=o.max_frame_bytes or wire.DEFAULT_MAX_FRAME_BYTES,
            wire_dtype=self.wire_dtype,
            profile=o.link,
            noise=o.noise,  # privacy noise on the sent hidden states (clients/hat/noise.py; FrameSession applies it)
            noise_seed=o.noise_seed,
        )
        profile = load_profile(o.profile) if o.profile else None  # measured parts (clients/hat/profile.py)
        if profile is not None:
            profile.check_model({self.model_id, self.model_path.name if self.model_path else ""}, o.m)
        # ARCA (arca = true): the shape with the most modelled tokens per second on this hardware is what runs — a
        # chain of width w drafts w - 1 tokens a round (the fixed chain ARCA modelled; with draft_length "eq7" or
        # "eq7+eta" Eq. 7's l* and that mode's confidence stop act within the cap), a tree is verified whenever a
        # greedy round's cap reaches its depth.
        self.arca = profile.arca_choice() if profile is not None and o.arca else None
        if o.arca and self.arca is None:
            raise ValueError(f"arca: profile {o.profile} has no Table I (acceptance.table1): rerun tandem profile")
        max_draft = self.arca.draft_cap(o.max_draft) if self.arca is not None else o.max_draft
        self.speculative = o.speculative and max_draft > 0  # ARCA's chain of width 1 is U-shape
        self.max_draft = max(max_draft, 1)
        self.controller = DraftLengthController(mode=o.draft_length, max_len=self.max_draft, eta=o.eta)
        # The token tree greedy rounds verify (None: chains). ARCA's tree, else tree_paths, else shaped from the prior.
        self.tree: DraftTree | None = None
        if self.arca is not None:
            self.tree = from_paths(self.arca.tree_paths) if self.arca.tree_paths else None
        elif o.tree_paths:
            self.tree = from_paths(o.tree_paths)
        elif o.tree_width >= 3:
            self.tree = best_tree(o.tree_width, prior_probabilities(min(o.tree_width - 1, self.max_draft)))
        # "eq7" drafts exactly l*, and ARCA's chain under "eta" exactly w - 1: the confidence stop is off (eta 0), only
        # the per-round cap stops a draft.
        fixed_chain = self.arca is not None and self.arca.kind == "chain" and o.draft_length == "eta"
        rule_eta = 0.0 if o.draft_length == "eq7" or fixed_chain else o.eta
        self.rule = DraftStopRule(
            eta=rule_eta, max_draft=self.max_draft, include_low_confidence=o.include_low_confidence
        )
        link = o.link
        self.link_model = LinkModel(
            up=MovingAverage(value=(link.up_bandwidth if link and link.up_bandwidth else o.beta_up)),
            down=MovingAverage(value=(link.down_bandwidth if link and link.down_bandwidth else o.beta_down)),
        )
        if link is not None:
            self.link_model.latency = link.latency
        if profile is not None:  # measured parts instead of warm-up priors
            self.controller.seed(profile.measured_parts())
            if link is None:
                self.link_model.latency = profile.rtt_ms / 2e3
            self.link_model.up = MovingAverage(value=profile.up_bytes_per_s or self.link_model.up.value)
            self.link_model.down = MovingAverage(value=profile.down_bytes_per_s or self.link_model.down.value)
        log.info("%s: verifies %s", name, self.shape)
        self._owns_model = model is None
        self.model = model
        self.tokenizer = tokenizer
        self._tok_lock = threading.Lock()
        self._grammars: HFTokenizerGrammars | None = None  # built at load, its tokenizer at the first grammar
        self.thread = ModelThread(name)  # every torch call of the device half runs on it
        self._ready = False
        self._worker_ok: tuple[float, bool] = (0.0, False)
        self.eos_ids: frozenset[int] = frozenset()
        self.max_context: int | None = declared_context(gguf_path, model)  # the loaded model's config's, once loaded
        self._worker_context: int | None = None  # the context a worker's /health/ready said its sessions hold
        # Set at load: the device's parts, its draft model, the prefill's chunking, the decode rounds and (drafting =
        # "batched") the station batching concurrent streams' device work.
        self.half: DeviceHalf | None = None
        self.drafter: Any = None
        self.prefill_planner: PrefillPlanner | None = None
        self.rounds: DecodeRounds | None = None
        self.station: DraftingStation | None = None
        self.active = 0
        self.tokens_generated = 0
        self.stats = HATStats()
        # Told when a session with the worker opens ("opened", its worker, μ, draft shape) and closes ("closed", the
        # backend's acceptance so far): the gateway publishes it on its event bus. Never raises into a generation.
        self.on_session: Callable[[str, dict], None] | None = None

    @property
    def shape(self) -> str:
        """The verification shape this backend runs (logged at start; `tandem bench hat` reports it)."""
        if self.arca is not None:
            return f"{self.arca.name} (draft cap {self.max_draft if self.speculative else 0})"
        if self.tree is not None:
            return f"tree w={self.tree.width} (draft cap {self.max_draft})"
        return f"chain, draft cap {self.max_draft}" if self.speculative else "U-shape (no drafts)"

    @property
    def context_window(self) -> int:
        """The split model's context, within what its workers' sessions hold (the largest a worker reported: on
        /health/ready, or on opening a session)."""
        reported = [int(w.info["max_context"]) for w in self.pool.workers if w.info.get("max_context")]
        reported += [self._worker_context] if self._worker_context else []
        model = self.max_context or UNKNOWN_CONTEXT
        return min(model, max(reported)) if reported else model

    @property
    def hidden_size(self) -> int:
        return self.half.hidden_size if self.half is not None else 0

    @property
    def num_layers(self) -> int:
        return self.half.num_layers if self.half is not None else 0

    @property
    def vocab_size(self) -> int:
        return self.half.vocab_size if self.half is not None else 0

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._ready:
            return
        self.thread.start()
        await self.thread.run(self._load)
        self._ready = True

    def load_half(self, model: Any) -> DeviceHalf:
        """The device's parts of `model` (a subclass may give them another draft head: the tests' oracles)."""
        return DeviceHalf.load(model, self.options.m, self._adapter_path, trim=self._owns_model)

    def _load(self) -> None:
        t0 = time.monotonic()
        o = self.options
        src = open_token_source(
            self.model_path, self._cache_root, model=self.model, tokenizer=self.tokenizer, num_threads=o.num_threads
        )
        self.model, self.tokenizer = src.model, src.tokenizer
        half = self.half = self.load_half(src.model)
        self.drafter = Drafter(half, self.rule, o.parallel_candidates)
        self.eos_ids, self.max_context = src.eos_ids, src.max_context
        self._grammars = HFTokenizerGrammars(self.tokenizer, self.eos_ids, self._tok_lock)
        if self._draft_vocab_path:
            half.load_draft_vocab(self._draft_vocab_path, self.eos_ids)
        if o.draft_precision == "int8" and not half.quantize_drafting():
            log.warning("%s: this torch has no CPU int8 kernel: the draft head stays fp32", self.name)
        if o.head_precision == "int8" and not half.quantize_head():
            log.warning("%s: no CPU int8 kernel within the exactness bound here: the head stays fp32", self.name)
        if o.drafting == "batched":
            self.station = DraftingStation(
                half, self.thread, self.rule, self.token_bytes, draft_step_rows=o.draft_step_rows
            )
        self.link_model.state_bytes = half.hidden_size * torch.empty((), dtype=self.wire_dtype).element_size()
        device_tau = fit_device_tau(self.drafter) if o.chunking == "dp" else None
        self.prefill_planner = PrefillPlanner(o, self.link_model.state_bytes, device_tau)
        self.rounds = DecodeRounds(
            name=self.name,
            options=o,
            half=half,
            thread=self.thread,
            drafter=self.drafter,
            station=self.station,
            controller=self.controller,
            link=self.link_model,
            tree=self.tree,
            token_bytes=self.token_bytes,
        )
        log.info("%s: device half of %s ready in %.1f s", self.name, self.model_id, time.monotonic() - t0)

    async def close(self) -> None:
        self._ready = False
        if self.station is not None:
            await self.station.close()
        await self.thread.close()
        await self.pool.close()

    def concurrency(self) -> Concurrency:
        return self.pool.concurrency()

    async def ready(self) -> bool:
        """Local half loaded and a worker of the pool answered /health/ready with 200 (cached for 5 s)."""
        if not self._ready:
            return False
        checked, ok = self._worker_ok
        if time.monotonic() - checked < 5.0:
            return ok
        import httpx

        ok = False
        await self.pool.refresh()
        async with httpx.AsyncClient(timeout=2.0) as client:
            for worker in self.pool.workers:
                try:
                    response = await client.get(worker.address.http_base + "/health/ready")
                    if response.status_code == 200:
                        self._worker_context = response.json().get("max_context") or self._worker_context
                        ok = True
                        break
                except (httpx.HTTPError, ValueError):
                    continue
        self._worker_ok = (time.monotonic(), ok)
        return ok

    # --- generation -----------------------------------------------------------------------------

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self._ready:
            raise BackendError(f"{self.name}: model not loaded", status=503, backend=self.name)
        context = self.context_ids(request)
        assert self._grammars is not None
        mask = await self._grammars.for_request(request, lambda: self.answer_prefix_ids(request), self.name)
        answer = _Answer(request, context, mask)
        self.active += 1
        tried: set[str] = set()
        failure = BackendError(f"{self.name}: no HAT worker in the pool", 503, self.name)
        try:
            await self.pool.refresh()
            while (worker := self.pool.place(tried)) is not None:
                tried.add(worker.url)
                try:
                    # aclosing: a stream closed early (a lost race, a migration, the client gone) closes the worker
                    # session at once, not whenever the garbage collector finalises it.
                    async with contextlib.aclosing(self._on_worker(worker, answer)) as events:
                        async for event in events:
                            yield event
                    return
                except BackendError as exc:
                    if exc.status not in _WORKER_FAULTS:
                        raise
                    self.pool.failed(worker)
                    failure = exc
                    if answer.emitted:
                        self.stats.failovers += 1
                        log.warning(
                            "%s: worker %s lost after %d tokens (%s); moving the session",
                            self.name,
                            worker.url,
                            len(answer.emitted),
                            exc,
                        )
            raise failure
        finally:
            self.active -= 1

    async def _on_worker(self, worker: PoolWorker, answer: _Answer) -> AsyncIterator[TokenEvent]:
        """The answer's tokens from one worker session: from the prompt, or (after a failover) from the delivered
        context, prefilled again on this worker."""
        context = answer.context + answer.emitted
        transport = worker.address.transport(self.link_options)
        link = FrameSession(transport, self.link_options, self.hidden_size)
        st = self.drafter.new_state()
        slot = self.station.join(len(context)) if self.station is not None else None
        worker.sessions += 1
        session_line: dict | None = None
        try:
            opened = time.perf_counter()
            info = await link.open(self.num_layers, self.options.m, self.model_id)
            self.pool.opened(worker, time.perf_counter() - opened, info)
            limit = min(int(info.get("max_context") or 1 << 30), self.max_context or 1 << 30)
            if len(context) >= limit:
                raise BackendError(
                    f"{self.name}: prompt of {len(context)} tokens does not fit the {limit}-token context",
                    status=400,
                    backend=self.name,
                )
            self.stats.sessions += 1
            session_line = self._tell_session("opened", worker, info, len(context), answer.request.request_id)
            async for event in self._generate(link, st, answer, limit, slot=slot):
                yield event
        except TimeoutError:
            raise BackendError(f"{self.name}: the worker did not answer in time", 504, self.name) from None
        except (BackendError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # a bug or a torch failure on the device: a backend failure, not the worker's
            log.exception("%s: generation failed", self.name)
            raise BackendError(f"{self.name}: HAT generation failed: {e}", 500, self.name) from e
        finally:
            worker.sessions -= 1
            if slot is not None:
                self.station.leave(slot)  # type: ignore[union-attr]
            await link.close()
            if session_line is not None:
                self._tell_session("closed", worker, link.info, len(context), session_line["request_id"], session_line)
            self.stats.status_updates += link.status_updates
            self.stats.bytes_up += transport.bytes_up
            self.stats.bytes_down += transport.bytes_down

    def draft_shape(self) -> str:
        o = self.options
        if self.tree is not None:
            return f"tree of {len(self.tree.parents)} nodes"
        return f"chain, {o.draft_length} rule, max {o.max_draft}"

    def _tell_session(
        self, kind: str, worker: PoolWorker, info: dict, context: int, request_id: str, opened: dict | None = None
    ) -> dict | None:
        """The session's line for `on_session`: a session id of this backend's own, the request it serves, the
        worker, the worker's μ, the draft shape; at close also the rounds and tokens it ran (this backend's counters'
        difference: other concurrent sessions' rounds count too when streams share the backend)."""
        stats = self.stats
        line = {
            "session": opened["session"] if opened else f"{self.name}-{stats.sessions}",
            "request_id": request_id,
            "worker": worker.address.http_base,
            "mu": float(info.get("mu") or 0.0),
            "draft_shape": self.draft_shape(),
            "m": self.options.m,
            "context_tokens": context,
            "_rounds": stats.rounds,
            "_round_tokens": stats.round_tokens,
        }
        if self.on_session is None:
            return line
        public = {k: v for k, v in line.items() if not k.startswith("_")}
        if opened is not None:
            rounds = stats.rounds - opened["_rounds"]
            public["rounds"] = rounds
            tokens = stats.round_tokens - opened["_round_tokens"]
            public["accept_length"] = round(tokens / rounds, 3) if rounds else None
        try:
            self.on_session(kind, public)
        except Exception:
            log.exception("%s: session listener failed", self.name)
        return line

    async def _generate(
        self,
        link: FrameSession,
        st: DraftState,
        answer: _Answer,
        limit: int,
        *,
        slot: StreamSlot | None = None,
    ) -> AsyncIterator[TokenEvent]:
        req, mask = answer.request, answer.mask
        context = answer.context + answer.emitted
        if answer.emitter is None:  # the answer's first session
            max_tokens = min(req.max_tokens, limit - len(context))
            if max_tokens <= 0:
                yield TokenEvent(text="", finish_reason="length")
                return
            answer.generator = seeded_generator(req.temperature, req.seed)
            answer.emitter = TokenEmitter(
                IncrementalDetokenizer(self.detokenize, context), self.eos_ids.__contains__, max_tokens, mask
            )
            # Penalties / logit_bias: applied to the head's logits before every pick, also in verification (each
            # verified position with the drafts before it counted), so speculative decoding stays on and exact.
            answer.adjust = LogitAdjuster(req, self.answer_prefix_ids(req)) if req.adjusts_logits else None
            answer.sampling = Sampling.of(req, answer.generator, answer.adjust, mask)
        emitter, adjust, sampling, generator = answer.emitter, answer.adjust, answer.sampling, answer.generator

        logits = await self._prefill(link, st, context, sampling.argmax_only, slot)
        scores = logits if adjust is None else adjust.apply(logits)
        if mask is not None:  # after penalties / logit_bias: nothing may bring back a token the grammar forbids
            scores = await self.thread.run(mask.apply, scores)
        pending = [
            await self.thread.run(sample_next, scores, req.temperature, req.top_p, generator, req.top_k, req.min_p)
        ]
        pending_lps = None
        if req.logprobs is not None:
            pending_lps = [await self.thread.run(token_logprob, logits, pending[0], req.logprobs, self.token_bytes)]
        position = len(context)  # where the last pending token goes
        while True:
            for j, token in enumerate(pending):
                lps = None if pending_lps is None else (pending_lps[j],)
                if adjust is not None:
                    adjust.accept(token)
                self.tokens_generated += 1
                answer.emitted.append(token)
                event = emitter.emit(token, lps)
                yield event
                if event.finish_reason is not None:
                    return
            last = pending[-1]
            cap = min(self._draft_cap(link), emitter.remaining - 1, limit - position - 1) if self.speculative else 0
            pending, pending_lps = await self._round(
                link,
                st,
                last,
                position,
                max(cap, 0),
                sampling,
                slot=slot,
                room=limit - position,
                context=answer.context + answer.emitted if self.options.lookup_tokens else None,
            )
            position += len(pending)

    # --- prefill --------------------------------------------------------------------------------

    async def _prefill(
        self,
        link: FrameSession,
        st: DraftState,
        context: list[int],
        argmax_only: bool,
        slot: StreamSlot | None = None,
    ) -> torch.Tensor:
        """Chunked, pipelined prefill (clients/hat/prefill_plan.py); returns the logits at the last context position
        (`argmax_only`: from DeviceHalf.argmax_rows, exact for the argmax: nothing else in them means anything)."""
        assert self.prefill_planner is not None
        t0 = time.perf_counter()
        plan = self.prefill_planner.plan(len(context), link.info, self.link_model.beta_up)
        bounds = plan.bounds
        if plan.worker_tau is not None:
            self.stats.last_worker_tau = plan.worker_tau
        seqs, sent_at, sizes = [], [], []
        for start, end in bounds:
            if slot is not None:  # batched with other streams' pending chunks
                shallow = await self.station.prefill(slot, st, context[start:end], start)  # type: ignore[union-attr]
            else:
                shallow = await self.thread.run(self.drafter.prefill, st, context[start:end], start)
            seqs.append(link.send_tensor(wire.Kind.PREFILL_CHUNK, shallow, start))
            sent_at.append(time.perf_counter())
            sizes.append(end - start)
        last = None
        for i, seq in enumerate(seqs):
            last = await link.reply(seq, wire.Kind.DEEP_STATE)
            if i == 0:
                self.link_model.observe_upload(sizes[0], time.perf_counter() - sent_at[0], link.info)
        assert last is not None
        if last.arg != len(context) - 1:
            raise BackendError(f"{self.name}: worker returned position {last.arg}, expected {len(context) - 1}", 502)
        deep = last.tensor().reshape(-1, self.hidden_size)
        logits = await self.thread.run(self._head_last, deep, argmax_only)
        st = self.stats
        st.prefill_tokens += len(context)
        st.prefill_chunks += len(bounds)
        st.prefill_seconds += time.perf_counter() - t0
        st.last_chunk_size = bounds[0][1] - bounds[0][0]
        st.last_chunks = [end - start for start, end in bounds]
        return logits

    def _head_last(self, deep: torch.Tensor, argmax_only: bool) -> torch.Tensor:
        assert self.half is not None
        with torch.inference_mode():
            return self.half.verification_head(argmax_only)(deep[-1:])[0]

    # --- decode rounds (clients/hat/rounds.py) --------------------------------------------------

    def _draft_cap(self, link: FrameSession) -> int:
        """This round's draft cap: max_draft ("eta"), or l* from Eq. 7 over the modelled round time."""
        cap = self.controller.plan(self.link_model.state(link.info))
        self.stats.draft_cap_sum += cap
        return cap

    async def _round(
        self,
        link: FrameSession,
        st: DraftState,
        token: int,
        position: int,
        cap: int,
        sampling: Sampling,
        *,
        slot: StreamSlot | None = None,
        room: int | None = None,
        context: list[int] | None = None,
    ) -> tuple[list[int], list | None]:
        """One speculative round (DecodeRounds.run): the new tokens and, when asked for, their logprobs."""
        assert self.rounds is not None
        return await self.rounds.run(
            link, st, token, position, cap, sampling, self.stats, slot=slot, room=room, context=context
        )
