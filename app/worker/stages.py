"""The P-stage HAT worker (`tandem worker --stages P`): the middle layers pipelined across processes.

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

Messages (never pickle): every message starts with a fixed header of HEADER int64 slots, [command, batch id,
rows, tokens, hidden size, dtype code, a, b, c, d]; the tensors that follow have shapes the header fixes:

    FORWARD / RESULT  meta int64 [rows, 4] (session id as two int64, first position, tokens), hidden [tokens,
                      hidden size] in the compute dtype, per-stage compute times int64 [P] (ns)
    FAILED            the failing stage's message, uint8 [a]
    CROP / RELEASE    none: a, b = session id, c = positions to keep
    PROBE             per-layer times int64 [P, L + 2] (ns; then the stage's free device bytes, 0 off CUDA, and a key
                      naming its device, 0 off CUDA), a = tokens, b = repetitions, c = L (start-up profile)
    ASSIGN            the layer bounds int64 [P, 2], a = min_rows, b = batch_invariant (start-up)
    HEARTBEAT / STOP  none

Two process groups carry them: `forward` (s → s + 1) and `back` (P − 1 → 0), so stage 0's sender and receiver
threads never share a channel. Gloo on CPU, NCCL when the stages compute on CUDA with a GPU each (chosen
automatically; gloo with CPU staging otherwise). Every receive has a timeout (`stage_timeout`): stage 0 posts a
receive only while a micro-batch is in flight, and sends a HEARTBEAT down the chain when it has sent nothing for a
quarter of the timeout, so an idle stage hears from stage 0 well within it; a stage that hears nothing for the
whole timeout, or whose peer's connection closes, exits.

Start-up (stage 0 drives it): every stage loads the model; stage 0 times each middle layer on its own hardware
and threads (`time_layers`), then sends a PROBE down the chain so each stage times the same layers on its own;
`policies.jupiter.partition_layers` splits the layers min-max over those times with per-stage speeds (a stage with
twice the threads gets more layers) within each stage's memory cap (`stage_memory_caps`: `stage_memory_gib`, and
on CUDA the stage's share of its GPU's free memory; a layer weighs its parameters plus its KV reserve,
`layer_memory`; no split that fits fails the start-up); ASSIGN tells every stage its slice, which it keeps (the
other layers are dropped). Stage 0 then checks the whole pipeline against the model's own middle layers and
profiles τ_s(x | y) for every stage from a few passes through it (`profile_chunk_costs`), fitted per stage for
Jupiter's sequence partition (`SubsequencePlanner`).

A stage that dies (exits, closes its connection, times out, fails a forward): the pipeline reports a failure
once; the engine answers every frame in flight with an ERROR, closes every session and refuses new ones, and
/health/ready says not ready, so devices migrate as for any worker fault. The other stages exit on their own
(their peer's connection closes). Across hosts: see README (worker section): stages 1..P−1 are started by hand
with `tandem worker --stages P --stage-rank s` and the rendezvous address.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import logging
import math
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.worker.prefill_cost import Point, PrefillCostFit, fit_stage_costs, profile_points
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import LayerStack, SplitKVCache
from policies.jupiter import (
    ChunkCost,
    InfeasiblePlan,
    LayerPartition,
    PlanCache,
    SequenceProfile,
    equal_lengths,
    partition_layers,
    plan_makespan,
)

log = logging.getLogger(__name__)

HEADER = 10
STOP_GRACE = 5.0  # seconds a stage gets to exit after STOP before it is terminated
# How long the stages may take to meet (each loads the model first): apart from `stage_timeout`, which bounds every
# receive once they run. A spawned stage that exits before it joins fails the start-up at once anyway.
JOIN_TIMEOUT = 600.0
PROBE_EXTRA = 2  # PROBE columns after the layer times: free device bytes, device key
# The share of a GPU's free memory (at start-up, before any stage loads its slice there) the layer partition may
# fill: the rest is for a pass's activations and workspace and the allocator's fragmentation.
CUDA_MEMORY_SHARE = 0.9
GIB = 1 << 30


class Cmd(enum.IntEnum):
    HEARTBEAT = 0
    FORWARD = 1
    RESULT = 2
    FAILED = 3
    CROP = 4
    RELEASE = 5
    STOP = 6
    PROBE = 7
    ASSIGN = 8


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class StageFailure(RuntimeError):
    """The pipeline is broken: a stage died, timed out or failed a forward."""


def sid_ints(sid: bytes) -> tuple[int, int]:
    """A 16-byte session id as two int64 (a header or meta row carries it without any encoding step)."""
    return int.from_bytes(sid[:8], "little", signed=True), int.from_bytes(sid[8:16], "little", signed=True)


def header(cmd: Cmd, batch: int = 0, rows: int = 0, tokens: int = 0, hidden: int = 0, dtype: int = 0, *args: int):
    values = [int(cmd), batch, rows, tokens, hidden, dtype, *args]
    if len(values) > HEADER:
        raise ValueError("too many header values")
    return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64)


# --- the channels ----------------------------------------------------------------------------------


@dataclass
class StageLink:
    """One stage's two process groups (forward: s → s + 1; back: P − 1 → 0) and where tensors must live to travel."""

    rank: int
    world: int
    forward: Any
    back: Any
    timeout: datetime.timedelta
    comm_device: torch.device
    store: Any  # kept alive: stage 0 hosts the rendezvous store

    @staticmethod
    def rendezvous(rank: int, world: int, addr: str, port: int, timeout: float) -> Any:
        """The rendezvous store: stage 0 hosts it (port 0 picks a free one: `.port`), the others connect to it."""
        td = datetime.timedelta(seconds=max(timeout, JOIN_TIMEOUT))
        return dist.TCPStore(addr, port, world, rank == 0, timeout=td, wait_for_workers=False)

    @classmethod
    def join(cls, store: Any, rank: int, world: int, timeout: float, compute: torch.device) -> StageLink:
        """Build both process groups (blocks until every stage has joined, at most JOIN_TIMEOUT); receives then wait
        at most `timeout`."""
        td = datetime.timedelta(seconds=max(timeout, JOIN_TIMEOUT))
        nccl = compute.type == "cuda" and dist.is_nccl_available() and torch.cuda.device_count() >= world
        groups = []
        for name in ("forward", "back"):
            prefixed = dist.PrefixStore(name, store)
            if nccl:
                groups.append(dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options()))
            else:
                groups.append(dist.ProcessGroupGloo(prefixed, rank, world, td))
        comm = compute if nccl else torch.device("cpu")
        return cls(rank, world, groups[0], groups[1], datetime.timedelta(seconds=timeout), comm, store)

    @property
    def port(self) -> int:
        return int(self.store.port)

    @property
    def backend(self) -> str:
        return "nccl" if self.comm_device.type == "cuda" else "gloo"

    def _peer(self, towards_next: bool) -> tuple[Any, int]:
        if towards_next and self.rank < self.world - 1:
            return self.forward, self.rank + 1
        if self.rank == self.world - 1:  # the last stage's "next" is stage 0, on the back channel
            return self.back, 0
        raise ValueError(f"stage {self.rank} has no peer there")

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send a message (header first) to the next stage (the last stage sends to stage 0)."""
        group, peer = self._peer(True)
        for t in tensors:
            group.send([t.to(self.comm_device).contiguous()], peer, 0).wait()

    def recv(self, shape: Sequence[int], dtype: torch.dtype, *, from_last: bool = False) -> torch.Tensor:
        """Receive one tensor of a known shape from the previous stage (stage 0: from the last, from_last=True)."""
        t = torch.empty(tuple(shape), dtype=dtype, device=self.comm_device)
        if from_last:
            self.back.recv([t], self.world - 1, 0).wait(self.timeout)
        else:
            self.forward.recv([t], self.rank - 1, 0).wait(self.timeout)
        return t

    def recv_message(self, *, from_last: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A header and the tensors its command says follow it."""
        head = self.recv((HEADER,), torch.int64, from_last=from_last).cpu()
        cmd, _batch, rows, tokens, hidden, dtype, a, _b, c, _d = (int(v) for v in head)
        if cmd in (Cmd.FORWARD, Cmd.RESULT):
            if not (0 <= dtype < len(_DTYPES)) or rows < 1 or tokens < 1 or hidden < 1:
                raise StageFailure(f"bad {Cmd(cmd).name} header {head.tolist()}")
            shapes = [((rows, 4), torch.int64), ((tokens, hidden), _DTYPES[dtype]), ((self.world,), torch.int64)]
        elif cmd == Cmd.FAILED:
            shapes = [((max(a, 0),), torch.uint8)]
        elif cmd == Cmd.PROBE:
            shapes = [((self.world, c + PROBE_EXTRA), torch.int64)]
        elif cmd == Cmd.ASSIGN:
            shapes = [((self.world, 2), torch.int64)]
        elif cmd in (Cmd.HEARTBEAT, Cmd.CROP, Cmd.RELEASE, Cmd.STOP):
            shapes = []
        else:
            raise StageFailure(f"unknown stage command {cmd}")
        return head, [self.recv(s, dt, from_last=from_last) for s, dt in shapes]


