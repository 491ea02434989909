"""The HAT worker process (`tandem worker`): hosts the middle submodel of a split LLM for many devices.

`create_worker(settings)` returns its own FastAPI app (not the gateway's): the hidden-state routes of
endpoints/hidden.py, `/health`, `/health/ready` and `/metrics`. The model loads in the background after the
server starts listening, like the gateway's backends: `/health` answers at once, `/health/ready` and every
hidden-state route say 503 until the engine is up.

The worker keeps only what it serves: after splitting, the embedding, the first m layers and the LM head are
dropped (it never needs token ids or logits, and on Qwen 0.5B the untied head alone is 0.5 GB of fp32).

Metrics (own registry): sessions, HAT state monitoring (Eqs. 1-2: batched-token moving average mu, compute-delay
moving average eta, and the predictor g(x) = slope*x + intercept with g evaluated at mu), forward passes,
batched forward passes, tokens, frames by kind and frames rejected by reason; the batch planner's passes, groups,
deferred and forced frames, split prefill frames, sub-chunks run and the current sub-chunk budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from app.lifespan import starting_in_background
from app.worker.compute import compute_device
from app.worker.engine import Engine, FrameHook
from app.worker.registry import Heartbeat
from app.worker.settings import WorkerSettings
from clients.hat import wire
from clients.hat.profile import load_profile
from deploy.models import resolve_model
from endpoints import hidden
from endpoints.auth import bearer, matches_any
from endpoints.errors import install_error_handlers

log = logging.getLogger(__name__)


class Worker:
    """Engine + settings + auth + metrics of one worker app (app.state.worker)."""

    def __init__(self, settings: WorkerSettings, model: Any = None, frame_hook: FrameHook | None = None) -> None:
        self.settings = settings
        self._model = model
        self.frame_hook = frame_hook
        self.engine: Engine | None = None
        self.startup_error: str | None = None
        self.loaded = asyncio.Event()
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(lambda: self.engine))
        token = settings.auth_token.get_secret_value() if settings.auth_token is not None else None
        self._token = token.encode() if token else None
        self.heartbeat: Heartbeat | None = None
        self.drain_task: asyncio.Task | None = None
        self.drained: dict[str, int] | None = None  # once drained: sessions finished here, sessions handed over

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.started and self.engine.failed is None

    @property
    def draining(self) -> bool:
        return self.drain_task is not None

    def drain(self, timeout: float) -> asyncio.Task:
        """Start draining (idempotent): no new session from now on (OPEN answers 503 and /health/ready says
        "draining", so pools and load balancers place elsewhere), out of the registry at once; the sessions open
        now run on for up to `timeout` seconds, and those still open then are handed over (an ERROR 503 each, on
        which their devices move them to another worker with the context they delivered). The task's result, also
        kept in `drained`: how many sessions finished here and how many were handed over."""
        if self.drain_task is None:
            if self.engine is not None:
                self.engine.draining = True
            self.drain_task = asyncio.create_task(self._drain(timeout))
        return self.drain_task

    async def _drain(self, seconds: float) -> dict[str, int]:
        engine = self.engine
        at_start = engine.session_count if engine is not None else 0
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if engine is None:
            self.drained = {"finished": 0, "handed_over": 0}
            return self.drained
        deadline = time.monotonic() + seconds
        # Sessions end on the engine thread and the loop alike: a count polled every 50 ms is the simplest watch.
        while engine.session_count and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        handed_over = await asyncio.wrap_future(engine.call(engine.hand_over)) if engine.session_count else 0
        self.drained = {"finished": max(0, at_start - handed_over), "handed_over": handed_over}
        log.info("worker drained: %(finished)d sessions finished here, %(handed_over)d handed over", self.drained)
        return self.drained

    @property
    def failure(self) -> str | None:
        """Why the worker cannot serve: its start-up failed, or a stage of a staged worker died."""
        if self.startup_error:
            return self.startup_error
        return None if self.engine is None else self.engine.failed

    def authorized(self, header: str | None) -> bool:
        """Constant-time check of an "Authorization: Bearer <token>" header (always True without a token)."""
        return self._token is None or matches_any(bearer(header), (self._token,))

    async def start(self) -> None:
        try:
            self.engine = await asyncio.to_thread(self._build)
            self.loaded.set()
            e = self.engine
            log.info(
                "worker ready: %s layers %d..%d of %d on %s, hidden %d, wire %s, %d stage(s)%s",
                self.settings.model,
                e.m,
                e.num_layers - 1,
                e.num_layers,
                e.ragged.device,
                e.hidden_size,
                e.wire_dtype_name,
                e.stages,
                "" if e.pipeline is None else f" with layers {list(e.pipeline.bounds)} ({_stage_gib(e.pipeline)})",
            )
        except Exception as exc:
            self.startup_error = f"{type(exc).__name__}: {exc}"
            log.error("worker start-up failed: %s", exc)
            raise
        s = self.settings
        if self.draining:  # told to drain while it loaded: it never takes a session nor announces itself
            self.engine.draining = True
        elif s.registry_url:
            endpoint = s.advertise_url or f"ws://{s.host}:{s.port}"
            self.heartbeat = Heartbeat(s.registry_url, s.registry_prefix, endpoint, s.heartbeat_seconds)
            self.heartbeat.start(self.engine.info)

    def _build(self) -> Engine:
        from clients.hat.split import split_model

        s = self.settings
        profile = load_profile(s.profile) if s.profile else None
        if profile is not None:  # refused before the model loads if it was made for another model or m
            profile.check_model({s.model, resolve_model(s.model).name}, s.m)
        threads = s.stage_threads[0] if s.stage_threads else s.num_threads
        if threads:
            torch.set_num_threads(threads)
        model = self._model
        if model is None:
            from clients.hf_model import load_hf_model

            model, _tok = load_hf_model(resolve_model(s.model))
        device = compute_device(s.device)
        if s.stages > 1:
            from app.worker.pipeline import start_pipeline

            pipeline, first, seeds = start_pipeline(model, s, device)
            del model
            self._model = None
            engine = Engine(first, s, model_name=s.model, frame_hook=self.frame_hook, pipeline=pipeline)
            for tokens, seconds in seeds:  # whole-middle passes timed at start-up seed g (Eq. 2)
                engine.stats.g.update(tokens, seconds)
            try:
                engine.start(self_check=False)  # start_pipeline checked the whole chain against the model's layers
            except BaseException:
                pipeline.stop()
                raise
            return engine
        middle = split_model(model, s.m).middle  # the only part the worker keeps a reference to
        middle.to(device)
        del model
        self._model = None
        engine = Engine(middle, s, model_name=s.model, frame_hook=self.frame_hook)
        engine.start()
        if s.prefill_profile:
            engine.call(engine.profile_prefill).result()
        if profile is not None:
            # g starts from the measured middle times (clients/hat/profile.py) rather than the self-check's two cold
            # passes; set on the engine thread, which owns the statistics.
            engine.call(lambda: engine.stats.g.prime(profile.delay_points())).result()
        return engine

    async def stop(self) -> None:
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


def _stage_gib(pipeline: Any) -> str:
    return "GiB per stage with KV reserve: " + ", ".join(f"{b / 2**30:.2f}" for b in pipeline.stage_memory)


class _EngineCollector:
    """Reads the engine's counters at scrape time (no per-frame metric calls on the hot path)."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self._engine = engine

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        e = self._engine()
        up = GaugeMetricFamily("tandem_worker_ready", "1 once the middle submodel is loaded and checked")
        up.add_metric([], 1.0 if e is not None and e.started and e.failed is None else 0.0)
        yield up
        if e is None:
            return
        st = e.stats
        slope, intercept = st.g.coefficients()
        gauges = [
            ("tandem_worker_sessions", "Open device sessions", float(e.session_count)),
            ("tandem_worker_pipeline_stages", "Processes the middle layers run on (HAT's P)", float(e.stages)),
            ("tandem_worker_max_sessions", "Session limit", float(e.limits.max_sessions)),
            ("tandem_worker_batch_tokens_avg", "mu: moving average of tokens per forward (HAT Eq. 1)", st.mu.get()),
            ("tandem_worker_compute_delay_avg_seconds", "eta: moving average of forward-pass time", st.eta.get()),
            ("tandem_worker_delay_slope_seconds", "g(x) = slope*x + intercept: seconds per token (Eq. 2)", slope),
            ("tandem_worker_delay_intercept_seconds", "g(x) = slope*x + intercept: fixed seconds (Eq. 2)", intercept),
            ("tandem_worker_predicted_delay_seconds", "g(mu): predicted delay of an average batch", st.g(st.mu.get())),
            ("tandem_worker_last_batch_rows", "Sessions in the last forward pass", float(st.last_rows)),
            ("tandem_worker_max_batch_rows", "Most sessions seen in one forward pass", float(st.max_rows)),
            (
                "tandem_worker_subchunk_budget_tokens",
                "Planned batching: sub-chunk size from g",
                float(st.subchunk_budget),
            ),
            (
                "tandem_worker_fair_quantum_seconds",
                "Planned batching: each session's fair share of a pass (seconds of work it may add)",
                st.fair_quantum,
            ),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        counters = [
            ("tandem_worker_forward_passes", "Middle forward passes", st.forwards),
            ("tandem_worker_batched_forward_passes", "Forward passes that carried >= 2 sessions", st.batched_forwards),
            ("tandem_worker_tokens", "Token positions run through the middle submodel", st.tokens),
            ("tandem_worker_sessions_opened", "Sessions opened", st.sessions_opened),
            ("tandem_worker_sessions_expired", "Sessions dropped for idleness", st.sessions_expired),
            ("tandem_worker_planned_passes", "Passes chosen by the batch planner", st.planned_passes),
            ("tandem_worker_planned_groups", "Groups in the batch planner's plans", st.planned_groups),
            ("tandem_worker_deferred_frames", "Pending frames the planner left for a later pass", st.deferred_frames),
            (
                "tandem_worker_forced_frames",
                "Frames run because the planner had left them out max_defer times",
                st.forced_frames,
            ),
            ("tandem_worker_split_frames", "Prefill frames split into sub-chunks", st.split_frames),
            ("tandem_worker_subchunk_passes", "Sub-chunks of split prefill frames run", st.subchunk_passes),
            ("tandem_worker_status_frames", "STATUS frames (mu, g) sent to devices mid-session", st.status_frames),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        if st.stage_seconds:
            busy = CounterMetricFamily(
                "tandem_worker_stage_busy_seconds", "Staged worker: compute seconds per stage", labels=["stage"]
            )
            for stage, seconds in enumerate(list(st.stage_seconds)):
                busy.add_metric([str(stage)], seconds)
            yield busy
        frames = CounterMetricFamily("tandem_worker_frames", "Device frames accepted, by kind", labels=["kind"])
        for kind, n in sorted(st.frames.items()):
            frames.add_metric([kind], float(n))
        yield frames
        rejected = CounterMetricFamily(
            "tandem_worker_frames_rejected", "Device frames or sessions refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(st.rejected.items()):
            rejected.add_metric([reason], float(n))
        yield rejected


def create_worker(settings: WorkerSettings, *, model: Any = None, frame_hook: FrameHook | None = None) -> FastAPI:
    """The worker's FastAPI app. `model`: an already-loaded HF causal LM to split (tests share one);
    `frame_hook(session_id | None, data)`: called with every binary frame the worker receives (tests)."""
    worker = Worker(settings, model, frame_hook)

    lifespan = starting_in_background(worker.start, worker.stop)
    app = FastAPI(title="Tandem HAT worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    install_error_handlers(app)
    app.include_router(hidden.router)
    return app


def uvicorn_config_kwargs(settings: WorkerSettings) -> dict[str, Any]:
    """uvicorn options the worker needs. WebSocket messages up to twice the frame limit are read, so a frame a bit
    over the limit gets a clear ERROR frame (413) instead of a bare 1009 close; larger ones are cut off by uvicorn.
    No per-message deflate: float tensors do not compress and deflate would cost CPU on both ends."""
    return {
        "host": settings.host,
        "port": settings.port,
        # The model (and so the derived frame limit) is not loaded yet: cap at the wire's own limit.
        "ws_max_size": 2 * (settings.max_frame_bytes or wire.DEFAULT_MAX_FRAME_BYTES) + 64 * 1024,
        "ws_per_message_deflate": False,
        "log_level": settings.log_level,
        "access_log": False,
        "timeout_graceful_shutdown": 5,
    }


def serve_worker(settings: WorkerSettings) -> None:
    """Run the worker in the foreground (what `tandem worker` should call). SIGTERM or SIGINT drains it first
    (Worker.drain with `drain_timeout`), then it exits; a second signal exits at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:  # a signal handler: only hand over to the loop
            worker: Worker = app.state.worker
            if self.loop is None or worker.draining or worker.engine is None:
                super().handle_exit(sig, frame)
            else:
                self.loop.call_soon_threadsafe(self._drain_then_exit, sig, frame)

        def _drain_then_exit(self, sig: int, frame: Any) -> None:
            worker: Worker = app.state.worker
            if worker.draining:  # a second signal
                super().handle_exit(sig, frame)
                return
            log.info("signal %d: draining (up to %g s; signal again to stop at once)", sig, settings.drain_timeout)
            worker.drain(settings.drain_timeout).add_done_callback(
                lambda _: super(DrainingServer, self).handle_exit(sig, frame)
            )

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.auth_token is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "worker listening on %s with no device token: anyone who reaches it can use it "
            "(set TANDEM_WORKER_AUTH_TOKEN, and the gateway's clouds.<name>.auth_token to match)",
            settings.host,
        )
    app = create_worker(settings)
    DrainingServer(uvicorn.Config(app, **uvicorn_config_kwargs(settings))).run()
