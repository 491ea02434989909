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

4. Parallel drafting (HAT §3.5, Eq. 6; opt-in, `parallel_drafting=True`; clients/hat/rounds.py): while the worker
   verifies, the device drafts ahead from the top-k alternatives to the last draft token. It changes no output.
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
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from clients.base import BackendError, GenerationRequest, NoPrefixCache, TokenEvent
from clients.grammar import HFTokenizerGrammars, TokenMask
from clients.hat import wire
from clients.hat.drafting import Drafter, DraftState
from clients.hat.half import DeviceHalf
from clients.hat.link_model import LinkModel
from clients.hat.model_thread import ModelThread
from clients.hat.options import HATOptions, HATStats
from clients.hat.prefill_plan import PrefillPlanner, fit_device_tau
from clients.hat.profile import load_profile
from clients.hat.request_sampling import Sampling
from clients.hat.rounds import DecodeRounds
from clients.hat.session import FrameSession
from clients.hat.station import DraftingStation, StreamSlot
from clients.hat.transport import LinkOptions, WorkerAddress
from clients.hf_model import HFTokenizerMixin, IncrementalDetokenizer, open_token_source
from clients.sampling import LogitAdjuster, sample_next, seeded_generator, token_logprob
from clients.token_emitter import TokenEmitter
from policies.drafting import DraftLengthController, DraftStopRule
from policies.estimate import MovingAverage
from policies.trees import DraftTree, from_paths, greedy_tree, prior_probabilities

log = logging.getLogger(__name__)


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
        draft distribution is simply zero outside the subset). None = draft over the full vocabulary.
    """

    can_continue = True
    locality = "split"
    structured_output = "grammar"  # clients/grammar.py: the head's logits masked before every pick, drafts included
    accepts_token_ids = False  # True when the worker's model shares the device's vocabulary (set by the gateway)
    dialect = "tokens"

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
        self.address = WorkerAddress.parse(o.worker_url)
        self.transport = self.address.kind
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
        link = o.link
        self.link_model = LinkModel(
            up=MovingAverage(value=(link.up_bandwidth if link and link.up_bandwidth else o.beta_up)),
            down=MovingAverage(value=(link.down_bandwidth if link and link.down_bandwidth else o.beta_down)),
        )
        if o.profile:  # measured parts instead of warm-up priors (clients/hat/profile.py)
            profile = load_profile(o.profile)
            profile.check_model({self.model_id, self.model_path.name if self.model_path else ""}, o.m)
            self.controller.seed(profile.measured_parts())
            if o.arca:  # ARCA: the tree (or the chain) with the most modelled tokens per second on this hardware
                paths = profile.arca_tree()
                self.tree = from_paths(paths) if paths else None
            self.link_model.up = MovingAverage(value=profile.up_bytes_per_s or self.link_model.up.value)
            self.link_model.down = MovingAverage(value=profile.down_bytes_per_s or self.link_model.down.value)
        self._owns_model = model is None
        self.model = model
        self.tokenizer = tokenizer
        self._tok_lock = threading.Lock()
        self._grammars: HFTokenizerGrammars | None = None  # built at load, its tokenizer at the first grammar
        self.thread = ModelThread(name)  # every torch call of the device half runs on it
        self._ready = False
        self._worker_ok: tuple[float, bool] = (0.0, False)
        self.eos_ids: frozenset[int] = frozenset()
        self.max_context: int | None = None
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
        if o.drafting == "batched":
            self.station = DraftingStation(half, self.thread, self.rule, self.token_bytes)
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

    # --- generation -----------------------------------------------------------------------------

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self._ready:
            raise BackendError(f"{self.name}: model not loaded", status=503, backend=self.name)
        context = self.context_ids(request)
        assert self._grammars is not None
        mask = await self._grammars.for_request(request, lambda: self.answer_prefix_ids(request), self.name)
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
        emitter = TokenEmitter(
            IncrementalDetokenizer(self.detokenize, context), self.eos_ids.__contains__, max_tokens, mask
        )
        # Penalties / logit_bias: applied to the head's logits before every pick, also in verification (each
        # verified position with the drafts before it counted), so speculative decoding stays on and exact.
        adjust = LogitAdjuster(req, self.answer_prefix_ids(req)) if req.adjusts_logits else None
        sampling = Sampling.of(req, generator, adjust, mask)

        logits = await self._prefill(link, st, context, slot)
        scores = logits if adjust is None else adjust.apply(logits)
        if mask is not None:  # after penalties / logit_bias: nothing may bring back a token the grammar forbids
            scores = await self.thread.run(mask.apply, scores)
        pending = [await self.thread.run(sample_next, scores, req.temperature, req.top_p, generator)]
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
                event = emitter.emit(token, lps)
                yield event
                if event.finish_reason is not None:
                    return
            last = pending[-1]
            cap = (
                min(self._draft_cap(link), emitter.remaining - 1, limit - position - 1)
                if self.options.speculative
                else 0
            )
            pending, pending_lps = await self._round(
                link, st, last, position, max(cap, 0), sampling, slot=slot, room=limit - position
            )
            position += len(pending)

    # --- prefill --------------------------------------------------------------------------------

    async def _prefill(
        self, link: FrameSession, st: DraftState, context: list[int], slot: StreamSlot | None = None
    ) -> torch.Tensor:
        """Chunked, pipelined prefill (clients/hat/prefill_plan.py); returns the logits at the last context position."""
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
        logits = await self.thread.run(self._head_last, deep)
        st = self.stats
        st.prefill_tokens += len(context)
        st.prefill_chunks += len(bounds)
        st.prefill_seconds += time.perf_counter() - t0
        st.last_chunk_size = bounds[0][1] - bounds[0][0]
        st.last_chunks = [end - start for start, end in bounds]
        return logits

    def _head_last(self, deep: torch.Tensor) -> torch.Tensor:
        assert self.half is not None
        with torch.inference_mode():
            return self.half.head(deep[-1:])[0]

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
    ) -> tuple[list[int], list | None]:
        """One speculative round (DecodeRounds.run): the new tokens and, when asked for, their logprobs."""
        assert self.rounds is not None
        return await self.rounds.run(link, st, token, position, cap, sampling, self.stats, slot=slot, room=room)
