"""The serving core's one front: everything endpoints/ asks of it (the `Serving` protocol of endpoints/serving.py).

A request's input (app/serving/requests.py) becomes a Job: its route (a pinned model, the policy, the cloud endpoint,
the privacy level), the chat template rendered with its tools and tokenised (long prompts on a worker thread), the
context checked, the grammar it must follow (app/serving/structured.py). Its answer comes from outline decoding when
the gate says so, else from the orchestrator. A request the core cannot serve raises app/serving/errors.py's types.
The gateway's composition root (app/serving/gateway.py) builds the parts and runs the start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import anyio
import numpy as np

from app.serving.cache_key import ConversationKeys
from app.serving.disco import DiscoRuntime
from app.serving.errors import InvalidRequest, NotFound, NotReady, RateLimited, Unavailable
from app.serving.events import EventBus
from app.serving.job import Job
from app.serving.ledger import Ledger
from app.serving.limits import DEVICE_ONLY, UNLIMITED, Admission, KeyLimits, rate_headers, retry_after, to_micro
from app.serving.metrics import Metrics
from app.serving.orchestrator import Orchestrator
from app.serving.outline import OutlineDecoding, OutlineRequest
from app.serving.relay import Delta
from app.serving.requests import ChatInput, CompletionInput, RequestInput
from app.serving.seam import split_trailing_whitespace
from app.serving.state import StateStore, StoreUnavailable
from app.serving.structured import Structure, add_tools_prompt, message_text, structure_of, template_messages
from app.serving.windows import check_fits, largest_window, starts_on
from clients.base import Backend, GenerationRequest
from clients.embeddings import SentenceEmbedder
from deploy.models import resolve_model
from policies.cost import TokenPrices
from policies.dispatch import declaration
from policies.outline import gate
from policies.privacy import allows, effective_level
from policies.quality import call_key

log = logging.getLogger(__name__)

# Prompts longer than this (in characters) are tokenised off the event loop (~1 ms of tokenising at most here).
_INLINE_TOKENIZE_CHARS = 16_384


@dataclass(frozen=True)
class CoreOptions:
    """The settings the core reads on every request."""

    model_name: str  # the gateway's own model name: DiSCo routes it
    default_max_tokens: int  # an answer's limit where its request names none; 0: none (the window's)
    privacy: str  # the gateway's privacy level
    decoding: str  # sequential | outline | auto, unless a request says
    # Keys the conversations' derived prompt-cache keys (app/serving/cache_key.py); None: one drawn at start-up.
    prompt_cache_secret: bytes | None = None
    max_answer_tokens: int = 0  # the gateway's cap on every answer; 0: none


class Readiness(NamedTuple):
    backends: dict[str, bool]  # each backend: can it serve now
    error: str | None  # why the start-up failed, if it did


class ServingCore:
    def __init__(
        self,
        options: CoreOptions,
        device: Backend,
        backends: Mapping[str, Backend],
        orchestrator: Orchestrator,
        ledger: Ledger,
        disco: DiscoRuntime,
        metrics: Metrics,
        embedder: SentenceEmbedder | None,
        created: int,
        state: StateStore,
        events: EventBus | None = None,
    ):
        self.options = options
        self.device = device
        self.backends = backends
        self.orchestrator = orchestrator
        self.ledger = ledger
        self.disco = disco
        self.metrics = metrics
        self.embedder = embedder
        self._embedder_lock = asyncio.Lock()
        self.created = created
        self.state = state
        self.conversation_keys = ConversationKeys(options.prompt_cache_secret)
        self.events = events if events is not None else EventBus()  # the live feed (GET /v1/events)
        # Set by the start-up (app/serving/gateway.py): requests wait for `loaded`, readiness reports the error.
        self.loaded = asyncio.Event()
        self.startup_error: str | None = None

    # -- what the endpoints ask --------------------------------------------------------------------------------------
    async def prepare(self, request: ChatInput | CompletionInput) -> Job:
        """The request's job, ready to answer: admitted by its API key's limits (app/serving/limits.py)."""
        if isinstance(request, ChatInput):
            job = await self._prepare_chat(request)
        else:
            job = await self._prepare_completion(request)
        job.quality_threshold = request.quality_threshold
        job.streamed = request.streamed
        await self._admit(request, job)
        return job

    async def count_tokens(self, request: ChatInput) -> int:
        """The prompt the request's answer would prefill, in the device model's tokens: routed, rendered and counted
        as `prepare` does, but never admitted (a count runs nothing, so it holds none of its key's limits)."""
        job = await self._prepare_chat(request)
        return job.prompt_tokens

    def answer(self, job: Job) -> AsyncIterator[Delta]:
        """The answer's deltas: by outline decoding when its gate said yes, else the orchestrator's."""
        deltas = OutlineDecoding(self).generate(job) if job.outline is not None else self.orchestrator.generate(job)
        return deltas if job.admission is None else self._settled(job, deltas)

    async def trace(self, request_id: str) -> dict | None:
        """The trace of a recent request (a request with n > 1: one trace per choice), None when there is none:
        this replica's, else the shared store's (another replica served it)."""
        traces = self.orchestrator.traces

        async def here(trace_id: str) -> dict | None:
            return traces.get(trace_id)

        for lookup in (here, self.state.trace):
            trace = await lookup(request_id)
            if trace is None and (first := await lookup(f"{request_id}-0")) is not None:
                choices = [first]
                while (t := await lookup(f"{request_id}-{len(choices)}")) is not None:
                    choices.append(t)
                trace = {"id": request_id, "choices": choices}
            if trace is not None:
                return trace
        return None

    def models(self) -> list[dict]:
        """Every model id a request may name, the embedding model's included, each with what serves it: the context
        window a prompt must fit (its endpoint's; the routed name's: the largest of the endpoints a request naming it
        may start on), the capabilities, the locality (device / split / cloud, or routed: the gateway's own name, which
        DiSCo places) and the price per token (a cloud's list price, the device's energy at λ)."""
        device_prices = self.disco.cost(self.orchestrator.cloud or self.device.name).prices("device")
        plain = (None, self.ledger.settings.policy, self.orchestrator.cloud, self.options.privacy)
        routed = starts_on(self.backends, self.device.name, *plain) or [self.device.name]
        cards: dict[str, dict] = {
            self.options.model_name: {
                **_window(largest_window(self.backends, routed)),
                "locality": "routed",
                "endpoints": list(self.backends),
                "capabilities": _capabilities(any(_takes_tools(b) for b in self.backends.values()), True),
            }
        }
        for name, backend in self.backends.items():
            prices = device_prices if backend.locality == "device" else self.disco.cost(name).prices("cloud")
            card = {
                **_window(backend.context_window),
                "locality": backend.locality,
                "endpoints": [name],
                "capabilities": _capabilities(_takes_tools(backend), backend.structured_output != "none"),
                "pricing": _pricing(prices),
            }
            for model_id in (name, backend.model_id):
                cards.setdefault(model_id, card)
        out = [{"id": model_id, **card} for model_id, card in cards.items()]
        if self.embedder is not None:
            embeddings = {"chat": False, "completions": False, "tools": False, "structured_output": False}
            out.append(
                {
                    "id": self.embedder.model_id,
                    **_window(self.embedder.max_tokens),
                    "locality": "device",
                    "endpoints": [],
                    "capabilities": {**embeddings, "logprobs": False, "embeddings": True},
                    "pricing": _pricing(TokenPrices(0.0, 0.0)),
                }
            )
        return out

    async def readiness(self) -> Readiness:
        if not self.loaded.is_set():
            return Readiness({name: False for name in self.backends}, self.startup_error)
        names = list(self.backends)
        states = await asyncio.gather(*(self.backends[n].ready() for n in names))
        return Readiness(dict(zip(names, states, strict=True)), self.startup_error)

    async def embed(self, model: str, texts: list[str]) -> tuple[np.ndarray, int]:
        """Unit-length vectors of `texts` by the embedding model `model` names, and the tokens embedded."""
        embedder = await self._embedding_model()
        if model != embedder.model_id:
            raise NotFound(
                f"The embedding model '{model}' does not exist. Available: {embedder.model_id}.",
                param="model",
                code="model_not_found",
            )
        return await embedder.embed(texts)

    async def budget_snapshot(self) -> dict:
        """The ledger's knobs and spend, the constrained side in force for the configured policy, and DiSCo's live
        state (thresholds, estimates). With a shared store, `spend` is every replica's and `spend_here` this one's;
        while the store is away, `spend` is this replica's own."""
        snapshot = self.ledger.snapshot()
        shared = await self.state.spend()
        if shared is not None:
            snapshot = {**snapshot, "spend": shared, "spend_here": snapshot["spend"]}
        return {
            **snapshot,
            "store": self.state.describe(),
            "effective_side": self.disco.side(),
            "dispatch": self.disco.describe(),
        }

    async def key_spend(self, keys: Sequence[KeyLimits]) -> list[dict]:
        """Each key's spend this period, what it has in flight and this minute's counts, by its name (never the
        key): every replica's with a shared store (this one's own while the store is away)."""
        return await self.state.key_usage(keys, time.time())

    async def update_budget(self, patch: dict) -> None:
        """PUT /v1/budget's partial update, made current on every replica sharing the store."""
        try:
            await self.state.update_budget(patch)
        except StoreUnavailable as exc:
            raise Unavailable(f"The budget was not changed: {exc}.") from None

    async def reset_budget(self) -> None:
        """DELETE /v1/budget: back to the config's settings."""
        try:
            await self.state.reset_budget()
        except StoreUnavailable as exc:
            raise Unavailable(f"The budget was not reset: {exc}.") from None

    # -- admission ---------------------------------------------------------------------------------------------------
    async def _admit(self, request: RequestInput, job: Job) -> None:
        """The job under its API key's limits, and on the device only where paid clouds may not be used now (a lost
        shared store under `on_store_loss = "closed"`, or the key at its cap with `at_cap = "device"`)."""
        if not await self.state.may_spend():
            self._device_only(job, Unavailable("The shared store is unreachable and paid clouds wait for it."))
        key = request.key_limits
        if key is None:
            return
        now = time.time()
        if not key.limited:  # nothing to admit against: only its spend is booked, when it is settled
            job.admission = Admission(job.id, key, 0, UNLIMITED, now, shared=False, choices=request.choices)
            return
        reserve = 0 if job.privacy == "device" else self._worst_case(job, key.reserve_tokens) * request.choices
        verdict, shared = await self.state.admit(key, job.id, now, to_micro(reserve))
        headers = rate_headers(key, verdict, now)
        if not verdict.admitted:
            what = {"cap": "dollar cap", "rpm": "requests per minute", "tpm": "tokens per minute"}
            limit = what.get(verdict.status, "concurrent streams")
            raise RateLimited(
                f"This API key is at its {limit} limit.",
                code="insufficient_quota" if verdict.status == "cap" else "rate_limit_exceeded",
                retry_after=retry_after(key, verdict.status, now),
                headers=headers,
            )
        admission = Admission(job.id, key, to_micro(reserve), verdict, now, shared, choices=request.choices)
        if verdict.status == DEVICE_ONLY:
            try:
                self._device_only(
                    job,
                    RateLimited(
                        "This API key is at its dollar cap, and the model it names is not on the device.",
                        code="insufficient_quota",
                        retry_after=retry_after(key, "cap", now),
                        headers=headers,
                    ),
                )
            except RateLimited:
                await self.state.settle(admission)  # nothing ran: free its hold at once
                raise
        job.admission = admission
        job.limit_headers = headers

    def _device_only(self, job: Job, refusal: Exception) -> None:
        if job.pinned is not None and job.pinned != self.device.name:
            raise refusal
        job.privacy = "device"
        job.gen = replace(job.gen, cache_key=None)

    def _worst_case(self, job: Job, ceiling: int) -> float:
        """What the job may cost at most, its output capped at the key's per-request ceiling: the device's work and
        the dearest cloud's, each over the prompt and the output (a migration target prefills both)."""
        out = min(job.gen.max_tokens, ceiling)
        context = job.prompt_tokens + out
        prices = self.ledger.settings.prices
        device = self.disco.cost_of("device", next(iter(prices)), context, out) if prices else 0.0
        clouds = [self.disco.cost_of("cloud", name, context, out) for name in prices if name in self.backends]
        return device + max(clouds, default=0.0)

    async def _settled(self, job: Job, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """The answer, its key's admission settled as it runs (`_keep_hold`) and, with the remainder, at its end with
        what the ledger booked for it (on a cancel too)."""
        keeper = asyncio.create_task(self._keep_hold(job))
        try:
            async for delta in deltas:
                yield delta
        finally:
            keeper.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(keeper, return_exceptions=True)
                await deltas.aclose()
                admission = job.admission
                if admission.add(job.cost, job.usage.total_tokens, job.id):
                    await self.state.settle(admission)

    async def _keep_hold(self, job: Job) -> None:
        """Every settle interval while the answer runs: what it did so far booked (app/serving/accounting.py) and
        settled into its key's books as a partial settlement, its hold's lease renewed. A replica that dies stops
        renewing: its holds lapse within a lease, and its books miss at most the last interval."""
        admission = job.admission
        while True:
            await asyncio.sleep(self.state.settle_seconds)
            spent_micro = tokens = 0
            try:
                spent_micro, tokens = admission.progress(job.id, *self.orchestrator.accounting.book_so_far(job))
            except Exception:  # a booking the ledger refused: the answer goes on, its hold is still renewed
                log.exception("request %s: booking what it did so far failed", job.id)
            self.state.progress(admission, spent_micro, tokens, time.time())

    def health(self) -> dict:
        """GET /health: the process serves ("ok"); "degraded" while its shared store is lost or out of step with it
        (it serves on: bookings and traces wait, budgets on its last good settings)."""
        condition = self.state.condition()
        if condition == "connected":
            return {"status": "ok"}
        return {"status": "degraded", "store": {"state": condition, "problems": self.state.describe()["problems"]}}

    def render_metrics(self) -> bytes:
        if self.state.backend != "memory":
            self.metrics.observe_store(self.state.condition(), self.state.describe())
        return self.metrics.render()

    def endpoints(self) -> list[dict]:
        """Each configured endpoint: its name, role, model and locality, and its live state (streams running, tokens
        generated; a HAT backend's counters and draft shape too), for the dashboard."""
        rows = []
        for name, backend in self.backends.items():
            row = {
                "name": name,
                "role": "device" if name == self.device.name else "cloud",
                "model": backend.model_id,
                "locality": backend.locality,
                "active": backend.active,
                "tokens_generated": backend.tokens_generated,
            }
            breaker = self.orchestrator.breakers.get(name)
            if breaker is not None:  # a cloud's: whether it cools now, and why
                row["breaker"] = breaker.describe(time.monotonic(), time.time())
            cache = getattr(backend, "prompt_cache", None)
            if cache is not None:  # the llama.cpp device's prompt cache: entries, bytes, hit rate, on disk
                row["prompt_cache"] = cache.describe()
            stats = getattr(backend, "stats", None)
            if stats is not None:  # a HAT device half
                row["hat"] = {
                    **stats.summary(),
                    "sessions": stats.sessions,
                    "draft_shape": backend.draft_shape(),
                    "workers": backend.pool.describe(),
                }
            rows.append(row)
        return rows

    # -- embeddings --------------------------------------------------------------------------------------------------
    async def _embedding_model(self) -> SentenceEmbedder:
        """The device's embedding model, loaded at its first use (most gateways never embed)."""
        if self.embedder is None:
            raise NotFound("Embeddings are not enabled on this gateway ([embeddings] enabled = false).")
        async with self._embedder_lock:
            if not self.embedder.ready:
                # Fetched and verified like every bundled model (a no-op once `make setup` has run).
                await asyncio.to_thread(resolve_model, self.embedder.model_id)
                await self.embedder.start()
        return self.embedder

    # -- preparing a job ---------------------------------------------------------------------------------------------
    def _model_ids(self) -> list[str]:
        ids = [self.options.model_name]
        for backend in self.backends.values():
            ids += [backend.name, backend.model_id]
        return list(dict.fromkeys(ids))

    def _route(self, request: RequestInput) -> tuple[str | None, str, str | None, str]:
        """(pinned backend, policy, cloud endpoint, privacy level) for a request."""
        model = request.model
        pinned = None
        if model != self.options.model_name:
            pinned = next((n for n, b in self.backends.items() if model in (n, b.model_id)), None)
            if pinned is None:
                raise NotFound(
                    f"The model '{model}' does not exist. Available: {', '.join(self._model_ids())}.",
                    param="model",
                    code="model_not_found",
                )
        chosen = request.policy or self.ledger.settings.policy
        try:
            declared = declaration(chosen)
        except ValueError as exc:
            raise InvalidRequest(f"Unknown routing policy: {exc}", param="tandem.policy") from None
        clouds = [n for n in self.backends if n != self.device.name]
        cloud = request.cloud or self.orchestrator.cloud
        if pinned is not None and pinned != self.device.name:
            cloud = pinned
        if request.cloud is not None and request.cloud not in clouds:
            raise InvalidRequest(
                f"Unknown cloud endpoint '{request.cloud}'; configured: {', '.join(clouds) or 'none'}.",
                param="tandem.cloud",
            )
        if declared.needs_cloud and cloud is None and pinned is None:
            raise InvalidRequest(
                f"Policy '{chosen}' needs a cloud backend, and none is configured.", param="tandem.policy"
            )
        requested = request.privacy
        key_privacy = request.key_privacy
        privacy = effective_level(self.options.privacy, key_privacy, requested)
        if pinned is not None and not allows(privacy, self.backends[pinned].locality):
            whose = "this request's" if requested == privacy else "this API key's" if key_privacy else "the gateway's"
            raise InvalidRequest(
                f"The model '{model}' is served by {pinned} ({self.backends[pinned].locality}), which {whose} "
                f"privacy level '{privacy}' does not allow.",
                param="tandem.privacy" if requested == privacy else "model",
            )
        return pinned, chosen, cloud, privacy

    def _forced_migration(self, request: RequestInput, route) -> int | None:
        """The request's forced migration point (`tandem.migrate_after_tokens`), refused where its answer could not
        move between the device and its cloud: a forced move silently not made would pass for one that was."""
        after = request.migrate_after_tokens
        if after is None:
            return None
        pinned, _, cloud, privacy = route
        if pinned is not None:
            why = f"the model '{request.model}' names one endpoint"
        elif cloud is None:
            why = "no cloud endpoint is configured"
        elif not allows(privacy, self.backends[cloud].locality):
            why = f"the privacy level '{privacy}' keeps it off {cloud}"
        elif not self.backends[cloud].can_continue:
            why = f"{cloud} cannot continue an answer from a prefix"
        else:
            return after
        raise InvalidRequest(
            f"migrate_after_tokens moves the answer between the device and its cloud, and here it cannot: {why}.",
            param="tandem.migrate_after_tokens",
        )

    def _require_loaded(self) -> None:
        if not self.loaded.is_set():
            detail = f" (start-up failed: {self.startup_error})" if self.startup_error else "; retry shortly"
            raise NotReady("Tandem is still loading its models" + detail)

    def _job(self, prefix: str, gen: GenerationRequest, prompt_tokens: int, route, asked: int | None) -> Job:
        """The request's job; `asked` is the limit its client named (None: none), told when the gateway's cap cut it."""
        pinned, policy, cloud, privacy = route
        check_fits(self.backends, self.device.name, route, prompt_tokens)
        job = Job(
            id=f"{prefix}{uuid.uuid4().hex[:24]}",
            gen=gen,
            prompt_tokens=prompt_tokens,
            policy=policy,
            pinned=pinned,
            cloud=cloud,
            privacy=privacy,
            limit_asked=asked is not None,
        )
        if asked is not None and asked > gen.max_tokens:
            job.max_tokens_clamped = {"asked": asked, "given": gen.max_tokens, "endpoint": "gateway"}
        return job

    async def _tokenize_prompt(self, text: str) -> tuple[int, ...]:
        """A long prompt is tokenised on a worker thread: seconds of tokenising must not hold up every other
        stream's tokens on the event loop. A short one (nearly every chat turn, mostly from the prompt cache) is
        tokenised here, where it costs less than the hop to a thread."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tuple(self.device.tokenize_prompt(text))
        return tuple(await asyncio.to_thread(self.device.tokenize_prompt, text))

    def _generation(
        self,
        request: RequestInput,
        prompt_text: str,
        prompt_ids: tuple[int, ...],
        messages=None,
        structure: Structure | None = None,
    ) -> GenerationRequest:
        if not prompt_ids:
            raise InvalidRequest(
                "The prompt is empty: send at least one token of prompt.", param="prompt", code="invalid_value"
            )
        return GenerationRequest(
            prompt_text=prompt_text,
            prompt_ids=prompt_ids,
            messages=messages,
            # As asked, within the gateway's cap: each endpoint's attempt is clamped to what its window leaves
            # (app/serving/orchestrator.py); no limit at all is the largest window's.
            max_tokens=self._answer_limit(request.max_tokens),
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            extras={**request.extras, **({"top_k": request.top_k} if request.top_k else {})},
            stop=request.stop,
            seed=request.seed,
            **(_structured_fields(structure) if structure is not None else {}),
            logprobs=request.logprobs,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(request),
        )

    def _answer_limit(self, asked: int | None) -> int:
        limit = asked or self.options.default_max_tokens or max(b.context_window for b in self.backends.values())
        cap = self.options.max_answer_tokens
        return min(limit, cap) if cap else limit

    def _logit_bias(self, request: RequestInput) -> tuple[tuple[int, float], ...]:
        pairs = request.logit_bias
        vocab = self.device.vocab_size if pairs else 0
        for tok, _ in pairs:
            if tok >= vocab:
                raise InvalidRequest(
                    f"logit_bias names token id {tok}, out of range for the device model's vocabulary of {vocab}.",
                    param="logit_bias",
                    code="invalid_value",
                )
        return pairs

    def _tag(self, text: str) -> str:
        """A tool-call tag in a grammar: the device vocabulary's own token for it where there is one."""
        special = getattr(self.device, "special_token", None)
        token = special(text) if special is not None else None
        return f"<[{token}]>" if token is not None else json.dumps(text)

    async def _prepare_chat(self, chat: ChatInput) -> Job:
        route = self._route(chat)
        self._require_loaded()
        structure = structure_of(chat, self._tag)
        messages, prefill, held = chat.messages, "", ""
        if chat.continue_final:
            if structure.grammar is not None:
                raise InvalidRequest(
                    "A continued final assistant message cannot be combined with a forced tool call or a JSON "
                    "response_format (the format would have to start where the client's text does).",
                    param="messages",
                )
            *history, final = messages
            if final["role"] != "assistant":
                raise InvalidRequest("Only an assistant message can be continued.", param="messages")
            messages = tuple(history)
            # The prompt ends where the client's text does, less its trailing whitespace (app/serving/seam.py).
            prefill, held = split_trailing_whitespace(message_text(final))
        knows_tools = getattr(self.device, "template_knows_tools", False)
        rendered = template_messages(messages, knows_tools)
        if structure.tools and knows_tools:
            prompt_text = self.device.render_chat(rendered, tools=structure.prompt_tools)
        else:
            prompt_text = self.device.render_chat(
                add_tools_prompt(rendered, structure.prompt_tools) if structure.tools else rendered
            )
        prompt_text += prefill
        prompt_ids = await self._tokenize_prompt(prompt_text)
        # A chat upstream gets the conversation as the client sent it (tool calls and results included).
        gen = self._generation(chat, prompt_text, prompt_ids, messages, structure)
        gen = replace(gen, prefill=prefill, cache_key=self._cache_key(chat, route[3]))
        job = self._job(chat.id_prefix, gen, len(prompt_ids), route, chat.max_tokens)
        job.migrate_after_tokens = self._forced_migration(chat, route)
        job.call_grammar, job.call_gbnf = structure.call_grammar, structure.call_gbnf
        job.prefill_held = held
        job.answered_calls = _answered_calls(messages)
        if not chat.continue_final:  # outline decoding writes an answer of its own, never the client's
            self._decoding(job, chat)
        return job

    def _cache_key(self, chat: ChatInput, privacy: str) -> str | None:
        """The conversation's prompt-cache key for the clouds that take one, where the client sent none; never for a
        request kept on the device."""
        if privacy == "device" or "prompt_cache_key" in chat.extras:
            return None
        return self.conversation_keys.key(chat.key_limits.name if chat.key_limits else "", chat.messages)

    def _decoding(self, job: Job, chat: ChatInput) -> None:
        """Outline decoding's gate (policies/outline.py), when the request or the gateway asks for it."""
        mode = chat.decoding or self.options.decoding
        if mode == "sequential":
            return
        users = [m for m in chat.messages if m["role"] == "user"]
        fmt = chat.response_format
        plain = not (
            job.gen.tools
            or (fmt is not None and fmt["type"] != "text")
            or chat.logprobs is not None
            or chat.choices > 1
        )
        question = message_text(users[-1]) if users else ""
        verdict = gate(mode, len(users), question, job.gen.max_tokens, plain)
        job.decoding = {"mode": mode, "outline": verdict.use, "reason": verdict.reason}
        if verdict.use:
            job.outline = OutlineRequest(chat, question)

    async def _prepare_completion(self, completion: CompletionInput) -> Job:
        route = self._route(completion)
        self._require_loaded()
        if isinstance(completion.prompt, str):
            prompt_text = completion.prompt
            prompt_ids = await self._tokenize_prompt(prompt_text)
        else:
            prompt_ids = completion.prompt
            vocab = self.device.vocab_size
            if max(prompt_ids) >= vocab:
                raise InvalidRequest(
                    f"Token ID {max(prompt_ids)} is out of range for a vocabulary of {vocab}.",
                    param="prompt",
                    code="invalid_value",
                )
            prompt_text = self.device.detokenize(prompt_ids)
        gen = self._generation(completion, prompt_text, prompt_ids)
        job = self._job("cmpl-", gen, len(prompt_ids), route, completion.max_tokens)
        job.migrate_after_tokens = self._forced_migration(completion, route)
        return job


def _takes_tools(backend: Backend) -> bool:
    """Tools travel in the prompt the gateway renders, except to a chat upstream, which must take them itself."""
    return not (backend.structured_output == "none" and not backend.can_continue)


def _window(tokens: int) -> dict[str, int]:
    """A model's context window under the keys OpenRouter (`context_length`) and vLLM (`max_model_len`) use."""
    return {"context_length": tokens, "max_model_len": tokens}


def _capabilities(tools: bool, structured: bool) -> dict[str, bool]:
    return {
        "chat": True,
        "completions": True,
        "tools": tools,
        "structured_output": structured,
        "logprobs": True,
        "embeddings": False,
    }


def _pricing(prices: TokenPrices) -> dict[str, str]:
    """OpenRouter's shape: USD per token, as decimal strings."""
    out = {"prompt": f"{prices.prefill:.12g}", "completion": f"{prices.decode:.12g}"}
    if prices.cached is not None:
        out["input_cache_read"] = f"{prices.cached:.12g}"
    return out


def _answered_calls(messages: Sequence[dict]) -> tuple[tuple[str, str], ...]:
    """The assistant's tool calls that a later tool message answers, in order (policies/quality.py's call_key)."""
    answered = {m.get("tool_call_id") for m in messages if m["role"] == "tool"}
    return tuple(
        call_key(call["function"]["name"], call["function"]["arguments"])
        for m in messages
        if m["role"] == "assistant"
        for call in m.get("tool_calls") or ()
        if call.get("id") in answered
    )


def _structured_fields(structure: Structure) -> dict:
    return {
        "grammar": structure.grammar,
        "tool_grammar": structure.tool_grammar,
        "gbnf": structure.gbnf,
        "tools": structure.tools,
        "tool_choice": structure.tool_choice,
        "parallel_tool_calls": structure.parallel_tool_calls,
        "response_format": structure.response_format,
    }
