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

4. Parallel drafting (HAT §3.5, Eq. 6; opt-in, `parallel_drafting=True`): while the worker verifies, the device
   drafts ahead from the top-k alternatives to the last draft token (one batched step per candidate set, as many
   steps as Eq. 6 says fit the round trip and never past the reply's arrival). If the verified correction is
   one of the candidates, the next round starts with that branch's drafts and caches. It changes no output
   (drafts are only proposals); with sampling, it makes seeded runs timing-dependent (not reproducible run to
   run), while keeping the output distribution exact.
5. Grammars (tool_choice / response_format: GenerationRequest.grammar, clients/grammar.py). The head's logits are
   masked before every pick, after penalties / logit_bias; the grammar is advanced over the delivered prefix when
   it covers it; the answer ends ("stop") once the grammar is complete, and EOS can only be picked where the
   grammar allows it. Speculative decoding stays on and exact: the draft model picks each draft from its masked
   logits (the matcher walked over the drafts tentatively, then rolled back), and verification masks position j
   with the matcher advanced over drafts 0..j-1, so greedy output equals plain masked U-shape decoding token for
   token and sampling keeps the masked distribution. Parallel drafting is off under a grammar (each branch would
   need its own grammar state). Logprobs come from the head's raw logits. Requests without a grammar do no mask
   work at all.
6. Token trees (`tree_width` >= 3; clients/hat/tree.py, policies/trees.py): a greedy round drafts a tree of w
   nodes over the draft head's top-k, one batched step per depth, sends its structure (TREE: parent indices, no
   tokens) before its DRAFT, and walks the verified tree from the root with the head on one row at a time; both
   caches then keep exactly the accepted path (KEEP to the worker). Output is still greedy U-shape's. Rounds
   that sample, adjust logits, follow a grammar or return logprobs stay chains.

Here: the backend and its schedule (prefill, rounds, verification, when to draft in parallel). Beside it:
clients/hat/drafting.py (the draft model), clients/hat/session.py (a generation's frames),
clients/hat/transport.py (WebSocket for ws:// and wss:// worker URLs, POST + SSE for http:// and https://, through
the link emulator of clients/hat/link.py when a LinkProfile is given), clients/hat/options.py (settings, counters).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from clients.base import BackendError, GenerationRequest, NoPrefixCache, TokenEvent
from clients.grammar import GrammarError, HFTokenizerGrammars, TokenMask
from clients.hat import wire
from clients.hat.drafting import Branches, Draft, Drafter, DraftState
from clients.hat.options import HATOptions, HATStats
from clients.hat.profile import load_profile
from clients.hat.ragged import rows_linear
from clients.hat.session import FrameSession
from clients.hat.station import DraftingStation, StreamSlot
from clients.hat.transport import LinkOptions, WorkerAddress
from clients.hat.tree import TreeDraft, draft_tree, keep_path, walk_greedy
from clients.hf_model import HFTokenizerMixin, open_token_source
from clients.sampling import (
    LogitAdjuster,
    probabilities,
    sample_next,
    seeded_generator,
    speculative_sample,
    token_logprob,
)
from clients.stops import StopMatcher
from clients.torch_local import IncrementalDetokenizer
from policies.chunking import chunk_bounds, chunk_size, split_prompt
from policies.drafting import DraftLengthController, DraftStopRule, LinkState, parallel_draft_steps
from policies.estimate import MovingAverage
from policies.jupiter import ChunkCost, PlanCache, fit_chunk_cost, plan_device_prefill
from policies.trees import DraftTree, from_paths, greedy_tree, prior_probabilities

log = logging.getLogger(__name__)


# --- the backend ------------------------------------------------------------------------------------


def worker_prefill_cost(info: dict[str, Any]) -> ChunkCost | None:
    """The worker's prefill cost from its OPEN reply as one stage of the device's plan, or None when it sent none or
    sent something malformed (then g stands in). `prefill_tau` is [a, b, c, d] per worker stage (seconds, finite,
    >= 0). A staged worker's stages become one stage here with τ their sum: a conservative model (the stages overlap
    one chunk's work with the next one's), chosen because planning P + 2 machines exactly per request would cost far
    more than it could save on the request path."""
    raw = info.get("prefill_tau")
    if raw is None:
        return None
    ok = isinstance(raw, list) and raw and all(isinstance(row, list) and len(row) == 4 for row in raw)
    if ok:
        values = [v for row in raw for v in row]
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)
    if not ok:
        log.warning("worker sent a malformed prefill_tau (%.200r); planning its chunks with g", raw)
        return None
    a, b, c, d = (float(sum(row[i] for row in raw)) for i in range(4))
    return ChunkCost(a, b, c, d)


