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

Batching (continuous, "ragged"): every tick the engine thread asks its scheduler (app/worker/scheduler.py: planned
or greedy) for the next pass's pieces and runs them through the middle layers in ONE forward pass. Planned, a pass
of only a flood's pieces is held back while a session answered a moment ago is due to send its next round
(policies/fair_share.anticipation), so that round shares the next pass rather than waiting behind the piece. Passes
are ragged (clients/hat/ragged.py: packed rows, attention per session, each row's result independent of its
neighbours). That forward is checked against the model's own layers at start-up (`self_check`), so an unsupported
layer layout fails loudly instead of computing garbage.

Threading: all model calls run on one dedicated engine thread under torch.inference_mode(); the event loop only
validates frames and hands them over (`submit` returns a concurrent Future of the reply frames).

Stages (`tandem worker --stages P`, app/worker/pipeline.py): `middle` is then stage 0's slice of the layers. A pass
runs here, then goes down the pipeline (`Pipeline.submit`); its deep states come back to the engine thread as an
inbox message and the replies go out then. A frame's rows are `done` once stage 0 ran them (the session's next frame
may follow at once: a prompt's chunks flow through the stages one behind the other) and `finished` once they came
back. At most `max_inflight` passes are in flight; ROLLBACK and CLOSE follow the same chain (crop / release). A
broken pipeline fails every session with an ERROR (503) and refuses new ones.

Size: about 650 lines with this docstring (the protocol's table is the engine's contract); the code is the
engine's loop alone — scheduling, frame checks, stages, prefill costs and calibration are modules of their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from app.worker.calibration import check_ragged_forward, profile_prefill
from app.worker.compute import MIN_ROWS
from app.worker.prefill_cost import PrefillCostFit
from app.worker.scheduler import CONTROL_KINDS, Scheduler, has_tensor_frame
from app.worker.sessions import (
    MAX_REORDER,
    PROTOCOL,
    EngineError,
    Item,
    Reason,
    Session,
    check_frame,
    parse_open,
)
from app.worker.settings import EngineLimits
from app.worker.stats import EngineStats
from clients.hat import wire
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import MiddleSubmodel
from policies.fair_share import anticipation

if TYPE_CHECKING:
    from app.worker.pipeline import Pipeline

