"""The gateway's composition root: settings → backends → orchestrator → the serving core → FastAPI app.

The one module of app/serving/ that reads the settings tree, starts the embedded processes and wires endpoints/ to
the core (the import contracts in pyproject.toml name it so; nothing else in the core imports it). Models load in
the background after the server starts listening, so `/health` answers at once and `/health/ready` says 503 until
every backend can serve.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI

from app.config import CloudSettings, Settings, key_limits
from app.embedded import EmbeddedServer, EmbeddedWorker
from app.lifespan import starting_in_background
from app.serving.core import CoreOptions, ServingCore
from app.serving.disco import DiscoRuntime
from app.serving.events import EventBus
from app.serving.ledger import Ledger
from app.serving.metrics import Metrics, RequestMetricsMiddleware
from app.serving.orchestrator import Orchestrator
from app.serving.state import MemoryStore, StateStore
from app.serving.telemetry import TelemetryOptions, start_telemetry
from clients.base import Backend, GenerationRequest
from clients.continuation import load_chat_template
from clients.dialects import upstream_dialect
from clients.embeddings import SentenceEmbedder
from clients.gguf_meta import read_arch
from clients.openai_compat import OpenAICompatBackend, UpstreamOptions
from deploy import models as bundled
from deploy.models import model_path, resolve_model
from endpoints import anthropic, budget, dashboard, embeddings, events, ollama, openai, ops, responses
from endpoints.api_options import ApiOptions
from endpoints.errors import install_error_handlers
from endpoints.guard import RequestGuard
from policies.breaker import BreakerSettings, RetrySettings

log = logging.getLogger(__name__)


def _device_backend(settings: Settings) -> Backend:
    dev = settings.device
    path = resolve_model(dev.model)
    model_id = dev.model if dev.model in bundled.MODELS else path.stem
    if dev.kind == "torch":
        from clients.torch_local import TorchBackend

        return TorchBackend(name=dev.name, gguf_path=path, model_id=model_id)
    from clients.llamacpp import LlamaCppBackend
    from clients.prompt_cache import PromptCacheOptions

    prompt_cache = PromptCacheOptions(
        dev.prompt_cache_mb, dev.prompt_cache_disk_mb, dev.prompt_cache_dir or None, dev.prompt_cache_disk_min_tokens
    )
    return LlamaCppBackend(
        dev.name,
        path,
        model_id,
        n_ctx=dev.n_ctx,
        n_threads=dev.n_threads,
        reproducible=dev.reproducible,
        prompt_cache=prompt_cache,
    )


def _upstream_template(cloud: CloudSettings) -> str | None:
    """The upstream's own chat template, for a completions upstream with a tokenizer of its own."""
    if not cloud.template:
        return None
    source = resolve_model(cloud.template) if cloud.template in bundled.MODELS else cloud.template
    try:
        return load_chat_template(source)
    except ValueError as exc:
        raise ValueError(f"clouds: template {cloud.template!r}: {exc}") from None


def upstream_options(cloud: CloudSettings) -> UpstreamOptions:
    return UpstreamOptions(
        base_url=cloud.base_url,
        model=cloud.model,
        api_key=cloud.api_key.get_secret_value() if cloud.api_key is not None else None,
        shares_device_tokenizer=cloud.tokenizer == "device",
        dialect=upstream_dialect(cloud.provider, cloud.continuation, cloud.stream_usage),
        chat_template=_upstream_template(cloud),
        token_id_prompts=cloud.token_id_prompts,
        native_structure=cloud.structured_output in ("native", "json_object"),
        json_object_only=cloud.structured_output == "json_object",
        gbnf=cloud.gbnf,
        context_window=cloud.window,
        logprobs=cloud.embedded is None or cloud.embedded.logits_all,
        connect_timeout=cloud.connect_timeout,
        read_timeout=cloud.read_timeout,
        write_timeout=cloud.write_timeout,
        pool_timeout=cloud.pool_timeout,
        max_connections=cloud.max_connections,
        retry=RetrySettings(cloud.retries, cloud.retry_backoff_seconds, budget_seconds=cloud.retry_budget_seconds),
        breaker=BreakerSettings(cloud.failures_to_open, cloud.cooldown_seconds, cloud.max_cooldown_seconds),
    )