class HATBackend(NoPrefixCache, HFTokenizerMixin):
    """Backend protocol (clients.base) over a HAT worker: the device half of a U-shaped split with drafting.

    Set up by `options` (HATOptions); `model` + `tokenizer` stand in for options.gguf_path with an already-loaded
    model, which is then shared rather than trimmed to the device's layers.
    """

    can_continue = True
    locality = "split"
    structured_output = "grammar"  # clients/grammar.py: the head's logits masked before every pick, drafts included
    accepts_token_ids = False  # True when the worker's model shares the device's vocabulary (set by the gateway)

    def __init__(self, options: HATOptions, *, model: Any = None, tokenizer: Any = None) -> None:
        if options.gguf_path is None and (model is None or tokenizer is None):
            raise ValueError("HATBackend needs gguf_path or both model and tokenizer")
        if options.drafting not in ("batched", "solo"):
            raise ValueError(f"drafting must be 'batched' or 'solo', got {options.drafting!r}")
        o = self.options = options
        self.address = WorkerAddress.parse(o.worker_url)
        self.transport = self.address.kind
        self.name = o.name
        self.model_id = o.model_id or (Path(o.gguf_path).stem if o.gguf_path is not None else o.name)
        self.model_path = Path(o.gguf_path) if o.gguf_path is not None else None
        self.wire_dtype = wire.dtype_by_name(o.wire_dtype)
        self.link_options = LinkOptions(
            name=o.name,
            auth_token=o.auth_token,
            connect_timeout=o.connect_timeout,
            round_timeout=o.round_timeout,
            max_frame_bytes=o.max_frame_bytes,
            wire_dtype=self.wire_dtype,
            profile=o.link,
            noise=o.noise,  # privacy noise on the sent hidden states (clients/hat/noise.py; FrameSession applies it)
            noise_seed=o.noise_seed,
        )
        self._draft_ids: torch.Tensor | None = None  # reduced draft vocabulary (sorted token ids), if any
        self._draft_weight: torch.Tensor | None = None  # the LM head's rows for them
        self.controller = DraftLengthController(mode=o.draft_length, max_len=o.max_draft, eta=o.eta)
        # The token tree greedy rounds verify (None: chains). Shaped from the prior until a profile gives measured
        # rank sequences (policies/trees.py).
        self.tree: DraftTree | None = None
        if o.tree_paths:
            self.tree = from_paths(o.tree_paths)
        elif o.tree_width >= 3:
            self.tree = greedy_tree(o.tree_width, prior_probabilities(min(o.tree_width - 1, o.max_draft)))
        # "eq7" drafts exactly l*: the confidence stop is off (eta 0), only the per-round cap stops a draft.
        rule_eta = 0.0 if o.draft_length == "eq7" else o.eta
        self.rule = DraftStopRule(eta=rule_eta, max_draft=o.max_draft, include_low_confidence=o.include_low_confidence)
        self.pd_gamma = MovingAverage()  # seconds per batched parallel-drafting step
        link = o.link
        self.beta_up = MovingAverage(value=(link.up_bandwidth if link and link.up_bandwidth else o.beta_up))
        self.beta_down = MovingAverage(value=(link.down_bandwidth if link and link.down_bandwidth else o.beta_down))
        self.gamma = MovingAverage()  # seconds per draft step (HAT's gamma_i)
        if o.arca and o.profile is None:
            raise ValueError("arca chooses the verification tree from a profile: set profile (tandem profile) too")
        if o.profile is not None:  # measured parts instead of warm-up priors (clients/hat/profile.py)
            profile = load_profile(o.profile)
            profile.check_model({self.model_id, self.model_path.name if self.model_path else ""}, o.m)
            self.controller.seed(profile.measured_parts())
            if o.arca:  # ARCA: the tree (or the chain) with the most modelled tokens per second on this hardware
                paths = profile.arca_tree()
                self.tree = from_paths(paths) if paths else None
            self.beta_up = MovingAverage(value=profile.up_bytes_per_s or self.beta_up.value)
            self.beta_down = MovingAverage(value=profile.down_bytes_per_s or self.beta_down.value)
        self._owns_model = model is None
        self.model = model
        self.tokenizer = tokenizer
        self._tok_lock = threading.Lock()
        self._grammars: HFTokenizerGrammars | None = None  # built at load, its tokenizer at the first grammar
        self._executor: ThreadPoolExecutor | None = None
        self._ready = False
        self._worker_ok: tuple[float, bool] = (0.0, False)
        self.eos_ids: frozenset[int] = frozenset()
        self.max_context: int | None = None
        self.hidden_size = self.num_layers = self.vocab_size = 0
        self.adapter: Any = None
        self._input: Any = None
        self.drafter: Any = None
        self._output: Any = None
        self.station: DraftingStation | None = None  # drafting = "batched": concurrent streams' device work batched
        self._device_tau: ChunkCost | None = None  # chunking = "dp": this device's fitted prefill step time
        self._plans = PlanCache(64)
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
        o = self.options
        src = open_token_source(
            o.gguf_path, o.cache_root, model=self.model, tokenizer=self.tokenizer, num_threads=o.num_threads
        )
        self.model, self.tokenizer = src.model, src.tokenizer
        model = src.model
        split = split_model(model, o.m)
        self.adapter = Adapter.load(model, o.adapter_path) if o.adapter_path else Adapter(model, o.m)
        if self.adapter.m != o.m:
            raise ValueError(f"adapter {o.adapter_path} was trained for m={self.adapter.m}, not m={o.m}")
        self.adapter.eval()
        candidates = max(1, o.parallel_candidates)
        self.drafter = Drafter(split.input, self.adapter, self._draft_logits, self.rule, candidates)
        self._input, self._output = split.input, split.output
        self.hidden_size, self.num_layers, self.vocab_size = split.hidden_size, split.num_layers, split.vocab_size
        if self._owns_model:  # the device never runs the middle layers: drop them (most of the model's weights)
            model.model.layers = nn.ModuleList(list(model.model.layers)[: o.m])
        del split
        self.eos_ids, self.max_context = src.eos_ids, src.max_context
        self._grammars = HFTokenizerGrammars(self.tokenizer, self.eos_ids, self._tok_lock)
        if o.draft_vocab_path:
            self._load_draft_vocab(o.draft_vocab_path)
        if o.drafting == "batched":
            self.station = DraftingStation(self)
        if o.chunking == "dp":
            self._device_tau = self._fit_device_tau()
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
        if self.station is not None:
            await self.station.close()
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
                ok = (await client.get(self.address.http_base + "/health/ready")).status_code == 200
        except httpx.HTTPError:
            ok = False
        self._worker_ok = (time.monotonic(), ok)
        return ok

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            raise BackendError(f"{self.name}: backend closed", status=503, backend=self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # --- generation -----------------------------------------------------------------------------

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self._ready:
            raise BackendError(f"{self.name}: model not loaded", status=503, backend=self.name)
        context = self.context_ids(request)
        mask = await self._grammar_mask(request) if request.grammar is not None else None
        self.active += 1
        transport = self.address.transport(self.link_options)
        link = FrameSession(transport, self.link_options, self.hidden_size)
        st = self.drafter.new_state()
        slot = self.station.join(len(context)) if self.station is not None else None
        try:
            info = await link.open(self.num_layers, self.options.m, self.model_id)
            limit = min(int(info.get("max_context") or 1 << 30), self.max_context or 1 << 30)
            if len(context) >= limit:
                raise BackendError(
                    f"{self.name}: prompt of {len(context)} tokens does not fit the {limit}-token context",
                    status=400,
                    backend=self.name,
                )
            self.stats.sessions += 1
            async for event in self._generate(link, st, request, context, limit, mask, slot=slot):
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
            if slot is not None:
                self.station.leave(slot)  # type: ignore[union-attr]
            await link.close()
            self.stats.status_updates += link.status_updates
            self.stats.bytes_up += transport.bytes_up
            self.stats.bytes_down += transport.bytes_down

    async def _grammar_mask(self, request: GenerationRequest) -> TokenMask:
        """The request's grammar over the device's vocabulary, advanced over the delivered prefix when the grammar
        covers it (a 400 when it does not compile or the prefix does not fit it)."""
        assert self._grammars is not None and request.grammar is not None

        def build() -> TokenMask:
            mask = self._grammars.mask(request.grammar)  # the first builds the vocabulary (~2 s)
            if request.grammar_covers_prefix:
                mask.advance(self.answer_prefix_ids(request))
            return mask

        try:
            return await asyncio.to_thread(build)
        except GrammarError as exc:
            raise BackendError(f"grammar: {exc}", status=400, backend=self.name) from exc

    async def _generate(
        self,
        link: FrameSession,
        st: DraftState,
        req: GenerationRequest,
        context: list[int],
        limit: int,
        mask: TokenMask | None = None,
        *,
        slot: StreamSlot | None = None,
    ) -> AsyncIterator[TokenEvent]:
        max_tokens = min(req.max_tokens, limit - len(context))
        if max_tokens <= 0:
            yield TokenEvent(text="", finish_reason="length")
            return
        generator = seeded_generator(req.temperature, req.seed)
        detok = IncrementalDetokenizer(self.detokenize, context)
        stops = StopMatcher(req.stop)
        emitted = 0
        # Penalties / logit_bias: applied to the head's logits before every pick, also in verification (each
        # verified position with the drafts before it counted), so speculative decoding stays on and exact.
        adjust = LogitAdjuster(req, self.answer_prefix_ids(req)) if req.adjusts_logits else None

        logits = await self._prefill(link, st, context, slot)
        scores = logits if adjust is None else adjust.apply(logits)
        if mask is not None:  # after penalties / logit_bias: nothing may bring back a token the grammar forbids
            scores = await self._run(mask.apply, scores)
        pending = [await self._run(sample_next, scores, req.temperature, req.top_p, generator)]
        pending_lps = None
        if req.logprobs is not None:
            pending_lps = [await self._run(token_logprob, logits, pending[0], req.logprobs, self.token_bytes)]
        position = len(context)  # where the last pending token goes
        while True:
            for j, token in enumerate(pending):
                lps = None if pending_lps is None else (pending_lps[j],)
                if adjust is not None:
                    adjust.accept(token)
                emitted += 1
                self.tokens_generated += 1
                if token in self.eos_ids:
                    tail, hit = stops.feed(detok.flush())
                    yield TokenEvent(text=tail if hit else tail + stops.flush(), finish_reason="stop")
                    return
                complete = False
                if mask is not None:
                    mask.accept(token)
                    complete = mask.finished  # the grammar allows nothing more: the answer ends with this token
                text, stopped = stops.feed(detok.push(token))
                if stopped:
                    yield TokenEvent(text=text, token_id=token, finish_reason="stop", logprobs=lps)
                    return
                if emitted >= max_tokens or complete:
                    tail, hit = stops.feed(detok.flush())
                    text += tail if hit else tail + stops.flush()
                    finish = "stop" if hit or complete else "length"
                    yield TokenEvent(text=text, token_id=token, finish_reason=finish, logprobs=lps)
                    return
                yield TokenEvent(text=text, token_id=token, logprobs=lps)
            last = pending[-1]
            cap = (
                min(self._draft_cap(link), max_tokens - emitted - 1, limit - position - 1)
                if self.options.speculative
                else 0
            )
            pending, pending_lps = await self._round(
                link, st, last, position, max(cap, 0), req, generator, adjust, mask, slot=slot, room=limit - position
            )
            position += len(pending)

    # --- prefill --------------------------------------------------------------------------------

    def _chunk(self, length: int, info: dict[str, Any]) -> int:
        """Prefill chunk size: fixed, or Eq. 3; never more than fits one of the worker's frames."""
        token_bytes = self._token_bytes()
        fits = self._frame_tokens(info)
        if self.options.chunk_size:
            return max(1, min(self.options.chunk_size, fits))
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        x = chunk_size(
            token_bytes=token_bytes,
            beta_up=self.beta_up.get(10e6),
            g=(slope, intercept),
            mu=float(info.get("mu", 0.0)),
            pipeline=int(info.get("pipeline", 1)),
            min_chunk=self.options.min_chunk,
            max_chunk=self.options.max_chunk,
        )
        return max(1, min(x, length, fits))

    def _frame_tokens(self, info: dict[str, Any]) -> int:
        """Most positions one of the worker's frames can carry."""
        return max(1, int(info.get("max_frame_bytes") or self.options.max_frame_bytes) // self._token_bytes())

    def _prefill_bounds(self, length: int, info: dict[str, Any]) -> list[tuple[int, int]]:
        """The prompt's chunks: equal chunks of Eq. 3's size (or the fixed chunk_size), or with `chunking = "dp"`
        Jupiter's sequence partition over the device → link → worker pipeline (policies/jupiter.py): the device's
        own fitted τ(x | y), the upload at the measured bandwidth, and the worker's prefill τ(x | y) from its OPEN
        reply (`prefill_tau`); a worker that sends none (an older one, or one that has not fitted it yet) is
        modelled by its g as a context-free τ."""
        if self.options.chunking != "dp" or self.options.chunk_size or self._device_tau is None or length < 2:
            return chunk_bounds(split_prompt(length, self._chunk(length, info)))
        worker = worker_prefill_cost(info)
        if worker is None:
            slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
            worker = ChunkCost(a=max(intercept, 0.0), b=max(slope, 0.0))
        self.stats.last_worker_tau = worker
        plan = plan_device_prefill(
            length,
            self._device_tau,
            worker,
            token_bytes=self._token_bytes(),
            beta_up=self.beta_up.get(10e6),
            min_len=min(self.options.min_chunk, length),
            granularity=min(16, length),
            max_len=self._frame_tokens(info),
            cache=self._plans,
        )
        return plan.bounds

    def _fit_device_tau(self) -> ChunkCost:
        """τ(x | y) of this device's prefill step (input submodel + adapter): timed at load on a small grid."""
        points = []
        with torch.inference_mode():
            for y in (0, 128):
                for x in (16, 64, 128):
                    st = self.drafter.new_state()
                    if y:
                        self.drafter.prefill(st, [0] * y, 0)
                    samples = []
                    for _ in range(2):
                        t0 = time.perf_counter()
                        self.drafter.prefill(st, [0] * x, y)
                        samples.append(time.perf_counter() - t0)
                        st.crop(y)
                    points.append((x, y, min(samples)))
        return fit_chunk_cost(points)

    async def _prefill(
        self, link: FrameSession, st: DraftState, context: list[int], slot: StreamSlot | None = None
    ) -> torch.Tensor:
        """Chunked, pipelined prefill; returns the logits at the last context position."""
        t0 = time.perf_counter()
        bounds = self._prefill_bounds(len(context), link.info)
        seqs, sent_at, sizes = [], [], []
        for start, end in bounds:
            if slot is not None:  # batched with other streams' pending chunks
                shallow = await self.station.prefill(slot, st, context[start:end], start)  # type: ignore[union-attr]
            else:
                shallow = await self._run(self.drafter.prefill, st, context[start:end], start)
            seqs.append(link.send_tensor(wire.Kind.PREFILL_CHUNK, shallow, start))
            sent_at.append(time.perf_counter())
            sizes.append(end - start)
        last = None
        for i, seq in enumerate(seqs):
            last = await link.reply(seq, wire.Kind.DEEP_STATE)
            if i == 0:
                self._observe_upload(sizes[0], time.perf_counter() - sent_at[0], link.info)
        assert last is not None
        if last.arg != len(context) - 1:
            raise BackendError(f"{self.name}: worker returned position {last.arg}, expected {len(context) - 1}", 502)
        deep = last.tensor().reshape(-1, self.hidden_size)
        logits = await self._run(self._head_last, deep)
        st = self.stats
        st.prefill_tokens += len(context)
        st.prefill_chunks += len(bounds)
        st.prefill_seconds += time.perf_counter() - t0
        st.last_chunk_size = bounds[0][1] - bounds[0][0]
        st.last_chunks = [end - start for start, end in bounds]
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

    def _head_last(self, deep: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self._output(deep[-1:])[0].float()

    # --- decode rounds --------------------------------------------------------------------------

    def _link_state(self, info: dict[str, Any]) -> LinkState:
        """The round-time model's outside inputs: bandwidth estimates and the worker's latest mu and g."""
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        return LinkState(
            token_bytes=self._token_bytes(),
            beta_up=self.beta_up.get(10e6),
            beta_down=self.beta_down.get(15e6),
            mu=float(info.get("mu", 0.0)),
            g=(slope, intercept),
        )

    def _draft_cap(self, link: FrameSession) -> int:
        """This round's draft cap: max_draft ("eta"), or l* from Eq. 7 over the modelled round time."""
        cap = self.controller.plan(self._link_state(link.info))
        self.stats.draft_cap_sum += cap
        return cap

    async def _round(
        self,
        link: FrameSession,
        st: DraftState,
        token: int,
        position: int,
        cap: int,
        req: GenerationRequest,
        gen: torch.Generator | None,
        adjust: LogitAdjuster | None = None,
        mask: TokenMask | None = None,
        *,
        slot: StreamSlot | None = None,
        room: int | None = None,
    ) -> tuple[list[int], list | None]:
        """One speculative round from `token` at `position`; returns the new tokens (accepted drafts + 1) and,
        when the request asked for them, their logprobs (from the head's logits at each token's position).
        `room`: positions the context has left from `position` (a tree needs one per node). Tree rounds run on the
        model thread by themselves, not through the drafting station."""
        tree = self._round_tree(cap, room, req, adjust, mask) if link.info.get("trees") else None
        if tree is not None and not (st.prepared is not None and st.prepared_at == (token, position)):
            return await self._tree_round(link, st, token, position, tree), None
        t0 = time.perf_counter()
        temperature, top_p = req.temperature, req.top_p
        prepared = st.prepared is not None and st.prepared_at == (token, position)
        if prepared:
            draft = await self._run(self.drafter.take_prepared, st, position, cap)
            self.stats.parallel_hits += 1
        else:
            if st.prepared is not None:  # stale branch (cannot happen unless the caller skipped a round): drop it
                raise BackendError(f"{self.name}: internal error: unused parallel draft", 500, self.name)
            draft = await (
                self.station.draft(slot, st, token, position, cap, temperature, top_p, gen, mask)
                if slot is not None and self.station is not None
                else self._run(self.drafter.draft, st, token, position, cap, temperature, top_p, gen, mask)
            )
        st.prepared = st.prepared_at = None
        t1 = time.perf_counter()
        k = len(draft.tokens)
        seq = link.send_tensor(wire.Kind.DRAFT, draft.shallow, position)
        parallel: asyncio.Task[Branches | None] | None = None
        stop = threading.Event()
        # Parallel drafting: not under a grammar (each branch would need its own grammar state), and at the station only
        # while this is its one stream (with more, the device's waiting time goes to the other streams' work).
        alone = slot is None or self.station is None or self.station.alone(slot)
        if self.options.parallel_drafting and k >= 1 and mask is None and alone:
            timing = self._pd_window(k, link.info)
            parallel = asyncio.create_task(self._parallel(st, draft, position, temperature, top_p, gen, stop, timing))
        try:
            frame = await link.reply(seq, wire.Kind.VERIFY_RESULT)
        finally:
            stop.set()  # parallel drafting never delays verification by more than one step
        t2 = time.perf_counter()
        if slot is not None and self.station is not None:
            self.station.observe_wait(slot, t2 - t1)
        branches = await parallel if parallel is not None else None
        deep = frame.tensor().reshape(-1, self.hidden_size)
        if frame.arg != position or deep.shape[0] != k + 1:
            raise BackendError(
                f"{self.name}: worker verified {deep.shape[0]} positions from {frame.arg}, "
                f"sent {k + 1} from {position}",
                502,
                self.name,
            )
        t_verify = time.perf_counter()
        verify_args = (st, deep, draft, position, temperature, top_p, gen, adjust, req.logprobs, mask)
        if slot is not None and self.station is not None:  # the head's rows batched with other streams'
            new, accepted, lps = await self.station.verify(slot, *verify_args)
        else:
            new, accepted, lps = await self._run(self._verify, *verify_args)
        t_head = time.perf_counter() - t_verify
        eta = self.options.eta
        self.controller.observe(
            drafted=k,
            accepted=accepted,
            confident=[float(d[t]) >= eta for t, d in zip(draft.tokens, draft.dists, strict=True)],
            draft_s=None if prepared else t1 - t0,
            wait_s=t2 - t1,
            head_s=t_head,
            link=self._link_state(link.info),
        )
        if accepted < k:
            link.send_control(wire.Kind.ROLLBACK, position + accepted + 1)
        if branches is not None and accepted == k - 1 and new[-1] in branches.candidates and branches.shallows:
            await self._run(self.drafter.adopt, st, branches, branches.candidates.index(new[-1]))
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
        return new, lps

    # --- token trees ------------------------------------------------------------------------------

    def _round_tree(
        self,
        cap: int,
        room: int | None,
        req: GenerationRequest,
        adjust: LogitAdjuster | None,
        mask: TokenMask | None,
    ) -> DraftTree | None:
        """The tree this round verifies, or None for a chain: trees are for plain greedy rounds whose cap allows the
        tree's depth and whose context has room for all its nodes at once."""
        tree = self.tree
        if tree is None or req.temperature > 0 or adjust is not None or mask is not None or req.logprobs is not None:
            return None
        if cap < tree.depth or (room is not None and tree.width > room):
            return None
        return tree

    async def _tree_round(
        self, link: FrameSession, st: DraftState, token: int, position: int, tree: DraftTree
    ) -> list[int]:
        """One greedy round over a token tree (clients/hat/tree.py); returns the accepted drafts + the next token."""
        t0 = time.perf_counter()
        draft = await self._run(draft_tree, self.drafter, st, token, position, tree)
        t1 = time.perf_counter()
        link.send_indices(wire.Kind.TREE, list(tree.parents), position)
        seq = link.send_tensor(wire.Kind.DRAFT, draft.shallow, position)
        frame = await link.reply(seq, wire.Kind.VERIFY_RESULT)
        t2 = time.perf_counter()
        deep = frame.tensor().reshape(-1, self.hidden_size)
        if frame.arg != position or deep.shape[0] != tree.width:
            raise BackendError(
                f"{self.name}: worker verified {deep.shape[0]} positions from {frame.arg}, "
                f"sent a tree of {tree.width} from {position}",
                502,
                self.name,
            )
        new, path = await self._run(self._walk_tree, st, deep, draft, position)
        link.send_indices(wire.Kind.KEEP, path, position)
        t3 = time.perf_counter()
        s = self.stats
        s.rounds += 1
        s.tree_rounds += 1
        s.drafted += tree.width - 1
        s.accepted += len(path) - 1
        s.round_tokens += len(new)
        s.draft_seconds += t1 - t0
        s.wait_seconds += t2 - t1
        s.verify_seconds += t3 - t2
        s.round_seconds += t3 - t0
        return new

    def _walk_tree(
        self, st: DraftState, deep: torch.Tensor, draft: TreeDraft, position: int
    ) -> tuple[list[int], list[int]]:
        with torch.inference_mode():
            new, path = walk_greedy(lambda rows: self._head_rows(deep[rows]), draft)
        keep_path(st, position, path)
        return new, path

    def _draft_logits(self, feats: torch.Tensor, position: int | list[int]) -> torch.Tensor:
        """Draft head: features [rows, hidden] of tokens fed at `position` (one for all rows, or one per row) ->
        logits [rows, vocab] for the next position.

        With a reduced draft vocabulary only its rows of the head are computed; the other logits are -inf. Rows go
        through ragged.rows_linear: batch-invariant (the drafting station batches streams' rows) and, for a few
        rows, faster than a plain linear."""
        if self._draft_ids is None:
            return self._head_rows(feats)
        assert self._draft_weight is not None
        normed = self._output.norm(feats.to(self._draft_weight.dtype))
        logits = torch.full((feats.shape[0], self.vocab_size), float("-inf"))
        logits[:, self._draft_ids] = rows_linear(normed, self._draft_weight).float()
        return logits

    def _head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output submodel (final norm + LM head) over rows, batch-invariant (ragged.rows_linear): float logits."""
        head = self._output.lm_head
        logits = rows_linear(self._output.norm(hidden.to(head.weight.dtype)), head.weight)
        if head.bias is not None:
            logits = logits + head.bias
        return logits.float()

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
        st: DraftState,
        draft: Draft,
        position: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | None,
        stop: threading.Event,
        timing: tuple[float, float],
    ) -> Branches | None:
        start = time.perf_counter()
        g, window = timing
        branches = await self._run(self.drafter.branch, st, draft, position)
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
            await self._run(self.drafter.step, branches, temperature, top_p, gen)
            self.pd_gamma.update(time.perf_counter() - t)
            self.stats.parallel_steps += 1
            step = self.pd_gamma.get(step)
        return branches

    def _verify(
        self,
        st: DraftState,
        deep: torch.Tensor,
        draft: Draft,
        position: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | None,
        adjust: LogitAdjuster | None = None,
        logprobs: int | None = None,
        mask: TokenMask | None = None,
        head: Callable[[int, int], torch.Tensor] | None = None,
    ) -> tuple[list[int], int, list | None]:
        """Accept drafts from the deep states: the new tokens, how many drafts were accepted, their logprobs.

        head(lo, hi): the head's raw logits for deep rows lo..hi-1 (the drafting station's, computed batched with
        other streams' rows); None = the output submodel here."""
        walked = [0, True]  # drafts the grammar has tentatively consumed; whether all so far fitted it

        def constrain(j: int, row: torch.Tensor) -> torch.Tensor:
            """Position j's logits masked by the grammar advanced over drafts 0..j-1 (as plain decoding would see
            them had it chosen those drafts). Past a draft the grammar refuses, positions are never reached
            (that draft has probability 0 in its own masked row and is rejected): left unmasked."""
            assert mask is not None
            while walked[0] < j and walked[1]:
                if mask.try_accept(draft.tokens[walked[0]]):
                    walked[0] += 1
                else:
                    walked[1] = False
            return mask.apply(row) if walked[0] == j else row

        check = None if mask is None else constrain
        if head is None:
            head = lambda lo, hi: self._output(deep[lo:hi]).float()  # noqa: E731
        try:
            return self._verify_rows(st, head, draft, position, temperature, top_p, gen, adjust, logprobs, check)
        finally:
            if mask is not None:
                mask.rollback(walked[0])  # the emitted tokens are accepted as they are delivered

    def _verify_rows(
        self,
        st: DraftState,
        head: Callable[[int, int], torch.Tensor],
        draft: Draft,
        position: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator | None,
        adjust: LogitAdjuster | None,
        logprobs: int | None,
        constrain: Callable[[int, torch.Tensor], torch.Tensor] | None,
    ) -> tuple[list[int], int, list | None]:
        with torch.inference_mode():
            k = len(draft.tokens)
            rows: list[torch.Tensor] = []
            raw: list[torch.Tensor] = []  # the head's own logits (logprobs)

            def target(i: int) -> torch.Tensor:
                # The LM head is the device's biggest cost. Run it on the first position alone: if the first draft is
                # rejected (the common case with a weak adapter) the other positions' logits are never needed.
                if i >= len(rows):
                    logits = head(len(rows), 1 if not rows else k + 1)
                    raw.extend(logits)
                    if adjust is not None:  # position j follows drafts 0..j-1: they count for its penalties
                        logits = torch.stack(
                            [adjust.apply(row, draft.tokens[:j]) for j, row in enumerate(logits, start=len(rows))]
                        )
                    if constrain is not None:  # after penalties, as in plain decoding
                        logits = torch.stack([constrain(j, row) for j, row in enumerate(logits, start=len(rows))])
                    rows.extend(logits if temperature <= 0 else probabilities(logits, temperature, top_p))
                return rows[i]

            if temperature <= 0:
                a = 0
                while a < k and draft.tokens[a] == int(target(a).argmax()):
                    a += 1
                nxt = int(target(a).argmax())
            else:
                a, nxt = speculative_sample(target, draft.dists, draft.tokens, gen)
            st.crop(position + a + 1)
            new = [*draft.tokens[:a], nxt]
            lps = None
            if logprobs is not None:
                lps = [token_logprob(raw[j], t, logprobs, self.token_bytes) for j, t in enumerate(new)]
        return new, a, lps