# --- profiling (every stage, on its own hardware and threads) ---------------------------------------------------


def time_layers(model: nn.Module, start: int, end: int, *, tokens: int = 32, reps: int = 5) -> list[float]:
    """Seconds of each decoder layer in [start, end) on `tokens` new positions (the worker's own forward): the least
    of `reps` runs, since other work on the machine only ever adds time. reps = 0: no timing (zeros)."""
    if reps < 1:
        return [0.0] * (end - start)
    hidden = int(model.config.hidden_size)
    out = []
    with torch.inference_mode():
        for i in range(start, end):
            stack = LayerStack.from_model(model, i, i + 1)
            ragged = RaggedMiddle(stack)
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(i)).to(ragged.device, ragged.dtype)
            ragged.forward([(x, stack.new_cache())])  # warm-up
            times = []
            for _ in range(reps):
                cache = stack.new_cache()
                t0 = time.perf_counter()
                ragged.forward([(x, cache)])
                _sync(ragged.device)
                times.append(time.perf_counter() - t0)
            out.append(min(times))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageSlice(nn.Module):
    """Layers [start, end) of the model as the engine's "middle": what one stage runs, with its own caches."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.stack = LayerStack.from_model(model, start, end)

    def new_cache(self) -> SplitKVCache:
        return self.stack.new_cache()

    def forward(self, hidden: torch.Tensor, cache: SplitKVCache | None = None) -> torch.Tensor:
        return self.stack.run(hidden, cache)


def plan_layers(
    times: Sequence[Sequence[float]],
    stages: int,
    *,
    layer_memory: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
) -> LayerPartition:
    """Jupiter's layer partition from each stage's own timing of every middle layer: stage 0's times are the
    reference, a stage's speed is stage 0's total over its own (policies.jupiter.partition_layers), each stage's
    layers within its memory cap (bytes; `layer_memory`: bytes per layer). InfeasiblePlan when no split fits: the
    message names every stage's cap and the layers' bytes."""
    reference = list(times[0])
    total = sum(reference)
    speeds = [total / max(sum(row), 1e-12) for row in times]
    try:
        return partition_layers(reference, stages, speeds=speeds, layer_memory=layer_memory, memory_caps=memory_caps)
    except InfeasiblePlan as e:
        if layer_memory is None or memory_caps is None:
            raise
        caps = ", ".join(f"stage {s} {_gib(c)}" for s, c in enumerate(memory_caps))
        raise InfeasiblePlan(
            f"the {len(reference)} middle layers ({_gib(sum(layer_memory))} in all, {_gib(min(layer_memory))} to "
            f"{_gib(max(layer_memory))} per layer with its KV reserve) do not fit the stages' memory caps ({caps}): {e}"
        ) from None


def layer_memory(model: nn.Module, start: int, end: int, kv_positions: int) -> list[int]:
    """Bytes each decoder layer in [start, end) holds on its stage: its parameters (exact) plus a KV reserve of
    `kv_positions` cached positions (keys and values in the parameters' dtype, the layer's own k/v widths). The
    reserve is the worst case the worker admits (max_sessions x max_context), so a split that fits cannot run out
    of memory later because sessions filled their caches; activations are left to the caps' headroom."""
    layers = _decoder_layers(model)
    out = []
    for i in range(start, end):
        layer = layers[i]
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        attn = layer.self_attn
        kv_width = int(attn.k_proj.out_features) + int(attn.v_proj.out_features)
        itemsize = attn.k_proj.weight.element_size()
        out.append(params + kv_positions * kv_width * itemsize)
    return out