log = logging.getLogger(__name__)

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
        self.wire_dtype = wire.dtype_by_name(self.limits.dtype)
        self.wire_dtype_name = self.limits.dtype
        context_bytes = self.max_context * self.hidden_size * self.wire_dtype.itemsize
        self.limits = self.limits.model_copy(
            update={
                "max_frame_bytes": self.limits.max_frame_bytes or context_bytes,
                "max_session_bytes": self.limits.max_session_bytes or context_bytes * 5 // 4,
            }
        )
        self.ragged = RaggedMiddle(stack, MIN_ROWS, self.limits.batch_invariant)
        self.frame_hook = frame_hook
        self.clock = clock
        self.stats = EngineStats()
        self._sessions: dict[bytes, Session] = {}
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.started = False
        # A staged worker (app/worker/pipeline.py): `middle` is stage 0's slice and the pipeline runs the rest.
        self.pipeline = pipeline
        self.failed: str | None = None  # why the pipeline broke (the worker is then not ready)
        self.draining = False  # told to drain (app/worker/server.py's Worker.drain): OPEN is refused
        if pipeline is not None:
            pipeline.on_failure = lambda reason: self._inbox.put(("failed", reason))
        self.scheduler = Scheduler(
            self.limits,
            self.stats,
            self.max_context,
            control=self._control,
            refuse=self._refuse,
            planner=None if pipeline is None else pipeline.planner,
        )
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
            if self.draining:
                self.count_rejection(Reason.DRAINING)
                raise EngineError(503, Reason.DRAINING, "worker is draining: it takes no new sessions")
            if len(self._sessions) >= self.limits.max_sessions:
                self.count_rejection(Reason.FULL)
                raise EngineError(
                    503, Reason.FULL, f"worker is serving its maximum of {self.limits.max_sessions} sessions"
                )
            sid = uuid.uuid4().bytes
            session = Session(sid, self.middle.new_cache(self.max_context), params, created=now, last_active=now)
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
        seq_err = session.seq_error(seq, MAX_REORDER)
        if seq_err is not None:
            self.count_rejection(Reason.SEQ)
            _resolve(fut, [self._error(session.id, seq, seq_err)])
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
        for item in session.hold(Item(session, seq, frame, tensor, fut)):
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
                idle = not self.scheduler.pending or self._pipeline_full()
                wait = tick if idle else self._anticipation()
                item = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
                self._take(item)
                while True:
                    self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stopping:
                break
            if self._anticipation() > 0:
                continue  # what arrived was not the frame the flood's pass is held for: wait on
            self._expire_idle()
            if self._pipeline_full():
                continue  # every stage has work: wait for a micro-batch to come back
            try:
                slope, intercept = self.stats.g.coefficients()
                batch = self.scheduler.next_pass(slope, intercept, len(self._sessions), self.prefill_cost.total())
                if batch:
                    self._forward(batch)
            except Exception:  # never let the engine thread die
                log.exception("engine tick failed")
        self._drain_on_stop()

    def _anticipation(self) -> float:
        """Seconds to hold a pass of only a flood's pieces for a session answered a moment ago (policies/fair_share.py:
        its next frame would otherwise wait behind a whole piece)."""
        if self.limits.batching != "planned" or len(self._sessions) < 2 or not self.scheduler.only_bulk():
            return 0.0
        now = time.perf_counter()
        answered = [
            (now - s.answered_at, s.reply_gap.get())
            for s in self._sessions.values()
            if s.answered_at is not None and s.reply_gap.count
        ]
        return anticipation(answered, self.stats.fair_quantum)

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
            self.scheduler.add(item)
            session = item.session
            if session.answered_at is not None and item.frame is not None and item.frame.kind not in CONTROL_KINDS:
                session.reply_gap.update(time.perf_counter() - session.answered_at)  # the device's turn
                session.answered_at = None
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
        self.scheduler.discard(session)
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

    def _refuse(self, item: Item, err: EngineError) -> None:
        self.count_rejection(err.reason)
        _resolve(item.future, [self._error(item.session.id, item.seq, err)])

    def _control(self, item: Item) -> None:
        """Apply a ROLLBACK, TREE or KEEP frame the scheduler reached (the session's state changes on its methods) and
        answer it: nothing, or an ERROR when it cannot be applied."""
        session, frame = item.session, item.frame
        assert frame is not None
        try:
            if frame.kind == wire.Kind.ROLLBACK:
                have = len(session.cache)
                session.rollback(frame.arg)
                if self.pipeline is not None and frame.arg < have:
                    self.pipeline.crop(session.id, frame.arg)
            elif frame.kind == wire.Kind.TREE:
                if self.pipeline is not None:
                    msg = "this worker runs its layers in stages and does not verify token trees"
                    raise EngineError(400, Reason.KIND, f"{msg} (its OPEN says trees: false)")
                session.expect_tree(frame.arg, tuple(frame.indices()))
            else:
                session.keep_path(frame.arg, frame.indices())
        except EngineError as err:
            self._refuse(item, err)
            return
        _resolve(item.future, [])

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
            self.scheduler.unqueue(item)
            self.count_rejection(Reason.INTERNAL)
            _resolve(item.future, [self._error(item.session.id, item.seq, EngineError(500, Reason.INTERNAL, str(e)))])
            return
        elapsed = time.perf_counter() - t0
        for item, n in batch:
            item.done += n
            if item.done == item.rows:
                self.scheduler.unqueue(item)  # all its rows ran here: the session's next frame may follow it
        if self.pipeline is None:
            self._observe_piece_cost(batch, [elapsed])
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
        self._observe_piece_cost(batch, stage_seconds)
        self._complete(batch, deep, sum(stage_seconds))

    def _observe_piece_cost(self, batch: list[tuple[Item, int]], stage_seconds: list[float]) -> None:
        """A piece of consecutive positions (a prefill chunk or a chain of drafts: the same computation) that ran
        alone, or beside decode-sized pieces only, times τ_s(x | y) on every stage: the fit (and so a staged worker's
        sequence partition, the fair share's prices and the τ the devices get) learns from such passes. Beside small
        pieces, because a flood's pieces mostly share a pass with another session's round (the engine holds them for
        it), and they would leave τ unfitted; the round's few rows add their share of the pass to the point (a 4-row
        round beside a 16-row piece: a few percent). Called before `_complete`, while `finished` is still the piece's
        first row."""
        small = self.prefill_cost.min_len  # decode-sized: fewer rows than the fit takes a point from
        long = [(item, n) for item, n in batch if n >= small]
        if len(long) != 1 or sum(n for _, n in batch) - long[0][1] >= small:
            return
        item, n = long[0]
        if (
            item.frame is not None
            and item.tree is None
            and item.frame.kind in (wire.Kind.PREFILL_CHUNK, wire.Kind.DRAFT)
        ):
            self.prefill_cost.observe(n, item.frame.arg + item.finished, stage_seconds)

    def profile_prefill(self) -> None:
        """The start-up profile of τ(x | y) on this process's layers (engine thread; `[worker] prefill_profile`)."""
        self.prefill_cost.set_profile(profile_prefill(self.middle, self.ragged, self.hidden_size))
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
            if frame.kind == wire.Kind.DRAFT and (item.deep or item.finished < item.rows):
                item.deep.append(deep)  # a chain of drafts run in pieces (fair share): the reply carries them all
                deep = torch.cat(item.deep) if item.finished == item.rows else deep
            if item.finished < item.rows:
                continue  # a piece: the frame's reply comes with its last one
            item.session.frames += 1
            if not has_tensor_frame(item.session):
                item.session.answered_at = time.perf_counter()  # its turn: the next frame is the device's to send
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

    def hand_over(self) -> int:
        """A draining worker's time is up: every session left gets an ERROR (503) and is closed, so its device moves
        it to another worker with the context it delivered (engine thread: `call` it). Returns how many it handed
        over."""
        err = EngineError(503, Reason.DRAINING, "worker drained: session handed over; open it on another worker")
        sessions = list(self._sessions.values())
        self._end_sessions(sessions, err, "handed over: the worker drained")
        return len(sessions)

    def _fail_stages(self, reason: str) -> None:
        """The pipeline broke: every session fails with an ERROR and is closed; new sessions are refused."""
        if self.failed is not None:
            return
        self.failed = reason
        err = EngineError(503, Reason.STAGE, f"a stage of this worker failed ({reason}); session closed")
        self._end_sessions(list(self._sessions.values()), err, f"a stage failed: {reason}")

    def _end_sessions(self, sessions: list[Session], err: EngineError, why: str) -> None:
        """Close `sessions` under their devices: their pending frames and the session itself answered with `err`."""
        for session in sessions:
            for item in list(session.queue):
                _resolve(item.future, [self._error(session.id, item.seq, err)])
            self.close(session, why)
            self.count_rejection(err.reason)
            if session.on_expire is not None:
                with contextlib.suppress(Exception):
                    session.on_expire(f"{err.reason.value}: {err.message}", 503)

    def _status(self, session: Session, seq: int, rows: int) -> bytes | None:
        """A STATUS frame for `session` when mu, or g's prediction for a round of `rows`, moved by more than the
        tolerance since it was last told (engine thread)."""
        mu = self.stats.mu.get()
        slope, intercept = self.stats.g.coefficients()
        if not session.status_due(mu, slope, intercept, rows, self.limits.status_tolerance):
            return None
        self.stats.status_frames += 1
        return wire.encode_status(session.id, seq, mu, (slope, intercept), sessions=len(self._sessions))

    # --- start-up check ---------------------------------------------------------------------------

    def self_check(self, tokens: int = 8, tolerance: float = 1e-3) -> float:
        """The ragged forward against the model's own layers (app/worker/calibration.py; engine thread): raises if they
        disagree, warms the kernels up and seeds g. Returns the relative difference."""
        return check_ragged_forward(self.middle, self.ragged, self.stats.g, self.hidden_size, tokens, tolerance)


def _resolve(fut: Future[list[bytes]], frames: list[bytes]) -> None:
    if not fut.done():
        with contextlib.suppress(Exception):
            fut.set_result(frames)


def _gone(session: Session) -> str:
    return f"session {session.hex} is closed ({session.close_reason or 'closed'})"
