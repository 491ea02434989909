"""Stage 0's pipeline of the P-stage HAT worker (`tandem worker --stages P`): the middle layers across processes.

Stage s is a process that owns a contiguous slice of the middle layers [b_s, b_{s+1}) and, for every session, the
KV cache of those layers. Stage 0 is the worker process itself (HTTP/WebSocket, sessions, the batcher and the
planner: app/worker/engine.py); it runs its own slice on each micro-batch, then hands the activations down the
chain 0 → 1 → … → P−1 with torch.distributed point-to-point sends, and the last stage sends the deep states back
to stage 0, whose engine thread replies to the devices. Replies go through stage 0 (rather than the last stage
holding the devices' connections) because stage 0 owns the connections, the frame ordering, the backlog limits
and the HAT state (μ, g) every reply may carry; one more hop of a reply's rows (a few KB for a decode round) is
cheaper than spreading that state over processes.

Micro-batches in flight: the engine dispatches a micro-batch as soon as stage 0 has run it, up to `max_inflight`
(default P) at once, so while stage 1 runs batch k stage 0 runs batch k + 1. Each stage handles what it receives
in order (one FIFO chain), so a session's pieces, its KV crops (ROLLBACK) and its release (CLOSE) reach every
stage in the order stage 0 issued them: a crop never overtakes the rows it removes.

The parts: the messages and the channels that carry them (app/worker/stage_link.py), which layers each stage runs
(app/worker/layer_placement.py), stages 1..P−1 (app/worker/remote_stage.py), and here stage 0's end of the chain
(`Pipeline`) and the start-up it drives (`start_pipeline`). Stage 0 posts a receive only while a micro-batch is in
flight, and sends a HEARTBEAT down the chain when it has sent nothing for a quarter of `stage_timeout`, so an idle
stage hears from stage 0 well within it; a stage that hears nothing for the whole timeout, or whose peer's
connection closes, exits.

Start-up (stage 0 drives it): every stage loads the model; stage 0 times each middle layer on its own hardware
and threads, then sends a PROBE down the chain so each stage times the same layers on its own; the layer placement
splits the layers over those times within each stage's memory cap; ASSIGN tells every stage its slice, which it
keeps (the other layers are dropped). Stage 0 then checks the whole pipeline against the model's own middle layers
and profiles τ_s(x | y) for every stage from a few passes through it (`profile_chunk_costs`), fitted per stage for
Jupiter's sequence partition (app/worker/prefill_cost.py's `SubsequencePlanner`).

A stage that dies (exits, closes its connection, times out, fails a forward): the pipeline reports a failure
once; the engine answers every frame in flight with an ERROR, closes every session and refuses new ones, and
/health/ready says not ready, so devices migrate as for any worker fault. The other stages exit on their own
(their peer's connection closes). Across hosts (docs/hat.md, "Stages across hosts"): stages 1..P−1 are started by hand
with `tandem worker --stages P --stage-rank s` and the rendezvous address.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.worker.compute import MIN_ROWS, stage_threads, synchronize
from app.worker.layer_placement import (
    StageSlice,
    device_memory,
    gib,
    layer_memory,
    plan_layers,
    stage_memory_caps,
    time_layers,
)
from app.worker.prefill_cost import Point, PrefillCostFit, SubsequencePlanner, fit_stage_costs, profile_points
from app.worker.settings import WorkerSettings
from app.worker.stage_link import (
    PROBE_EXTRA,
    STAGE_DTYPES,
    STOP_GRACE,
    Cmd,
    StageFailure,
    StageLink,
    header,
    short_error,
    sid_ints,
)
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import SplitKVCache

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A message stage 0 expects back from the last stage, in the order it was sent."""

    cmd: Cmd
    batch: int
    callback: Callable[[Any], None]


Result = tuple[list[torch.Tensor], list[float]] | StageFailure  # deep states per row, per-stage seconds


