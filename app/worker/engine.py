"""HAT worker engine: device sessions, their middle-submodel KV caches, and continuous batching.

One engine serves many device sessions. Each session owns a KV cache of the middle submodel (layers m..n-1) and
speaks the frame protocol of clients/hat/wire.py:

    device -> worker                                  worker -> device
    OPEN           JSON parameters (no user data)     OPEN           JSON session info (id, limits, g, mu, τ)
    PREFILL_CHUNK  shallow states, arg = 1st pos      DEEP_STATE     deep state of the chunk's last position
    DRAFT          shallow states, arg = 1st pos      VERIFY_RESULT  deep states of every drafted position,
                                                                     after a STATUS (mu, g) when those moved by
                                                                     more than limits.status_tolerance
    ROLLBACK       arg = positions to keep            (nothing; ERROR if it cannot be applied)
    TREE           parent indices of the next DRAFT   (nothing; the DRAFT's rows are a token tree: node i at position
                   (a token tree), arg = 1st pos       arg + depth(i), seeing the cache and its own ancestors)
    KEEP           the tree's accepted path (node     (nothing; ERROR if it is not a path from the root)
                   indices), arg = the tree's 1st pos
    CLOSE                                             (nothing)
                                                      ERROR          UTF-8 message, arg = HTTP-like status

Ordering: device frames carry consecutive sequence numbers (OPEN is 0). The engine applies a session's frames in
seq order even when they arrive out of order (the POST transport may run several requests at once) and replies
with the request's seq. A frame that fails validation still uses up its seq (its reply is an ERROR), so a device
is never stuck behind its own bad frame. Tensor frames must start exactly at the cache's length: positions are
contiguous and rejected drafts are removed with an explicit ROLLBACK.

Limits (EngineLimits; the arrival checks are app/worker/sessions.py's) fail one frame or one session with an
ERROR naming the limit, never another session: max sessions (503 on OPEN), max context (413, nothing appended),
per-session idle timeout (408, session dropped), frame size (413), kind/dtype/shape against the model (400),
non-finite values (400), positions and sequence numbers (409).

Batching (continuous, "ragged"): every tick the engine thread takes the next tensor frame of every session that
has one pending and runs a group of them through the middle layers in ONE forward pass. `batching = "greedy"`: all of
them, up to max_batch_tokens. `batching = "planned"` (default): prefill frames longer than a budget derived from the
fitted delay predictor g are cut into consecutive sub-chunks (exact with the KV cache), the pending pieces are sorted
shortest first and grouped by policies/worker_batching.plan_groups (least mean completion time under g), and only
the first group runs; the rest are re-planned next tick with whatever arrived meanwhile. A verification round so
waits behind at most the one pass already running. Passes are ragged (clients/hat/ragged.py: packed rows, attention
per session, each row's result independent of its neighbours). That forward is checked against the model's own
layers at start-up (`self_check`), so an unsupported layer layout fails loudly instead of computing garbage.

Threading: all model calls run on one dedicated engine thread under torch.inference_mode(); the event loop only
validates frames and hands them over (`submit` returns a concurrent Future of the reply frames).

Stages (`tandem worker --stages P`, app/worker/pipeline.py): `middle` is then stage 0's slice of the layers. A pass
runs here, then goes down the pipeline (`Pipeline.submit`); its deep states come back to the engine thread as an
inbox message and the replies go out then. A frame's rows are `done` once stage 0 ran them (the session's next frame
may follow at once: a prompt's chunks flow through the stages one behind the other) and `finished` once they came
back. At most `max_inflight` passes are in flight; ROLLBACK and CLOSE follow the same chain (crop / release). In
planned batching, stage 0 cuts each prefill frame at the ends of its Jupiter plan (policies/jupiter.py's sequence
partition over the stages' τ_s) so a lone long prompt keeps every stage busy. A broken pipeline fails every session
with an ERROR (503) and refuses new ones.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from app.worker.prefill_cost import PrefillCostFit, profile_points
from app.worker.sessions import (
    PROTOCOL,
    EngineError,
    EngineLimits,
    Item,
    Reason,
    Session,
    check_frame,
    check_positions,
    parse_open,
)
from clients.hat import wire
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import MiddleSubmodel
from policies.drafting import DelayPredictor
from policies.estimate import MovingAverage
from policies.trees import is_root_path
from policies.worker_batching import plan_groups, split_sizes, subchunk_tokens

if TYPE_CHECKING:
    from app.worker.pipeline import Pipeline

log = logging.getLogger(__name__)

# --- the engine ------------------------------------------------------------------------------------


@dataclass
class EngineStats:
    """Counters and HAT state monitoring (Eqs. 1-2). Written on the engine thread, read anywhere."""

    mu: MovingAverage = field(default_factory=MovingAverage)  # batched tokens per forward
    eta: MovingAverage = field(default_factory=MovingAverage)  # compute delay per forward (s)
    g: DelayPredictor = field(default_factory=DelayPredictor)  # predicted delay of a batch of x tokens
    forwards: int = 0
    batched_forwards: int = 0  # forwards that carried >= 2 sessions
    max_rows: int = 0
    last_rows: int = 0
    tokens: int = 0
    frames: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    sessions_opened: int = 0
    sessions_expired: int = 0
    # Planned batching (policies/worker_batching.py)
    planned_passes: int = 0  # passes chosen by the planner
    planned_groups: int = 0  # groups in those plans (1 = everything pending ran together)
    deferred_frames: int = 0  # times a pending frame was left for a later pass
    forced_frames: int = 0  # times a frame went in because it had been left out max_defer times
    split_frames: int = 0  # prefill frames split into sub-chunks
    subchunk_passes: int = 0  # sub-chunks run (pieces of split frames)
    subchunk_budget: int = 0  # the current sub-chunk size from g (tokens)
    status_frames: int = 0  # STATUS frames sent mid-session (mu and g moved since the device was told)
    stage_seconds: list[float] = field(default_factory=list)  # staged worker: compute seconds so far, per stage


FrameHook = Callable[[bytes | None, bytes], None]


class Engine:
    """Sessions + one engine thread running batched middle forwards. Thread-safe entry points: open, submit, close."""

    def __init__(
        self,
        middle: MiddleSubmodel,
        limits: EngineLimits | None = None,
        *,
        model_name: str = "",
        frame_hook: FrameHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        pipeline: Pipeline | None = None,
    ) -> None:
        stack = middle.stack
        cfg = stack.config
        self.middle = middle
        self.limits = limits or EngineLimits()
        self.model_name = model_name
        self.hidden_size = int(cfg.hidden_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.m = stack.layer_range.start
        max_pos = getattr(cfg, "max_position_embeddings", None)
        self.max_context = min(self.limits.max_context, int(max_pos)) if max_pos else self.limits.max_context
        context_bytes = self.max_context * self.hidden_size * self.limits.wire_dtype.itemsize
        self.limits = replace(
            self.limits,
            max_frame_bytes=self.limits.max_frame_bytes or context_bytes,
            max_session_bytes=self.limits.max_session_bytes or context_bytes * 5 // 4,
        )
        self.wire_dtype = self.limits.wire_dtype
        self.wire_dtype_name = wire.dtype_name(self.wire_dtype)
        self.ragged = RaggedMiddle(stack, self.limits.min_rows, self.limits.batch_invariant)
        self.frame_hook = frame_hook
        self.clock = clock
        self.stats = EngineStats()
        self._sessions: dict[bytes, Session] = {}
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._ready: OrderedDict[bytes, Session] = OrderedDict()  # engine thread: sessions with queued frames
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.started = False
        # A staged worker (app/worker/pipeline.py): `middle` is stage 0's slice and the pipeline runs the rest.
        self.pipeline = pipeline
        self.failed: str | None = None  # why the pipeline broke (the worker is then not ready)
        if pipeline is not None:
            pipeline.on_failure = lambda reason: self._inbox.put(("failed", reason))
        # τ_s(x | y), the prefill cost per stage (app/worker/prefill_cost.py): told to devices at OPEN; a staged
        # worker's is its sequence partition's
        self.prefill_cost = (
            pipeline.planner.fit
            if pipeline is not None and pipeline.planner is not None
            else PrefillCostFit(self.stages)
        )

    # --- lifecycle (any thread) -------------------------------------------------------------------

    def start(self, self_check: bool = True) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hat-engine", daemon=True)
        self._thread.start()
        if self_check:
            self.call(self.self_check).result()
        self.started = True

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.pipeline is not None:
            self.pipeline.stop()
        self.started = False

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine thread (tests, warm-up)."""
        fut: Future[Any] = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    @property
    def stages(self) -> int:
        """HAT's pipeline length P: the processes the middle layers are spread over."""
        return 1 if self.pipeline is None else self.pipeline.stages

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def session(self, sid: bytes | str) -> Session | None:
        try:
            key = bytes.fromhex(sid) if isinstance(sid, str) else sid
        except ValueError:
            return None
        return self._sessions.get(key)

    def info(self) -> dict[str, Any]:
        slope, intercept = self.stats.g.coefficients()
        return {
            "model": self.model_name,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "m": self.m,
            "dtype": self.wire_dtype_name,
            "compute_device": str(self.ragged.device),
            "sessions": self.session_count,
            "max_sessions": self.limits.max_sessions,
            "max_context": self.max_context,
            "mu": self.stats.mu.get(),
            "eta": self.stats.eta.get(),
            "g": [slope, intercept],
            "forwards": self.stats.forwards,
            "batched_forwards": self.stats.batched_forwards,
            "pipeline": self.stages,
            # Token trees need every stage to apply tree masks and KEEP; the stages' pipeline carries neither yet.
            "trees": self.pipeline is None,
            "stage_layers": [list(b) for b in self.pipeline.bounds] if self.pipeline is not None else None,
            # τ_s(x | y) = a + b·x + c·x·y + d·x² per stage (seconds), null until determined: the devices' DP chunks
            "prefill_tau": self.prefill_cost.wire(),
        }

    def count_rejection(self, reason: Reason) -> None:
        with self._stats_lock:  # called from the event loop and the engine thread
            self.stats.rejected[reason.value] = self.stats.rejected.get(reason.value, 0) + 1

    # --- sessions (event-loop side) ---------------------------------------------------------------

    def open(self, data: bytes) -> tuple[Session, bytes]:
        """Validate an OPEN frame and create a session; returns it and the OPEN reply frame. Raises EngineError."""
        if self.frame_hook is not None:
            self.frame_hook(None, bytes(data))
        try:
            params = parse_open(data, self.hidden_size, self.num_layers, self.m, self.wire_dtype_name)
        except EngineError as e:
            self.count_rejection(e.reason)
            raise
        now = self.clock()
        with self._lock:
            if self.failed is not None:
                self.count_rejection(Reason.STAGE)
                raise EngineError(503, Reason.STAGE, f"worker not ready: {self.failed}")
            if len(self._sessions) >= self.limits.max_sessions:
                self.count_rejection(Reason.FULL)
                raise EngineError(
                    503, Reason.FULL, f"worker is serving its maximum of {self.limits.max_sessions} sessions"
                )
            sid = uuid.uuid4().bytes
            session = Session(sid, self.middle.new_cache(), params, created=now, last_active=now)
            self._sessions[sid] = session
            self.stats.sessions_opened += 1
        reply = dict(self.info(), session=session.hex, protocol=PROTOCOL)
        session.told = (float(reply["mu"]), *(float(x) for x in reply["g"]))
        reply.update(max_frame_bytes=self.limits.max_frame_bytes, idle_timeout=self.limits.idle_timeout)
        return session, wire.encode_text(wire.Kind.OPEN, sid, 0, json.dumps(reply))

    def close(self, session: Session, reason: str = "closed") -> None:
        """Drop a session (connection gone, CLOSE, expiry). Idempotent; its cache is freed on the engine thread."""
        with self._lock:
            if self._sessions.pop(session.id, None) is None:
                return
        session.close_reason = reason
        held, session.held = list(session.held.values()), {}
        for item in held:
            _resolve(item.future, [])
        self._inbox.put(("close", session))

    def submit(self, session: Session, data: bytes) -> Future[list[bytes]]:
        """Hand one device frame to the engine. The future resolves to the reply frames (maybe none, maybe ERROR)."""
        fut: Future[list[bytes]] = Future()
        data = bytes(data)
        if self.frame_hook is not None:
            self.frame_hook(session.id, data)
        session.last_active = self.clock()
        seq = wire.peek_seq(data)
        if session.id not in self._sessions:
            _resolve(fut, [self._error(session.id, seq or 0, EngineError(410, Reason.CLOSED, _gone(session)))])
            return fut
        limit: int = self.limits.max_frame_bytes  # type: ignore[assignment]
        frame, tensor, err = check_frame(session, data, limit, self.hidden_size, self.wire_dtype)
        if err is not None:
            self.count_rejection(err.reason)
        if frame is not None:
            seq = frame.seq
        if seq is None:  # not even a header: no seq to account for
            _resolve(fut, [self._error(session.id, 0, err)])  # type: ignore[arg-type]
            return fut
        if seq < session.expected_seq or seq in session.held:
            used = f"frame seq {seq} was already used; next expected {session.expected_seq}"
            dup = EngineError(409, Reason.SEQ, used)
            self.count_rejection(Reason.SEQ)
            _resolve(fut, [self._error(session.id, seq, dup)])
            return fut
        if seq - session.expected_seq > self.limits.max_reorder:
            far = EngineError(
                409, Reason.SEQ, f"frame seq {seq} is too far ahead of the next expected {session.expected_seq}"
            )
            self.count_rejection(Reason.SEQ)
            _resolve(fut, [self._error(session.id, seq, far)])
            return fut
        if err is None and frame is not None and frame.kind == wire.Kind.CLOSE:
            # Applied at once, wherever it falls in the sequence: a close must not wait behind a gap.
            _resolve(fut, [])
            self.close(session, "closed by the device")
            return fut
        if err is None:
            err = self._admit(session, len(data), fut)
        if err is not None:
            _resolve(fut, [self._error(session.id, seq, err)])
            frame = tensor = None
        else:
            assert frame is not None
            self.stats.frames[frame.kind.name] = self.stats.frames.get(frame.kind.name, 0) + 1
        session.held[seq] = Item(session, seq, frame, tensor, fut)
        released: list[Item] = []
        while session.expected_seq in session.held:
            item = session.held.pop(session.expected_seq)
            session.expected_seq += 1
            if item.frame is not None:
                released.append(item)
        for item in released:
            self._inbox.put(("frame", item))
        return fut

    def _admit(self, session: Session, size: int, fut: Future[list[bytes]]) -> EngineError | None:
        """Count a frame against its session's backlog until it is answered; an error when the backlog is full."""
        limits = self.limits
        with self._pending_lock:
            frames, waiting = session.waiting_frames + 1, session.waiting_bytes + size
            full = frames > limits.max_session_frames or waiting > limits.max_session_bytes  # type: ignore[operator]
            if not full:
                session.waiting_frames, session.waiting_bytes = frames, waiting
        if full:
            self.count_rejection(Reason.BACKLOG)
            return EngineError(
                429,
                Reason.BACKLOG,
                f"session has {session.waiting_frames} frames ({session.waiting_bytes} bytes) waiting; the limit is "
                f"{limits.max_session_frames} frames and {limits.max_session_bytes} bytes: wait for replies",
            )

        def answered(_: Future) -> None:
            with self._pending_lock:
                session.waiting_frames -= 1
                session.waiting_bytes -= size

        fut.add_done_callback(answered)
        return None

    def _error(self, sid: bytes, seq: int, err: EngineError) -> bytes:
        return wire.encode_error(sid, seq, f"{err.reason.value}: {err.message}", err.status)

    # --- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        tick = max(0.01, min(0.5, self.limits.idle_timeout / 4))
        while not self._stopping:
            try:
                idle = not self._ready or self._pipeline_full()
                item = self._inbox.get(timeout=tick) if idle else self._inbox.get_nowait()
                self._take(item)
                while True:
                    self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stopping:
                break
            self._expire_idle()
            if self._pipeline_full():
                continue  # every stage has work: wait for a micro-batch to come back
            try:
                batch = self._collect()
                if batch:
                    self._forward(batch)
            except Exception:  # never let the engine thread die
                log.exception("engine tick failed")
        self._drain_on_stop()

    def _pipeline_full(self) -> bool:
        return self.pipeline is not None and self.pipeline.inflight >= self.pipeline.max_inflight

    def _take(self, msg: tuple[str, Any]) -> None:
        kind, obj = msg
        if kind == "result":
            batch, result = obj
            self._finish_staged(batch, result)
        elif kind == "failed":
            self._fail_stages(obj)
        elif kind == "frame":
            item: Item = obj
            if item.session.closed or item.session.id not in self._sessions:
                _resolve(item.future, [])
                return
            item.session.queue.append(item)
            self._ready[item.session.id] = item.session
        elif kind == "close":
            self._drop(obj)
        elif kind == "call":
            fn, fut = obj
            if fut.set_running_or_notify_cancel():
                try:
                    with torch.inference_mode():
                        fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
        elif kind == "stop":
            self._stopping = True

    def _drop(self, session: Session) -> None:
        session.closed = True
        for item in session.queue:
            _resolve(item.future, [])
        session.queue.clear()
        session.cache.reset()
        self._ready.pop(session.id, None)
        if self.pipeline is not None:
            self.pipeline.release(session.id)

    def _drain_on_stop(self) -> None:
        for session in list(self._sessions.values()):
            self._drop(session)
        while True:
            try:
                kind, obj = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "frame":
                _resolve(obj.future, [])
            elif kind == "call":
                obj[1].cancel()

    def _expire_idle(self) -> None:
        limit = self.limits.idle_timeout
        now = self.clock()
        for session in list(self._sessions.values()):
            # Frames held behind a sequence gap do not keep a session alive: a gap nobody fills is idleness too.
            if session.queue or now - session.last_active <= limit:
                continue
            self.stats.sessions_expired += 1
            self.count_rejection(Reason.IDLE)
            self.close(session, f"idle for more than {limit:g} s")
            self._drop(session)
            if session.on_expire is not None:
                with contextlib.suppress(Exception):
                    session.on_expire(f"{Reason.IDLE.value}: session idle for more than {limit:g} s; closed", 408)

    def _collect(self) -> list[tuple[Item, int]]:
        """Apply control frames, then choose this pass's (frame, rows) pieces by the configured batching."""
        if self.limits.batching == "planned":
            return self._collect_planned()
        return [(item, int(item.tensor.shape[0])) for item in self._collect_greedy()]  # type: ignore[union-attr]

    def _collect_planned(self) -> list[tuple[Item, int]]:
        """One candidate piece per session (a sub-chunk for a long prefill frame); run the plan's first group."""
        slope, intercept = self.stats.g.coefficients()
        limits = self.limits
        budget = subchunk_tokens(
            slope,
            intercept,
            overhead=limits.subchunk_overhead,
            min_tokens=limits.min_subchunk,
            max_tokens=limits.max_batch_tokens,
        )
        self.stats.subchunk_budget = budget
        pieces: list[tuple[Item, int]] = []
        for sid in list(self._ready):
            session = self._ready.get(sid)
            if session is None:
                continue
            item = self._next_tensor_frame(session)
            if item is not None:
                rows = remaining = int(item.tensor.shape[0]) - item.done  # type: ignore[union-attr]
                prefill = item.frame.kind == wire.Kind.PREFILL_CHUNK
                if prefill and self.pipeline is not None and self.pipeline.planner is not None:
                    rows = self._next_subsequence(item)
                # Split only when another session could be waiting behind it: alone, a device gains nothing from
                # sub-chunks and would pay their passes' fixed cost (up to `subchunk_overhead` of its TTFT).
                if prefill and rows > budget and len(self._sessions) > 1:
                    rows = split_sizes(rows, budget)[0]
                pieces.append((item, rows))
            if not session.queue:
                self._ready.pop(sid, None)
        if not pieces:
            return []
        forced = [i for i, (item, _) in enumerate(pieces) if item.deferred >= limits.max_defer]
        groups = plan_groups(
            [rows for _, rows in pieces], slope, intercept, max_tokens=limits.max_batch_tokens, forced=forced
        )
        first = set(groups[0])
        st = self.stats
        st.planned_passes += 1
        st.planned_groups += len(groups)
        st.forced_frames += len(forced)
        batch: list[tuple[Item, int]] = []
        for i, (item, rows) in enumerate(pieces):
            if i not in first:
                item.deferred += 1
                st.deferred_frames += 1
                continue
            item.deferred = 0
            remaining = int(item.tensor.shape[0]) - item.done  # type: ignore[union-attr]
            if rows < remaining or item.done:
                st.subchunk_passes += 1
                st.split_frames += rows < remaining and item.done == 0
            batch.append((item, rows))
        for item, _ in batch:
            if item.session.id in self._ready:
                self._ready.move_to_end(item.session.id)
        return batch

    def _next_subsequence(self, item: Item) -> int:
        """A staged worker's next piece of a prefill frame: up to the next end of the frame's Jupiter plan (made
        when the frame first runs: policies/jupiter.py's sequence partition over the stages' profiled τ_s)."""
        total = int(item.tensor.shape[0])  # type: ignore[union-attr]
        if item.cuts is None:
            planner = self.pipeline.planner  # type: ignore[union-attr]
            lengths = planner.lengths(total - item.done, len(item.session.cache))  # type: ignore[union-attr]
            ends, at = [], item.done
            for n in lengths:
                at += n
                ends.append(at)
            item.cuts = tuple(ends)
        return next(end for end in item.cuts if end > item.done) - item.done

    def _next_tensor_frame(self, session) -> Item | None:
        """The session's next tensor frame that may run, left at the head of its queue; the ROLLBACKs before it are
        applied and frames whose positions do not fit are rejected on the way."""
        while session.queue:
            item = session.queue[0]
            frame = item.frame
            assert frame is not None
            if frame.kind in _CONTROL:
                session.queue.popleft()
                _CONTROL[frame.kind](self, item)
                continue
            remaining = int(item.tensor.shape[0]) - item.done  # type: ignore[union-attr]
            err = self._tree_error(session, item) or check_positions(
                len(session.cache), frame.arg + item.done, remaining, self.max_context
            )
            if err is not None:
                session.queue.popleft()
                self.count_rejection(err.reason)
                _resolve(item.future, [self._error(session.id, item.seq, err)])
                continue
            return item
        return None

    def _collect_greedy(self) -> list[Item]:
        """Pick at most one tensor frame per session, up to max_batch_tokens."""
        batch: list[Item] = []
        tokens = 0
        for sid in list(self._ready):
            session = self._ready.get(sid)
            if session is None:
                continue
            item = self._next_tensor_frame(session)
            if item is not None:
                n = item.tensor.shape[0]  # type: ignore[union-attr]
                if not (batch and tokens + n > self.limits.max_batch_tokens):
                    session.queue.popleft()
                    batch.append(item)
                    tokens += n
            if not session.queue:
                self._ready.pop(sid, None)
            elif batch and tokens >= self.limits.max_batch_tokens:
                break
        # Round-robin: sessions served this tick go to the back of the line.
        for item in batch:
            if item.session.id in self._ready:
                self._ready.move_to_end(item.session.id)
        return batch

    def _unqueue(self, item: Item) -> None:
        """Take a finished (or failed) frame off its session's queue if the planner left it there."""
        queue_ = item.session.queue
        if queue_ and queue_[0] is item:
            queue_.popleft()
            if not queue_:
                self._ready.pop(item.session.id, None)

    def _refuse(self, item: Item, err: EngineError) -> None:
        self.count_rejection(err.reason)
        _resolve(item.future, [self._error(item.session.id, item.seq, err)])

    def _rollback(self, item: Item) -> None:
        session, keep = item.session, item.frame.arg  # type: ignore[union-attr]
        have = len(session.cache)
        if keep > have:
            self._refuse(
                item,
                EngineError(400, Reason.POSITION, f"ROLLBACK keeps {keep} positions but the cache holds only {have}"),
            )
            return
        if session.open_tree is not None and keep > session.open_tree[0] + 1:
            msg = "ROLLBACK cannot keep part of a token tree's nodes; send KEEP with the accepted path"
            self._refuse(item, EngineError(409, Reason.POSITION, msg))
            return
        session.open_tree = None
        session.cache.crop(keep)
        if self.pipeline is not None and keep < have:
            self.pipeline.crop(session.id, keep)
        _resolve(item.future, [])

    def _tree(self, item: Item) -> None:
        """A TREE frame: the structure of the session's next DRAFT (applied to it in `_tree_error`)."""
        frame = item.frame
        assert frame is not None
        if self.pipeline is not None:
            msg = "this worker runs its layers in stages and does not verify token trees (its OPEN says trees: false)"
            self._refuse(item, EngineError(400, Reason.KIND, msg))
            return
        item.session.pending_tree = (frame.arg, tuple(frame.indices()))
        _resolve(item.future, [])

    def _keep(self, item: Item) -> None:
        """A KEEP frame: the verified tree's accepted path stays in the cache, its other nodes go."""
        session, frame = item.session, item.frame
        assert frame is not None
        nodes = frame.indices()
        tree = session.open_tree
        if tree is None or tree[0] != frame.arg:
            where = "no token tree is open" if tree is None else f"the open tree starts at position {tree[0]}"
            self._refuse(item, EngineError(409, Reason.POSITION, f"KEEP for a tree at position {frame.arg}: {where}"))
            return
        first, parents = tree
        if not is_root_path(parents, nodes):
            msg = f"KEEP {nodes} is not a path from the root of the {len(parents)}-node tree"
            self._refuse(item, EngineError(400, Reason.MALFORMED, msg))
            return
        session.cache.keep([*range(first), *(first + n for n in nodes)])
        session.open_tree = None
        _resolve(item.future, [])

    def _tree_error(self, session: Session, item: Item) -> EngineError | None:
        """Pair a DRAFT with the TREE frame before it (or refuse a frame while a tree is pending or open)."""
        frame = item.frame
        assert frame is not None
        pending, session.pending_tree = session.pending_tree, None
        if session.open_tree is not None:
            return EngineError(409, Reason.POSITION, "the last token tree is still open: send KEEP (or ROLLBACK) first")
        if pending is None:
            return None
        first, parents = pending
        if frame.kind != wire.Kind.DRAFT or frame.arg != first or int(item.tensor.shape[0]) != len(parents):  # type: ignore[union-attr]
            return EngineError(
                400,
                Reason.SHAPE,
                f"a TREE of {len(parents)} nodes at position {first} must be followed by a DRAFT of exactly those "
                f"rows; got {frame.kind.name} of {int(item.tensor.shape[0])} rows at {frame.arg}",  # type: ignore[union-attr]
            )
        item.tree = parents
        return None

    def _forward(self, batch: list[tuple[Item, int]]) -> None:
        """Run each item's next `n` rows (from item.done) through this process's layers. Single process: reply for
        items whose last row ran. Staged: send the pass down the pipeline; the replies follow when it comes back."""
        t0 = time.perf_counter()
        rows = [(item.tensor[item.done : item.done + n], item.session.cache) for item, n in batch]  # type: ignore[index]
        trees = [item.tree for item, _ in batch] if any(item.tree is not None for item, _ in batch) else None
        try:
            with torch.inference_mode():
                outs = self.ragged.forward(rows, trees)  # type: ignore[arg-type]
                if self.ragged.device.type == "cuda":
                    torch.cuda.synchronize()  # kernels run asynchronously: eta and g must time the compute itself
        except Exception as e:
            if len(batch) > 1:  # find the culprit: one session's failure must not fail the others
                log.warning("batched forward failed (%s); retrying %d rows one by one", e, len(batch))
                for piece in batch:
                    self._forward([piece])
                return
            log.exception("middle forward failed")
            item = batch[0][0]
            self._unqueue(item)
            self.count_rejection(Reason.INTERNAL)
            _resolve(item.future, [self._error(item.session.id, item.seq, EngineError(500, Reason.INTERNAL, str(e)))])
            return
        elapsed = time.perf_counter() - t0
        for item, n in batch:
            item.done += n
            if item.done == int(item.tensor.shape[0]):  # type: ignore[union-attr]
                self._unqueue(item)  # all its rows ran here: the session's next frame may follow it
        if self.pipeline is None:
            self._observe_prefill(batch, [elapsed])
            self._complete(batch, outs, elapsed)
            return
        sent = [(item.session.id, item.frame.arg + item.done - n, n) for item, n in batch]  # type: ignore[union-attr]
        self.pipeline.submit(
            sent, torch.cat(outs), elapsed, lambda result: self._inbox.put(("result", (batch, result)))
        )

    def _finish_staged(self, batch: list[tuple[Item, int]], result: Any) -> None:
        """A micro-batch came back from the last stage (deep states, each stage's seconds) or the pipeline broke."""
        if isinstance(result, Exception):
            err = EngineError(503, Reason.STAGE, f"a stage of this worker failed: {result}")
            for item, _ in batch:
                _resolve(item.future, [self._error(item.session.id, item.seq, err)])
            return
        deep, stage_seconds = result
        busy = self.stats.stage_seconds
        if len(busy) != len(stage_seconds):
            busy[:] = [0.0] * len(stage_seconds)
        for s, seconds in enumerate(stage_seconds):
            busy[s] += seconds
        self._observe_prefill(batch, stage_seconds)
        self._complete(batch, deep, sum(stage_seconds))

    def _observe_prefill(self, batch: list[tuple[Item, int]], stage_seconds: list[float]) -> None:
        """A lone prefill piece times τ_s(x | y) on every stage: the fit (and so a staged worker's sequence partition
        and the τ the devices get) learns from such passes. Called before `_complete`, while `finished` is still the
        piece's first row."""
        item, n = batch[0]
        if len(batch) == 1 and item.frame is not None and item.frame.kind == wire.Kind.PREFILL_CHUNK:
            self.prefill_cost.observe(n, item.frame.arg + item.finished, stage_seconds)

    def profile_prefill(self) -> None:
        """The start-up profile of τ(x | y) on this process's layers (engine thread; `[worker] prefill_profile`)."""
        gen = torch.Generator().manual_seed(1)
        ragged = self.ragged

        def session(y: int) -> Callable[[int], list[float]]:
            cache = self.middle.new_cache()
            with torch.inference_mode():
                if y:
                    ragged.forward(
                        [(torch.randn(y, self.hidden_size, generator=gen).to(ragged.device, ragged.dtype), cache)]
                    )

            def run(x: int) -> list[float]:
                piece = torch.randn(x, self.hidden_size, generator=gen).to(ragged.device, ragged.dtype)
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    ragged.forward([(piece, cache)])
                    if ragged.device.type == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                cache.crop(y)
                return [seconds]

            return run

        self.prefill_cost.set_profile(profile_points(session))
        log.info("prefill cost τ(x | y): %s", self.prefill_cost.costs)

    def _complete(self, batch: list[tuple[Item, int]], outs: list[torch.Tensor], elapsed: float) -> None:
        """Count a finished pass (`elapsed`: its compute time over all stages) and reply for finished frames."""
        tokens = sum(n for _, n in batch)
        st = self.stats
        st.forwards += 1
        st.tokens += tokens
        st.last_rows = len(batch)
        st.max_rows = max(st.max_rows, len(batch))
        if len(batch) > 1:
            st.batched_forwards += 1
        st.mu.update(tokens)
        st.eta.update(elapsed)
        st.g.update(tokens, elapsed)
        for (item, n), deep in zip(batch, outs, strict=True):
            frame = item.frame
            assert frame is not None
            item.session.tokens += int(deep.shape[0])
            item.finished += n
            if item.finished < int(item.tensor.shape[0]):  # type: ignore[union-attr]
                continue  # a sub-chunk: the frame's reply comes with its last piece
            item.session.frames += 1
            if item.tree is not None:
                item.session.open_tree = (frame.arg, item.tree)
            if frame.kind == wire.Kind.PREFILL_CHUNK:
                last = frame.arg + item.finished - 1
                reply = wire.encode_tensor(
                    wire.Kind.DEEP_STATE, item.session.id, item.seq, deep[-1:], arg=last, wire_dtype=self.wire_dtype
                )
            else:
                reply = wire.encode_tensor(
                    wire.Kind.VERIFY_RESULT, item.session.id, item.seq, deep, arg=frame.arg, wire_dtype=self.wire_dtype
                )
                status = self._status(item.session, item.seq, int(deep.shape[0]))
                if status is not None:
                    _resolve(item.future, [status, reply])
                    continue
            _resolve(item.future, [reply])

    def _fail_stages(self, reason: str) -> None:
        """The pipeline broke: every session fails with an ERROR and is closed; new sessions are refused."""
        if self.failed is not None:
            return
        self.failed = reason
        err = EngineError(503, Reason.STAGE, f"a stage of this worker failed ({reason}); session closed")
        for session in list(self._sessions.values()):
            for item in list(session.queue):
                _resolve(item.future, [self._error(session.id, item.seq, err)])
            self.close(session, f"a stage failed: {reason}")
            self.count_rejection(Reason.STAGE)
            if session.on_expire is not None:
                with contextlib.suppress(Exception):
                    session.on_expire(f"{err.reason.value}: {err.message}", 503)

    def _status(self, session: Session, seq: int, rows: int) -> bytes | None:
        """A STATUS frame for `session` when mu, or g's prediction for a round of `rows`, moved by more than the
        tolerance since it was last told (engine thread)."""
        mu = self.stats.mu.get()
        slope, intercept = self.stats.g.coefficients()
        told = session.told
        if told is not None:
            tol = self.limits.status_tolerance
            old_mu, old_slope, old_intercept = told
            old_g = max(0.0, old_slope * (old_mu + rows) + old_intercept)
            new_g = max(0.0, slope * (mu + rows) + intercept)
            moved_mu = abs(mu - old_mu) > tol * max(abs(old_mu), 1.0)
            moved_g = abs(new_g - old_g) > tol * max(old_g, 1e-4)
            if not (moved_mu or moved_g):
                return None
        session.told = (mu, slope, intercept)
        self.stats.status_frames += 1
        return wire.encode_status(session.id, seq, mu, (slope, intercept), sessions=len(self._sessions))

    # --- start-up check ---------------------------------------------------------------------------

    def self_check(self, tokens: int = 8, tolerance: float = 1e-3) -> float:
        """Run the ragged forward and the model's own layers on the same random states; raise if they disagree.

        Also warms the kernels up and seeds g (Eq. 2) with two batch sizes. Returns the relative difference.
        """
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens + 1, self.hidden_size, generator=gen).to(self.ragged.device, self.ragged.dtype)
        ref_cache, got_cache = self.middle.new_cache(), self.middle.new_cache()
        ref = self.middle(x[None], ref_cache)[0]
        got = []
        for part in (x[:tokens], x[tokens:]):
            t0 = time.perf_counter()
            got.append(self.ragged.forward([(part, got_cache)])[0])
            self.stats.g.update(part.shape[0], time.perf_counter() - t0)
        diff = float((torch.cat(got) - ref).abs().max()) / max(1.0, float(ref.abs().max()))
        if not diff <= tolerance:
            raise RuntimeError(
                f"the engine's batched forward disagrees with the model's own layers (relative {diff:.2e}); "
                f"model type {getattr(self.middle.stack.config, 'model_type', '?')} is not supported by the engine"
            )
        return diff


_CONTROL: dict[wire.Kind, Callable[[Engine, Item], None]] = {
    wire.Kind.ROLLBACK: Engine._rollback,
    wire.Kind.TREE: Engine._tree,
    wire.Kind.KEEP: Engine._keep,
}


def _resolve(fut: Future[list[bytes]], frames: list[bytes]) -> None:
    if not fut.done():
        with contextlib.suppress(Exception):
            fut.set_result(frames)


def _gone(session: Session) -> str:
    return f"session {session.hex} is closed ({session.close_reason or 'closed'})"