def _decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    inner = getattr(model, "model", model)
    return inner.layers  # type: ignore[return-value]


def stage_memory_caps(
    configured_gib: Sequence[float] | None, free_bytes: Sequence[int], device_keys: Sequence[int]
) -> list[float] | None:
    """Each stage's memory cap (bytes) for the layer partition: the configured cap (GiB), and on a GPU at most
    CUDA_MEMORY_SHARE of the free memory it reported, split evenly between the stages that reported the same device
    (several stages on one GPU share it). free_bytes[s] = 0: not on CUDA (no device limit). None: no caps at all."""
    stages = len(free_bytes)
    sharing: dict[int, int] = {}
    for key in device_keys:
        if key:
            sharing[key] = sharing.get(key, 0) + 1
    caps = []
    for s in range(stages):
        cap = math.inf if configured_gib is None else float(configured_gib[s]) * GIB
        if free_bytes[s] > 0 and device_keys[s]:
            cap = min(cap, CUDA_MEMORY_SHARE * free_bytes[s] / sharing[device_keys[s]])
        caps.append(cap)
    return None if all(math.isinf(c) for c in caps) else caps


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free bytes, a key naming the device) for PROBE replies: (0, 0) off CUDA. The key is the GPU's UUID hashed to
    63 bits, so stages on different hosts never collide and stages sharing one GPU report the same key."""
    if device.type != "cuda":
        return 0, 0
    free, _total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    name = str(getattr(props, "uuid", "") or f"{socket.gethostname()}:{device.index}")
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
    return int(free), key or 1


def _gib(n: float) -> str:
    return "no cap" if math.isinf(n) else f"{n / GIB:.2f} GiB"


# --- sequence partition -------------------------------------------------------------------------------------------


@dataclass
class SubsequencePlanner:
    """Splits a prefill piece of n tokens after `context` cached ones into sub-sequences for the pipeline.

    mode "dp": Jupiter's sequence partition (policies.jupiter.plan_sequence, exact flow-shop makespan) on the
    per-stage costs τ_s (`fit`, app/worker/prefill_cost.py: the start-up profile refitted from the lone prefill
    pieces the worker runs; one piece while τ is undetermined); "equal": equal lengths, the count with the least
    modelled makespan; "off": one piece. τ_s(x | context + y) = a + (b + c·context)·x + c·x·y + d·x², so a piece after
    `context` tokens is planned as a prompt from 0 with b shifted; the context is rounded to `context_step` so plans
    are reused (an LRU per profile, dropped when τ is refitted).
    """

    fit: PrefillCostFit
    mode: str = "dp"
    min_len: int = 16
    granularity: int = 16
    context_step: int = 64
    cache: PlanCache = field(default_factory=lambda: PlanCache(256))
    _planned_on: int = 0  # the fit's version the cached plans were made on

    @property
    def costs(self) -> tuple[ChunkCost, ...] | None:
        return self.fit.costs

    def observe(self, x: int, y: int, seconds: Sequence[float]) -> None:
        """A prefill piece of x tokens after y ran alone through the pipeline: seconds[s] on stage s."""
        self.fit.observe(x, y, seconds)

    def profile(self, context: int) -> SequenceProfile:
        if self.fit.costs is None:
            raise ValueError("τ is not determined yet")
        y0 = self.context_step * round(context / self.context_step)
        shifted = tuple(ChunkCost(c.a, c.b + c.c * y0, c.c, c.d) for c in self.fit.costs)
        return SequenceProfile(stages=shifted, min_len=self.min_len, granularity=self.granularity)

    def lengths(self, n: int, context: int) -> list[int]:
        if self.mode == "off" or n < 2 * self.min_len or self.fit.costs is None:
            return [n]
        if self._planned_on != self.fit.version:
            self.cache = PlanCache(self.cache.maxsize)
            self._planned_on = self.fit.version
        profile = self.profile(context)
        if self.mode == "equal":
            best, best_value = [n], math.inf
            for parts in range(1, n // self.min_len + 1):
                lengths = equal_lengths(n, parts, self.granularity)
                if min(lengths) < self.min_len:
                    break
                value = plan_makespan(profile.stages, lengths)
                if value < best_value:
                    best, best_value = lengths, value
            return best
        return list(self.cache.plan(profile, n).lengths)


# --- stage 0's side of the pipeline ------------------------------------------------------------------------------


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
        self.dtype_code = _DTYPES.index(dtype)
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
                self.fail(f"sending to stage 1 failed: {_short(e)}")
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
                    self.fail(f"receiving from stage {self.stages - 1} failed: {_short(e)}")
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


def stage_command(settings: Any, rank: int, port: int) -> list[str]:
    """The command line of a local stage process: the same CLI a remote stage runs."""
    cmd = [sys.executable, "-m", "app.cli", "worker", "--model", settings.model, "--m", str(settings.m),
           "--stages", str(settings.stages), "--stage-rank", str(rank), "--master-addr", settings.master_addr,
           "--master-port", str(port), "--device", settings.device]  # fmt: skip
    threads = stage_threads(settings, rank)
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


def stage_threads(settings: Any, rank: int) -> int | None:
    if settings.stage_threads:
        return int(settings.stage_threads[rank])
    return settings.num_threads


def start_pipeline(model: nn.Module, settings: Any, device: torch.device) -> tuple[Pipeline, StageSlice, list]:
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
    pipeline: Pipeline, model: nn.Module, settings: Any, device: torch.device, n_layers: int
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
             [f"{_gib(used)} of {_gib(cap)}" for used, cap in zip(part.stage_memory, shown, strict=True)])  # fmt: skip
    limits_rows, invariant = 4, int(settings.batch_invariant)
    assign = torch.tensor(bounds, dtype=torch.int64)
    pipeline.call([header(Cmd.ASSIGN, 0, 0, 0, 0, 0, limits_rows, invariant), assign], Cmd.ASSIGN, timeout)

    full = StageSlice(model, m, n_layers)  # the reference for the check, dropped afterwards
    mine = StageSlice(model, *bounds[0])
    mine.to(device)
    ragged = RaggedMiddle(mine.stack, limits_rows, settings.batch_invariant)
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
        # first prompt; without it τ is fitted from the lone prefill pieces the worker runs
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
    _sync(ragged.device)
    _deep, times = pipeline.run_sync([(sid, start, int(x.shape[0]))], local, time.perf_counter() - t0)
    return times


# --- stages 1..P−1 ------------------------------------------------------------------------------------------------


def serve_stage(settings: Any, rank: int) -> int:
    """Run stage `rank` (>= 1) until STOP or until its peers are gone. Returns the exit status."""
    from app.worker.server import compute_device
    from clients.hf_model import load_hf_model
    from deploy.models import resolve_model

    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s stage {rank}: %(message)s")
    threads = stage_threads(settings, rank)
    if threads:
        torch.set_num_threads(threads)
    _watch_parent()
    device = compute_device(settings.device)
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    model, _tok = load_hf_model(resolve_model(settings.model))
    store = StageLink.rendezvous(rank, settings.stages, settings.master_addr, settings.master_port,
                                 settings.stage_timeout)  # fmt: skip
    link = StageLink.join(store, rank, settings.stages, settings.stage_timeout, device)
    log.info("stage %d of %d connected (%s)", rank, settings.stages, link.backend)
    stage = _Stage(link, model, settings.m, device)
    del model
    try:
        return stage.run()
    except Exception as e:
        log.error("stage %d stops: %s", rank, _short(e))
        return 1


class _Stage:
    def __init__(self, link: StageLink, model: nn.Module, m: int, device: torch.device) -> None:
        self.link = link
        self.model: nn.Module | None = model
        self.m = m
        self.device = device
        self.last = link.rank == link.world - 1
        self.ragged: RaggedMiddle | None = None
        self.stack: LayerStack | None = None
        self.caches: dict[tuple[int, int], SplitKVCache] = {}
        self.outbox: queue.SimpleQueue[list[torch.Tensor] | None] = queue.SimpleQueue()
        self.send_error: str | None = None
        self.sender = threading.Thread(target=self._send_loop, name="stage-send", daemon=True)

    def _send_loop(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self.link.send(msg)
            except Exception as e:
                self.send_error = _short(e)
                return

    def pass_on(self, msg: list[torch.Tensor]) -> None:
        if self.send_error is not None:
            raise StageFailure(f"sending failed: {self.send_error}")
        self.outbox.put(msg)

    def run(self) -> int:
        self.sender.start()
        try:
            while True:
                head, tensors = self.link.recv_message()
                cmd = Cmd(int(head[0]))
                if cmd == Cmd.STOP:
                    if not self.last:
                        self.pass_on([head])
                    return 0
                self.handle(cmd, head, tensors)
        finally:
            self.outbox.put(None)
            self.sender.join(STOP_GRACE)

    def handle(self, cmd: Cmd, head: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        rank = self.link.rank
        if cmd == Cmd.FORWARD:
            try:
                out, elapsed = self.forward(tensors[0], tensors[1])
            except Exception as e:  # reported to stage 0, which fails the pipeline
                log.exception("stage %d forward failed", rank)
                msg = f"stage {rank} forward failed: {_short(e)}".encode()
                self.pass_on([header(Cmd.FAILED, int(head[1]), 0, 0, 0, 0, len(msg)),
                              torch.frombuffer(bytearray(msg), dtype=torch.uint8)])  # fmt: skip
                return
            times = tensors[2].clone()
            times[rank] = int(elapsed * 1e9)
            head = head.clone()
            head[0] = Cmd.RESULT if self.last else Cmd.FORWARD
            self.pass_on([head, tensors[0], out, times])
        elif cmd in (Cmd.CROP, Cmd.RELEASE):
            key = (int(head[6]), int(head[7]))
            if cmd == Cmd.RELEASE:
                self.caches.pop(key, None)
            elif key in self.caches:
                self.caches[key].crop(int(head[8]))
            if not self.last:
                self.pass_on([head])
        elif cmd == Cmd.PROBE:
            assert self.model is not None
            layers = int(head[8])
            own = time_layers(self.model, self.m, self.m + layers, tokens=int(head[6]), reps=int(head[7]))
            table = tensors[0].clone()
            table[rank] = torch.tensor([*(int(t * 1e9) for t in own), *device_memory(self.device)])
            self.pass_on([head, table])
        elif cmd == Cmd.ASSIGN:
            assert self.model is not None
            start, end = (int(v) for v in tensors[0][rank])
            self.stack = LayerStack.from_model(self.model, start, end).to(self.device)
            self.ragged = RaggedMiddle(self.stack, int(head[6]), bool(head[7]))
            self.model = None  # only this stage's layers stay referenced
            log.info("stage %d runs layers %d..%d", rank, start, end - 1)
            self.pass_on([head, tensors[0]])
        elif cmd == Cmd.FAILED:
            self.pass_on([head, *tensors])
        elif cmd == Cmd.HEARTBEAT:
            if not self.last:
                self.pass_on([head])

    def forward(self, meta: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.ragged is None or self.stack is None:
            raise StageFailure("FORWARD before ASSIGN")
        t0 = time.perf_counter()
        rows, start = [], 0
        for hi, lo, first, n in meta.tolist():
            cache = self.caches.get((hi, lo))
            if cache is None:
                cache = self.caches[(hi, lo)] = self.stack.new_cache()
            if len(cache) != first:
                raise StageFailure(f"session rows start at {first} but this stage's cache holds {len(cache)}")
            rows.append((hidden[start : start + n], cache))
            start += n
        with torch.inference_mode():
            outs = self.ragged.forward(rows)
            _sync(self.ragged.device)
        return torch.cat(outs), time.perf_counter() - t0


def _watch_parent() -> None:
    """A stage that stage 0 spawned exits when stage 0 is gone (no orphans, even after a SIGKILL)."""
    parent = os.environ.get("TANDEM_STAGE_PARENT")
    if not parent:
        return
    pid = int(parent)

    def watch() -> None:
        while True:
            if os.getppid() != pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="stage-parent", daemon=True).start()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]