class Pipeline:
    """Stage 0's end of the chain: a sender thread, a receiver thread, the child processes and their health."""

    def __init__(
        self,
        link: StageLink,
        *,
        children: Sequence[subprocess.Popen] = (),
        hidden_size: int,
        dtype: torch.dtype,
        max_inflight: int | None = None,
    ) -> None:
        self.link = link
        self.stages = link.world
        self.children = list(children)
        self.hidden_size = hidden_size
        self.dtype_code = STAGE_DTYPES.index(dtype)
        self.max_inflight = max_inflight or self.stages
        self.bounds: tuple[tuple[int, int], ...] = ()
        self.stage_memory: tuple[float, ...] = ()  # bytes per stage the partition counted (weights + KV reserve)
        self.planner: SubsequencePlanner | None = None
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._outbox: queue.SimpleQueue[list[torch.Tensor] | None] = queue.SimpleQueue()
        self._pending: deque[_Pending] = deque()
        self._pending_ready = threading.Condition()
        self._batch = 0
        self._lock = threading.Lock()
        self._closing = False
        self._threads = [
            threading.Thread(target=self._send_loop, name="stage-send", daemon=True),
            threading.Thread(target=self._recv_loop, name="stage-recv", daemon=True),
            threading.Thread(target=self._watch_children, name="stage-watch", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def inflight(self) -> int:
        return len(self._pending)

    # --- sending (any thread; the sender thread does the blocking sends in order) ---------------------------

    def _expect(self, cmd: Cmd, callback: Callable[[Any], None]) -> int:
        with self._pending_ready:
            self._batch += 1
            self._pending.append(_Pending(cmd, self._batch, callback))
            self._pending_ready.notify()
            return self._batch

    def submit(
        self,
        rows: Sequence[tuple[bytes, int, int]],
        hidden: torch.Tensor,
        stage0_seconds: float,
        callback: Callable[[Result], None],
    ) -> None:
        """Send stage 0's output for `rows` (session id, first position, tokens) down the chain; `callback` gets the
        deep states per row and each stage's compute time (or a StageFailure) on the receiver thread."""
        if self.failure is not None:
            callback(StageFailure(self.failure))
            return
        tokens = int(hidden.shape[0])
        meta = torch.tensor([[*sid_ints(sid), start, n] for sid, start, n in rows], dtype=torch.int64)
        times = torch.zeros(self.stages, dtype=torch.int64)
        times[0] = int(stage0_seconds * 1e9)
        batch = self._expect(Cmd.RESULT, callback)
        head = header(Cmd.FORWARD, batch, len(rows), tokens, self.hidden_size, self.dtype_code)
        self._outbox.put([head, meta, hidden.detach(), times])

    def crop(self, sid: bytes, keep: int) -> None:
        """Every later stage keeps the first `keep` positions of the session (after what was sent before)."""
        self._outbox.put([header(Cmd.CROP, 0, 0, 0, 0, 0, *sid_ints(sid), keep)])

    def release(self, sid: bytes) -> None:
        """Every later stage drops the session's cache."""
        self._outbox.put([header(Cmd.RELEASE, 0, 0, 0, 0, 0, *sid_ints(sid))])

    def _send_loop(self) -> None:
        beat = max(0.05, self.link.timeout.total_seconds() / 4)
        while True:
            try:
                msg = self._outbox.get(timeout=beat)
            except queue.Empty:
                msg = [header(Cmd.HEARTBEAT)]
            if msg is None or self.failure is not None:
                return
            try:
                self.link.send(msg)
            except Exception as e:  # any transport error breaks the chain
                self.fail(f"sending to stage 1 failed: {short_error(e)}")
                return

    # --- receiving -------------------------------------------------------------------------------------------

    def _recv_loop(self) -> None:
        while True:
            with self._pending_ready:
                while not self._pending and not self._closing and self.failure is None:
                    self._pending_ready.wait(0.5)
                if self._closing or self.failure is not None:
                    return
                expected = self._pending[0]
            try:
                head, tensors = self.link.recv_message(from_last=True)
            except Exception as e:
                if not self._closing:
                    self.fail(f"receiving from stage {self.stages - 1} failed: {short_error(e)}")
                return
            cmd, batch = Cmd(int(head[0])), int(head[1])
            if cmd == Cmd.FAILED:
                message = bytes(tensors[0].cpu().numpy()).decode("utf-8", "replace")
                self.fail(message)
                return
            if cmd != expected.cmd or batch != expected.batch:
                self.fail(f"stage {self.stages - 1} answered {cmd.name} {batch}, expected {expected.cmd.name} "
                          f"{expected.batch}")  # fmt: skip
                return
            with self._pending_ready:
                self._pending.popleft()
            if cmd == Cmd.RESULT:
                meta, deep, times = (t.cpu() for t in tensors)
                sizes = [int(n) for n in meta[:, 3]]
                expected.callback((list(deep.split(sizes)), [float(t) / 1e9 for t in times]))
            else:
                expected.callback(tensors[0].cpu())

    # --- health ----------------------------------------------------------------------------------------------

    def _watch_children(self) -> None:
        while not self._closing and self.failure is None:
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None and not self._closing:
                    self.fail(f"stage {rank} (pid {child.pid}) exited with code {code}")
                    return
            time.sleep(0.2)

    def fail(self, reason: str) -> None:
        """Mark the pipeline broken (once): everything in flight fails, then `on_failure` is told."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
        log.error("stage pipeline failed: %s", reason)
        with self._pending_ready:
            pending, self._pending = list(self._pending), deque()
            self._pending_ready.notify_all()
        for p in pending:
            p.callback(StageFailure(reason))
        self._outbox.put(None)
        if self.on_failure is not None:
            self.on_failure(reason)

    def call(self, send: list[torch.Tensor], cmd: Cmd, timeout: float | None = None) -> Any:
        """Send one start-up message and wait for its answer from the last stage (start-up only)."""
        done = threading.Event()
        box: list[Any] = []

        def got(value: Any) -> None:
            box.append(value)
            done.set()

        batch = self._expect(cmd, got)
        send[0][1] = batch
        self._outbox.put(send)
        if not done.wait(timeout or self.link.timeout.total_seconds()):
            self.fail(f"no answer to {cmd.name} within the stage timeout")
            raise StageFailure(self.failure or "timeout")
        if isinstance(box[0], StageFailure):
            raise box[0]
        return box[0]

    def run_sync(self, rows: Sequence[tuple[bytes, int, int]], hidden: torch.Tensor, seconds: float) -> Any:
        done = threading.Event()
        box: list[Result] = []
        self.submit(rows, hidden, seconds, lambda r: (box.append(r), done.set()))
        if not done.wait(self.link.timeout.total_seconds()):
            self.fail("no answer within the stage timeout")
        if not box or isinstance(box[0], StageFailure):
            raise StageFailure(self.failure or "pipeline failed")
        return box[0]

    def stop(self) -> None:
        """STOP down the chain, then make sure every child is gone."""
        with self._lock:
            self._closing = True
        if self.failure is None:
            self._outbox.put([header(Cmd.STOP)])
        self._outbox.put(None)
        with self._pending_ready:
            self._pending_ready.notify_all()
        deadline = time.monotonic() + STOP_GRACE
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.terminate()
                try:
                    child.wait(2)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait(2)
        for t in self._threads:
            t.join(1.0)


# --- start-up ------------------------------------------------------------------------------------------------------


def stage_command(settings: WorkerSettings, rank: int, port: int) -> list[str]:
    """The command line of a local stage process: the same CLI a remote stage runs."""
    cmd = [sys.executable, "-m", "app.cli", "worker", "--model", settings.model, "--m", str(settings.m),
           "--stages", str(settings.stages), "--stage-rank", str(rank), "--master-addr", settings.master_addr,
           "--master-port", str(port), "--device", settings.device]  # fmt: skip
    threads = stage_threads(settings, rank)
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


def start_pipeline(
    model: nn.Module, settings: WorkerSettings, device: torch.device
) -> tuple[Pipeline, StageSlice, list]:
    """Stage 0's start-up: spawn (or wait for) stages 1..P−1, profile and partition the layers, check the
    pipeline against the model's own middle layers, profile τ_s. Returns the pipeline, stage 0's slice and
    (tokens, seconds) observations of whole-middle passes to seed the engine's g."""
    world, m = settings.stages, settings.m
    n_layers = int(model.config.num_hidden_layers)
    if n_layers - m < world:
        raise ValueError(f"{n_layers - m} middle layers cannot fill {world} stages")
    store = StageLink.rendezvous(0, world, settings.master_addr, settings.master_port, settings.stage_timeout)
    children: list[subprocess.Popen] = []
    try:
        if settings.spawn_stages:
            env = {**os.environ, "TANDEM_STAGE_PARENT": str(os.getpid())}
            for rank in range(1, world):
                children.append(subprocess.Popen(stage_command(settings, rank, int(store.port)), env=env))
        link = _join_watching(store, world, settings.stage_timeout, device, children)
        param = next(model.parameters())
        pipeline = Pipeline(
            link, children=children, hidden_size=int(model.config.hidden_size), dtype=param.dtype,
            max_inflight=settings.max_inflight,
        )  # fmt: skip
    except BaseException:
        for child in children:
            child.kill()
        raise
    try:
        return _plan_and_check(pipeline, model, settings, device, n_layers)
    except BaseException:
        pipeline.stop()
        raise


def _join_watching(
    store: Any, world: int, timeout: float, device: torch.device, children: Sequence[subprocess.Popen]
) -> StageLink:
    """Stage 0 joins the process groups while watching the stages it spawned: one that exits (a bad model path,
    no memory) fails the start-up at once instead of after the whole stage timeout."""
    box: list[StageLink | BaseException] = []
    joiner = threading.Thread(
        target=lambda: box.append(_try(lambda: StageLink.join(store, 0, world, timeout, device))), daemon=True
    )
    joiner.start()
    while joiner.is_alive():
        for rank, child in enumerate(children, start=1):
            if child.poll() is not None:
                raise RuntimeError(f"stage {rank} exited with code {child.returncode} before joining the pipeline")
        joiner.join(0.2)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _least(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [[min(x, y) for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as e:  # handed to the waiting thread
        return e


def _plan_and_check(
    pipeline: Pipeline, model: nn.Module, settings: WorkerSettings, device: torch.device, n_layers: int
) -> tuple[Pipeline, StageSlice, list]:
    world, m = settings.stages, settings.m
    timeout = settings.stage_timeout
    # Rounds, stage 0 then the others in turn, keeping each layer's least time: load from other work on the
    # machine comes and goes, and one unlucky window must not make a stage look slow (and starve it of layers).
    times: list[list[float]] | None = None
    layers = n_layers - m
    free, keys = [0] * world, [0] * world
    # stage_probe_rounds = 0: one PROBE without timing (reps 0), for the stages' free memory only; every layer then
    # counts the same on every stage
    for _ in range(max(settings.stage_probe_rounds, 1)):
        reps = 3 if settings.stage_probe_rounds else 0
        own = time_layers(model, m, n_layers, reps=reps)
        probe = torch.zeros(world, layers + PROBE_EXTRA, dtype=torch.int64)
        probe[0] = torch.tensor([*(int(t * 1e9) for t in own), *device_memory(device)])
        got = pipeline.call([header(Cmd.PROBE, 0, 0, 0, 0, 0, 32, reps, layers), probe], Cmd.PROBE, timeout)
        table = [[float(v) / 1e9 for v in row[:layers]] for row in got]
        times = table if times is None else _least(times, table)
        free, keys = [int(v) for v in got[:, layers]], [int(v) for v in got[:, layers + 1]]
    if not settings.stage_probe_rounds:
        times = [[1.0] * layers for _ in range(world)]
    assert times is not None
    caps = stage_memory_caps(settings.stage_memory_gib, free, keys)
    # the worst case the worker admits: every session at the full context (the engine's own bound on max_context)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    context = min(settings.max_context, int(max_pos)) if max_pos else settings.max_context
    memory = layer_memory(model, m, n_layers, settings.max_sessions * context)
    part = plan_layers(times, world, layer_memory=memory, memory_caps=caps)
    bounds = [(s + m, e + m) for s, e in part.bounds]
    pipeline.bounds = tuple(bounds)
    pipeline.stage_memory = part.stage_memory
    shown = caps or [math.inf] * world
    log.info("layer partition over %d stages: %s (per-stage time %s; memory with KV reserve %s)", world, bounds,
             [f"{t * 1e3:.1f} ms" for t in part.stage_times],
             [f"{gib(used)} of {gib(cap)}" for used, cap in zip(part.stage_memory, shown, strict=True)])  # fmt: skip
    assign = torch.tensor(bounds, dtype=torch.int64)
    assigned = header(Cmd.ASSIGN, 0, 0, 0, 0, 0, MIN_ROWS, int(settings.batch_invariant), context)
    pipeline.call([assigned, assign], Cmd.ASSIGN, timeout)

    full = StageSlice(model, m, n_layers)  # the reference for the check, dropped afterwards
    mine = StageSlice(model, *bounds[0])
    mine.to(device)
    ragged = RaggedMiddle(mine.stack, MIN_ROWS, settings.batch_invariant)
    seeds: list[tuple[int, float]] = []
    hidden = int(model.config.hidden_size)
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(9, int(model.config.hidden_size), generator=gen).to(ragged.device, ragged.dtype)
        ref = full.to(device)(x[None])[0]
        sid = (b"\xff" * 8) + os.urandom(8)
        cache = mine.new_cache()
        outs = []
        for start, end in ((0, 8), (8, 9)):
            t0 = time.perf_counter()
            local = ragged.forward([(x[start:end], cache)])[0]
            deep, stage_times = pipeline.run_sync([(sid, start, end - start)], local, time.perf_counter() - t0)
            outs.append(deep[0].to(device))
            seeds.append((end - start, sum(stage_times)))
        pipeline.release(sid)
        diff = float((torch.cat(outs) - ref).abs().max()) / max(1.0, float(ref.abs().max()))
        if not diff <= 1e-3:
            raise RuntimeError(f"the {world}-stage pipeline disagrees with the model's layers (relative {diff:.2e})")
        # the profile unless switched off (prefill_profile None or true): the sequence partition needs τ from the
        # first prompt; without it τ is fitted from the lone pieces the worker runs
        points = [] if settings.prefill_profile is False else profile_chunk_costs(pipeline, ragged, mine, hidden)
    seeds += [(x_, sum(ts)) for x_, _y, ts in points if _y == 0]
    fit = PrefillCostFit(world, fit_stage_costs(points, world) if points else None, profiled=points)
    pipeline.planner = SubsequencePlanner(fit, mode=settings.sequence_partition)
    log.info("τ_s(x | y) per stage: %s", fit.costs if points else "not profiled (fitted from prefill pieces)")
    return pipeline, mine, seeds


def profile_chunk_costs(pipeline: Pipeline, ragged: RaggedMiddle, mine: StageSlice, hidden: int) -> list[Point]:
    """The start-up profile of τ_s(x | y) (app/worker/prefill_cost.py): passes of x tokens after y through the
    pipeline, each stage timing its own part. Returns the points (x, y, seconds per stage)."""
    sid = (b"\xfe" * 8) + os.urandom(8)
    gen = torch.Generator().manual_seed(1)

    def session(y: int) -> Callable[[int], list[float]]:
        cache = mine.new_cache()
        pipeline.release(sid)
        if y:
            _run(pipeline, ragged, cache, sid, torch.randn(y, hidden, generator=gen).to(ragged.device, ragged.dtype))

        def run(x: int) -> list[float]:
            piece = torch.randn(x, hidden, generator=gen).to(ragged.device, ragged.dtype)
            ts = _run(pipeline, ragged, cache, sid, piece)
            cache.crop(y)
            pipeline.crop(sid, y)
            return ts

        return run

    points = profile_points(session)
    pipeline.release(sid)
    return points


def _run(pipeline: Pipeline, ragged: RaggedMiddle, cache: SplitKVCache, sid: bytes, x: torch.Tensor) -> list[float]:
    start = len(cache)
    t0 = time.perf_counter()
    local = ragged.forward([(x, cache)])[0]
    synchronize(ragged.device)
    _deep, times = pipeline.run_sync([(sid, start, int(x.shape[0]))], local, time.perf_counter() - t0)
    return times
