"""The gateway process: settings → backends → orchestrator → FastAPI app.

Models load in the background after the server starts listening, so `/health`
answers at once and `/health/ready` says 503 until every backend can serve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

from fastapi import FastAPI

from app.config import CloudSettings, Settings
from app.embedded import EmbeddedServer, EmbeddedWorker
from app.lifespan import starting_in_background
from app.serving.disco import DiscoRuntime
from app.serving.job import Job
from app.serving.ledger import Ledger
from app.serving.metrics import Metrics, RequestMetricsMiddleware
from app.serving.orchestrator import Orchestrator
from app.serving.outline import OutlineDecoding, OutlineRequest
from app.serving.structured import Structure, add_tools_prompt, structure_of, template_messages
from clients.base import Backend, GenerationRequest
from clients.embeddings import SentenceEmbedder
from clients.openai_compat import OpenAICompatBackend, UpstreamOptions
from deploy import models as bundled
from deploy.models import model_path, resolve_model
from endpoints.errors import ApiError, install_error_handlers
from endpoints.guard import RequestGuard
from endpoints.schemas import ChatCompletionRequest, CompletionRequest
from policies import cost
from policies.dispatch import canonical_name
from policies.outline import gate
from policies.privacy import allows, effective_level

# Architectures of the bundled models (checked against their GGUF metadata in the tests);
# reading a GGUF's metadata takes ~10 s in Python, so other models pay that at start-up.
_BUNDLED_ARCH = {
    "qwen2.5-coder-0.5b-instruct": cost.QWEN2_5_0_5B,
    "qwen2.5-coder-1.5b-instruct": cost.QWEN2_5_1_5B,
    "smollm2-135m-instruct": cost.SMOLLM2_135M,
}

log = logging.getLogger(__name__)

# Prompts longer than this (in characters) are tokenised off the event loop (~1 ms of tokenising at most here).
_INLINE_TOKENIZE_CHARS = 16_384


def _device_arch(spec: str, path: Path) -> cost.ModelArch:
    if spec in _BUNDLED_ARCH:
        return _BUNDLED_ARCH[spec]
    from clients.gguf_meta import read_arch

    return read_arch(path)


def _device_backend(settings: Settings) -> Backend:
    dev = settings.device
    path = resolve_model(dev.model)
    model_id = dev.model if dev.model in bundled.MODELS else path.stem
    if dev.kind == "torch":
        from clients.torch_local import TorchBackend

        return TorchBackend(name=dev.name, gguf_path=path, model_id=model_id)
    from clients.llamacpp import LlamaCppBackend

    return LlamaCppBackend(
        dev.name, path, model_id, n_ctx=dev.n_ctx, n_threads=dev.n_threads, reproducible=dev.reproducible
    )


def _upstream_options(cloud: CloudSettings) -> UpstreamOptions:
    return UpstreamOptions(
        base_url=cloud.base_url,
        model=cloud.model,
        api_key=cloud.api_key.get_secret_value() if cloud.api_key is not None else None,
        shares_device_tokenizer=cloud.tokenizer == "device",
        continues=cloud.continuation == "completions",
        token_id_prompts=cloud.token_id_prompts,
        native_structure=cloud.structured_output == "native",
        connect_timeout=cloud.connect_timeout,
        read_timeout=cloud.read_timeout,
        write_timeout=cloud.write_timeout,
        pool_timeout=cloud.pool_timeout,
        max_connections=cloud.max_connections,
    )


class Gateway:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.device = _device_backend(settings)
        self.backends: dict[str, Backend] = {self.device.name: self.device}
        self.embedded: list[EmbeddedServer | EmbeddedWorker] = []
        for name, cloud in settings.clouds.items():
            if cloud.kind == "hat":
                self.backends[name] = self._hat_backend(name, cloud)
                continue
            if cloud.embedded is not None:
                server = EmbeddedServer(cloud.embedded, resolve_model(cloud.embedded.model), alias=cloud.model)
                cloud = cloud.model_copy(update={"base_url": server.base_url})
                self.embedded.append(server)
            self.backends[name] = OpenAICompatBackend(name, _upstream_options(cloud), count_exact=self._count_device)
        for name, backend in self.backends.items():
            self.metrics.backend_active.labels(backend=name).set_function(lambda b=backend: b.active)
            self.metrics.backend_generated.labels(backend=name).set_function(lambda b=backend: b.tokens_generated)
        cloud = settings.gateway.cloud if settings.gateway.cloud in self.backends else None
        self.ledger = Ledger.from_settings(settings)
        self.disco = DiscoRuntime(
            self.ledger,
            cloud,
            _device_arch(settings.device.model, self.device.model_path),
            window=settings.disco.window,
            recompute_every=settings.disco.recompute_every,
        )
        self.metrics.budget_ratio.set_function(self.ledger.realised_ratio)
        self.orchestrator = Orchestrator(
            self.backends,
            self.device.name,
            cloud,
            settings.gateway.fallback,
            self.metrics,
            self.disco,
            self.ledger,
            stall_timeout=settings.gateway.stall_timeout,
            history=settings.gateway.trace_history,
            trace_file=settings.gateway.trace_file,
        )
        emb = settings.embeddings
        self.embedder = SentenceEmbedder(emb.model, model_path(emb.model), emb.max_tokens) if emb.enabled else None
        self._embedder_lock = asyncio.Lock()
        self.loaded = asyncio.Event()
        self.startup_error: str | None = None
        self.created = int(time.time())

    def _hat_backend(self, name: str, cloud) -> Backend:
        from clients.hat.adapter import draft_files
        from clients.hat.device import HATBackend
        from clients.hat.link import LinkProfile
        from clients.hat.options import HATOptions

        url = cloud.worker_url
        token = cloud.auth_token.get_secret_value() if cloud.auth_token else None
        if cloud.embedded is not None:
            worker = EmbeddedWorker(cloud.embedded, cloud.model, cloud.m, token, profile=cloud.profile)
            url = worker.url
            self.embedded.append(worker)
        adapter, draft_vocab = draft_files(cloud.model, cloud.m, cloud.adapter, cloud.draft_vocab)
        options = HATOptions(
            url,
            resolve_model(cloud.model),
            name=name,
            model_id=f"hat:{cloud.model}",
            m=cloud.m,
            adapter_path=adapter,
            draft_vocab_path=draft_vocab,
            auth_token=token,
            wire_dtype=cloud.wire_dtype,
            eta=cloud.eta,
            max_draft=cloud.max_draft,
            draft_length=cloud.draft_length,
            tree_width=cloud.tree_width,
            arca=cloud.arca,
            speculative=cloud.speculative,
            parallel_drafting=cloud.parallel_drafting,
            drafting=cloud.drafting,
            chunking=cloud.chunking,
            link=LinkProfile.parse(cloud.link) if cloud.link else None,
            num_threads=cloud.num_threads,
            noise=cloud.noise,
            profile=cloud.profile or None,
        )
        backend = HATBackend(options)
        backend.accepts_token_ids = cloud.tokenizer == "device"
        return backend

    def _count_device(self, text: str) -> int:
        return self.device.count_tokens(text)[0]

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            for server in self.embedded:
                server.start()
            await asyncio.gather(*(b.start() for b in self.backends.values()), *(s.wait_ready() for s in self.embedded))
            if self.settings.disco.profile_device:
                await self._profile_device()
            self.loaded.set()
            log.info("gateway ready: %s", ", ".join(f"{n} ({b.model_id})" for n, b in self.backends.items()))
        except Exception as exc:
            self.startup_error = str(exc)
            log.error("start-up failed: %s", exc)
            raise

    async def _profile_device(self) -> None:
        """Fit DiSCo's device TTFT line T_d(l) = k·l + c from a few real prefills."""
        for n in (16, 128, 512):
            ids = tuple(self.device.tokenize(" ".join(str(1000 + i * 7 + n) for i in range(n)))[:n])
            gen = GenerationRequest(prompt_text="", prompt_ids=ids, max_tokens=1, temperature=0.0)
            t0 = time.monotonic()
            stream = self.device.stream(gen)
            try:
                event = await anext(stream)
            finally:
                await stream.aclose()
            self.disco.observe_first_token("device", None, len(ids), event.t - t0, migration=False)
        line = self.disco.estimators.device_ttft
        log.info("device TTFT line: %.2f ms/token + %.1f ms", line.k * 1e3, line.c * 1e3)

    async def embedding_model(self) -> SentenceEmbedder:
        """The device's embedding model, loaded at its first use (most gateways never embed)."""
        if self.embedder is None:
            raise ApiError(404, "Embeddings are not enabled on this gateway ([embeddings] enabled = false).")
        async with self._embedder_lock:
            if not self.embedder.ready:
                # Fetched and verified like every bundled model (a no-op once `make setup` has run).
                await asyncio.to_thread(resolve_model, self.embedder.model_id)
                await self.embedder.start()
        return self.embedder

    async def close(self) -> None:
        self.orchestrator.close()
        if self.embedder is not None:
            await self.embedder.close()
        for backend in self.backends.values():
            await backend.close()
        for server in self.embedded:
            server.stop()

    async def readiness(self) -> dict[str, bool]:
        if not self.loaded.is_set():
            return {name: False for name in self.backends}
        names = list(self.backends)
        states = await asyncio.gather(*(self.backends[n].ready() for n in names))
        return dict(zip(names, states, strict=True))

    # -- requests ----------------------------------------------------------------------------
    def model_ids(self) -> list[str]:
        ids = [self.settings.gateway.model_name]
        for backend in self.backends.values():
            ids += [backend.name, backend.model_id]
        return list(dict.fromkeys(ids))

    def _route(self, model: str, tandem, key_privacy: str | None) -> tuple[str | None, str, str | None, str]:
        """(pinned backend, policy, cloud endpoint, privacy level) for a request."""
        pinned = None
        if model != self.settings.gateway.model_name:
            pinned = next((n for n, b in self.backends.items() if model in (n, b.model_id)), None)
            if pinned is None:
                raise ApiError(
                    404,
                    f"The model '{model}' does not exist. Available: {', '.join(self.model_ids())}.",
                    param="model",
                    code="model_not_found",
                )
        chosen = (tandem.policy if tandem else None) or self.ledger.settings.policy
        try:
            canonical = canonical_name(chosen)
        except ValueError as exc:
            raise ApiError(400, f"Unknown routing policy: {exc}", param="tandem.policy") from None
        clouds = [n for n in self.backends if n != self.device.name]
        cloud = (tandem.cloud if tandem else None) or self.orchestrator.cloud
        if pinned is not None and pinned != self.device.name:
            cloud = pinned
        if tandem is not None and tandem.cloud is not None and tandem.cloud not in clouds:
            raise ApiError(
                400,
                f"Unknown cloud endpoint '{tandem.cloud}'; configured: {', '.join(clouds) or 'none'}.",
                param="tandem.cloud",
            )
        if canonical != "device-only" and cloud is None and pinned is None:
            raise ApiError(
                400, f"Policy '{chosen}' needs a cloud backend, and none is configured.", param="tandem.policy"
            )
        requested = tandem.privacy if tandem else None
        privacy = effective_level(self.settings.gateway.privacy, key_privacy, requested)
        if pinned is not None and not allows(privacy, self.backends[pinned].locality):
            whose = "this request's" if requested == privacy else "this API key's" if key_privacy else "the gateway's"
            raise ApiError(
                400,
                f"The model '{model}' is served by {pinned} ({self.backends[pinned].locality}), which {whose} "
                f"privacy level '{privacy}' does not allow.",
                param="tandem.privacy" if requested == privacy else "model",
            )
        return pinned, chosen, cloud, privacy

    def _require_loaded(self) -> None:
        if not self.loaded.is_set():
            detail = f" (start-up failed: {self.startup_error})" if self.startup_error else "; retry shortly"
            raise ApiError(
                503, "Tandem is still loading its models" + detail, code="not_ready", headers={"Retry-After": "2"}
            )

    def _job(self, prefix: str, gen: GenerationRequest, prompt_tokens: int, route) -> Job:
        pinned, policy, cloud, privacy = route
        return Job(
            id=f"{prefix}{uuid.uuid4().hex[:24]}",
            gen=gen,
            prompt_tokens=prompt_tokens,
            policy=policy,
            pinned=pinned,
            cloud=cloud,
            privacy=privacy,
        )

    def _limits(self, body, prompt_tokens: int) -> int:
        limit = body.token_limit or self.settings.gateway.default_max_tokens
        n_ctx = self.settings.device.n_ctx
        if prompt_tokens >= n_ctx:
            raise ApiError(
                400,
                f"This prompt is {prompt_tokens} tokens, more than the context window of {n_ctx} tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        return limit

    async def _tokenize_prompt(self, text: str) -> tuple[int, ...]:
        """A long prompt is tokenised on a worker thread: seconds of tokenising must not hold up every other
        stream's tokens on the event loop. A short one (nearly every chat turn, mostly from the prompt cache) is
        tokenised here, where it costs less than the hop to a thread."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tuple(self.device.tokenize_prompt(text))
        return tuple(await asyncio.to_thread(self.device.tokenize_prompt, text))

    def _generation(
        self, body, prompt_text: str, prompt_ids: tuple[int, ...], messages=None, structure: Structure | None = None
    ) -> GenerationRequest:
        if not prompt_ids:
            raise ApiError(
                400, "The prompt is empty: send at least one token of prompt.", param="prompt", code="invalid_value"
            )
        return GenerationRequest(
            prompt_text=prompt_text,
            prompt_ids=prompt_ids,
            messages=messages,
            max_tokens=self._limits(body, len(prompt_ids)),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_sequences,
            seed=body.seed,
            **(_structured_fields(structure) if structure is not None else {}),
            logprobs=body.logprobs_top,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(body),
        )

    def _logit_bias(self, body) -> tuple[tuple[int, float], ...]:
        pairs = body.logit_bias_pairs
        vocab = self.device.vocab_size if pairs else 0
        for tok, _ in pairs:
            if tok >= vocab:
                raise ApiError(
                    400,
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

    async def prepare_chat(
        self, body: ChatCompletionRequest, key_privacy: str | None = None, id_prefix: str = "chatcmpl-"
    ) -> Job:
        """A chat request's job; `key_privacy` is its API key's privacy level, `id_prefix` names its kind in the
        id (`resp_` for the Responses API)."""
        route = self._route(body.model, body.tandem, key_privacy)
        self._require_loaded()
        structure = structure_of(body, self._tag)
        knows_tools = getattr(self.device, "template_knows_tools", False)
        rendered = template_messages(body.messages, knows_tools)
        if structure.tools and knows_tools:
            prompt_text = self.device.render_chat(rendered, tools=structure.tools)
        else:
            prompt_text = self.device.render_chat(
                add_tools_prompt(rendered, structure.tools) if structure.tools else rendered
            )
        prompt_ids = await self._tokenize_prompt(prompt_text)
        # A chat upstream gets the conversation as the client sent it (tool calls and results included).
        messages = tuple(
            {**m.model_dump(exclude_none=True), "role": "system" if m.role == "developer" else m.role}
            for m in body.messages
        )
        gen = self._generation(body, prompt_text, prompt_ids, messages, structure)
        job = self._job(id_prefix, gen, len(prompt_ids), route)
        job.call_grammar = structure.call_grammar
        self._decoding(job, body, key_privacy)
        return job

    def _decoding(self, job: Job, body: ChatCompletionRequest, key_privacy: str | None) -> None:
        """Outline decoding's gate (policies/outline.py), when the request or the gateway asks for it."""
        mode = (body.tandem.decoding if body.tandem else None) or self.settings.gateway.decoding
        if mode == "sequential":
            return
        users = [m for m in body.messages if m.role == "user"]
        fmt = body.response_format
        plain = not (job.gen.tools or (fmt is not None and fmt.type != "text") or body.logprobs or body.choices > 1)
        verdict = gate(mode, len(users), users[-1].text() if users else "", job.gen.max_tokens, plain)
        job.decoding = {"mode": mode, "outline": verdict.use, "reason": verdict.reason}
        if verdict.use:
            job.outline = OutlineRequest(body, key_privacy, users[-1].text())

    def answer(self, job: Job):
        """The answer's deltas: by outline decoding when its gate said yes, else the orchestrator's."""
        if job.outline is not None:
            return OutlineDecoding(self).generate(job)
        return self.orchestrator.generate(job)

    async def prepare_completion(self, body: CompletionRequest, key_privacy: str | None = None) -> Job:
        route = self._route(body.model, body.tandem, key_privacy)
        self._require_loaded()
        if isinstance(body.prompt, str):
            prompt_text = body.prompt
            prompt_ids = await self._tokenize_prompt(prompt_text)
        else:
            prompt_ids = tuple(body.prompt)
            vocab = self.device.vocab_size
            if max(prompt_ids) >= vocab:
                raise ApiError(
                    400,
                    f"Token ID {max(prompt_ids)} is out of range for a vocabulary of {vocab}.",
                    param="prompt",
                    code="invalid_value",
                )
            prompt_text = self.device.detokenize(prompt_ids)
        gen = self._generation(body, prompt_text, prompt_ids)
        return self._job("cmpl-", gen, len(prompt_ids), route)


def _structured_fields(structure: Structure) -> dict:
    return {
        "grammar": structure.grammar,
        "tools": structure.tools,
        "tool_choice": structure.tool_choice,
        "parallel_tool_calls": structure.parallel_tool_calls,
        "response_format": structure.response_format,
    }


def create_gateway(settings: Settings) -> FastAPI:
    gateway = Gateway(settings)

    lifespan = starting_in_background(gateway.start, gateway.close)
    app = FastAPI(title="Tandem gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gateway = gateway
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=settings.gateway.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=gateway.metrics)  # outermost: counts the guard's answers
    from endpoints import budget, embeddings, openai, ops, responses

    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(embeddings.router)
    app.include_router(budget.router)
    app.include_router(ops.router)
    return app