def _own_stall_timeouts(settings: Settings, device: str) -> dict[str, float]:
    """The endpoints that have a stall timeout of their own, and theirs."""
    own = {name: cloud.stall_timeout for name, cloud in settings.clouds.items() if cloud.stall_timeout is not None}
    if settings.device.stall_timeout is not None:
        own[device] = settings.device.stall_timeout
    return own


def _state_store(settings: Settings, ledger: Ledger) -> StateStore:
    state = settings.state
    if state.backend == "memory":
        return MemoryStore(ledger, state.hold_seconds, state.settle_seconds)
    from app.serving.valkey_state import ValkeyStore  # the client library only where a store is configured

    return ValkeyStore(
        ledger,
        state.url,
        state.key_prefix,
        state.on_store_loss,
        trace_ttl=state.trace_ttl,
        poll_seconds=state.poll_seconds,
        timeout=state.timeout,
        ttft_samples=settings.disco.window,
        hold_seconds=state.hold_seconds,
        settle_seconds=state.settle_seconds,
        trace_queue=state.trace_queue,
    )


class Gateway:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.events = EventBus(coalesce=0.1)  # a viewer writes at most ~10 batches a second
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
            backend = self.backends[name] = OpenAICompatBackend(
                name, upstream_options(cloud), count_exact=self._count_device
            )
            backend.on_retry = self.metrics.cloud_retries.labels(backend=name).inc
            backend.breaker.on_open = self.metrics.breaker_openings.labels(backend=name).inc
        for name, backend in self.backends.items():
            self.metrics.backend_active.labels(backend=name).set_function(lambda b=backend: b.active)
            self.metrics.backend_generated.labels(backend=name).set_function(lambda b=backend: b.tokens_generated)
            if hasattr(backend, "prompt_cache"):  # the llama.cpp device's: built once its model is loaded
                self.metrics.watch_prompt_cache(name, lambda b=backend: b.prompt_cache)
        cloud = settings.gateway.cloud if settings.gateway.cloud in self.backends else None
        self.ledger = Ledger.from_settings(settings)
        self.disco = DiscoRuntime(
            self.ledger,
            cloud,
            read_arch(self.device.model_path),
            window=settings.disco.window,
            recompute_every=settings.disco.recompute_every,
            co_located=frozenset(name for name, c in settings.clouds.items() if c.shares_device),
        )
        self.metrics.budget_ratio.set_function(self.ledger.realised_ratio)
        self.ledger.on_change(self._budget_changed)
        self.metrics.event_viewers.set_function(lambda: self.events.viewers)
        self.metrics.events_dropped.set_function(lambda: self.events.dropped_total)
        for backend in self.backends.values():
            if hasattr(backend, "on_session"):  # a HAT device half: its sessions with the worker
                backend.on_session = lambda kind, line, name=backend.name: self.events.publish(
                    f"hat.session.{kind}", backend=name, **line
                )
        self.orchestrator = Orchestrator(
            self.backends,
            self.device.name,
            cloud,
            settings.gateway.fallback,
            self.metrics,
            self.disco,
            self.ledger,
            stall_timeout=settings.gateway.stall_timeout,
            stall_timeouts=_own_stall_timeouts(settings, self.device.name),
            history=settings.gateway.trace_history,
            trace_file=settings.gateway.trace_file,
            events=self.events,
            breakers={n: b.breaker for n, b in self.backends.items() if isinstance(b, OpenAICompatBackend)},
        )
        tel = settings.telemetry
        self.telemetry = start_telemetry(
            TelemetryOptions(tel.enabled, tel.endpoint, tel.service_name), self.events, settings.gateway.model_name
        )
        self.state = _state_store(settings, self.ledger)
        self.orchestrator.keep_trace = self.state.keep_trace
        self.orchestrator.accounting.settle_seconds = self.state.settle_seconds
        emb = settings.embeddings
        self.embedder = SentenceEmbedder(emb.model, model_path(emb.model), emb.max_tokens) if emb.enabled else None
        gw = settings.gateway
        self.core = ServingCore(
            CoreOptions(
                gw.model_name,
                gw.default_max_tokens,
                gw.privacy,
                gw.decoding,
                gw.prompt_cache_secret.get_secret_value().encode() if gw.prompt_cache_secret else None,
                gw.max_answer_tokens,
            ),
            self.device,
            self.backends,
            self.orchestrator,
            self.ledger,
            self.disco,
            self.metrics,
            self.embedder,
            created=int(time.time()),
            state=self.state,
            events=self.events,
        )

    def _hat_backend(self, name: str, cloud) -> Backend:
        from clients.hat.adapter import draft_files
        from clients.hat.device import HATBackend

        options = cloud  # HATCloudSettings are HATOptions (the device half's knobs) plus the gateway's own fields
        if cloud.embedded is not None:
            token = cloud.auth_token.get_secret_value() if cloud.auth_token else None
            worker = EmbeddedWorker(cloud.embedded, cloud.model, cloud.m, token, profile=str(cloud.profile))
            options = cloud.model_copy(update={"worker_url": worker.url})
            self.embedded.append(worker)
        adapter, draft_vocab = draft_files(cloud.model, cloud.m, cloud.adapter, cloud.draft_vocab)
        backend = HATBackend(
            options,
            gguf_path=resolve_model(cloud.model),
            name=name,
            model_id=f"hat:{cloud.model}",
            adapter_path=adapter,
            draft_vocab_path=draft_vocab,
        )
        backend.accepts_token_ids = cloud.tokenizer == "device"
        return backend

    def _budget_changed(self) -> None:
        self.events.publish("budget.changed", version=self.ledger.version, settings=self.ledger.settings.to_dict())

    def _count_device(self, text: str) -> int:
        return self.device.count_tokens(text)[0]

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self.state.start()
            clouds = [name for name in self.backends if name != self.device.name]
            self.disco.warm(await self.state.server_ttft_samples(clouds))
            self.disco.on_server_ttft(self.state.share_server_ttft)
            for server in self.embedded:
                server.start()
            await asyncio.gather(*(b.start() for b in self.backends.values()), *(s.wait_ready() for s in self.embedded))
            if self.settings.disco.profile_device:
                await self._profile_device()
            self.core.loaded.set()
            log.info(
                "gateway ready: %s",
                ", ".join(f"{n} ({b.model_id}, {b.context_window}-token window)" for n, b in self.backends.items()),
            )
        except Exception as exc:
            self.core.startup_error = str(exc)
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

    async def close(self) -> None:
        self.orchestrator.close()
        await self.state.close()
        if self.telemetry is not None:
            await asyncio.to_thread(self.telemetry.close)  # the exporter's last batch
        if self.embedder is not None:
            await self.embedder.close()
        for backend in self.backends.values():
            await backend.close()
        for server in self.embedded:
            server.stop()


def create_gateway(settings: Settings) -> FastAPI:
    gateway = Gateway(settings)

    lifespan = starting_in_background(gateway.start, gateway.close)
    app = FastAPI(title="Tandem gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    gw = settings.gateway
    app.state.serving = gateway.core
    limits = tuple(key_limits(key) for key in gw.api_keys)
    app.state.api_options = ApiOptions(tuple(gw.api_keys), limits, tuple(gw.admin_keys), gw.ping_seconds)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=settings.gateway.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=gateway.metrics)  # outermost: counts the guard's answers
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.include_router(ollama.router)
    app.include_router(embeddings.router)
    app.include_router(budget.router)
    app.include_router(ops.router)
    app.include_router(events.router)
    app.include_router(dashboard.router)
    return app
