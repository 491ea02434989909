"""What a HAT worker session is and what a device's frame must be before the engine (app/worker/engine.py) takes it.

Refusal reasons and their errors, the OPEN parameters a device may send, a session's state and what it does with its
own frames (their sequence order, the STATUS it is due, the control frames ROLLBACK, TREE and KEEP, and the pairing of
a TREE with its DRAFT), and the checks a frame passes on arrival (size, header, kind, dtype, shape, finite values,
positions) against the limits the engine is given (app/worker/settings.py's EngineLimits). Checks and session methods
raise or return EngineError and count nothing: the engine counts each refusal once, by its reason.
"""

from __future__ import annotations

import enum
import json
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clients.hat import wire
from clients.hat.split import SplitKVCache
from policies.estimate import MovingAverage
from policies.trees import check_tree, is_root_path

PROTOCOL = 1
DEVICE_KINDS = frozenset(
    {wire.Kind.PREFILL_CHUNK, wire.Kind.DRAFT, wire.Kind.ROLLBACK, wire.Kind.CLOSE, wire.Kind.TREE, wire.Kind.KEEP}
)
OPEN_MAX_BYTES = 16 * 1024
MAX_REORDER = 64  # how far ahead of the next expected seq a frame may arrive


class Reason(enum.StrEnum):
    """Why a frame or session was refused (the `reason` label of the rejected-frames metric)."""

    MALFORMED = "malformed"
    OVERSIZED = "oversized"
    KIND = "kind"
    DTYPE = "dtype"
    SHAPE = "shape"
    NONFINITE = "nonfinite"
    SESSION = "session"
    SEQ = "seq"
    POSITION = "position"
    CONTEXT = "context"
    OPEN = "open"
    FULL = "full"
    BACKLOG = "backlog"
    IDLE = "idle"
    STAGE = "stage"
    DRAINING = "draining"
    CLOSED = "closed"
    INTERNAL = "internal"


class EngineError(Exception):
    def __init__(self, status: int, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class OpenParams(BaseModel):
    """What a device may say when it opens a session: structural facts only (no prompt, no text)."""

    model_config = ConfigDict(extra="forbid")

    protocol: int = PROTOCOL
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    m: int = Field(gt=0)
    dtype: Literal["float32", "float16", "bfloat16"]
    model: str | None = Field(default=None, max_length=200)


# --- sessions --------------------------------------------------------------------------------------


@dataclass
class Item:
    """One device frame on its way through the engine."""

    session: Session
    seq: int
    frame: wire.Frame | None  # None: rejected on arrival (future already resolved)
    tensor: torch.Tensor | None
    future: Future[list[bytes]]
    done: int = 0  # rows already run (a prefill frame split into sub-chunks by the planned batching); with stages,
    # rows stage 0 has run and sent down the pipeline
    finished: int = 0  # rows whose deep states are back (equal to `done` in a single-process worker)
    cuts: tuple[int, ...] | None = None  # a staged worker's planned sub-sequence ends within this frame (Jupiter)
    tree: tuple[int, ...] | None = None  # a DRAFT's token tree (parent indices), from the TREE frame before it
    deferred: int = 0  # consecutive passes this frame was pending but left out of (planned batching)
    deep: list[torch.Tensor] = field(default_factory=list)  # a DRAFT run in pieces: the deep states of those run

    @property
    def rows(self) -> int:
        """Positions a tensor frame carries."""
        return int(self.tensor.shape[0])  # type: ignore[union-attr]


@dataclass
class Session:
    """One device's state. Loop-side fields: expected_seq, held, last_active, on_expire. Engine-thread: the rest."""

    id: bytes
    cache: SplitKVCache
    params: OpenParams
    created: float
    last_active: float
    expected_seq: int = 1
    held: dict[int, Item] = field(default_factory=dict)
    queue: deque[Item] = field(default_factory=deque)
    closed: bool = False
    close_reason: str | None = None
    # Called on the engine thread when the worker drops the session on its own: (message, HTTP-like status): 408
    # after the idle timeout, 503 when a stage of a staged worker failed.
    on_expire: Callable[[str, int], None] | None = None
    frames: int = 0
    tokens: int = 0
    waiting_bytes: int = 0  # frames accepted and not yet answered (Engine._pending_lock)
    waiting_frames: int = 0
    told: tuple[float, float, float] | None = None  # engine thread: (mu, g slope, g intercept) last sent to the device
    # Engine thread: a TREE frame's (first position, parents) waiting for its DRAFT; then the verified tree whose
    # nodes are all in the cache until the device's KEEP says which path stays.
    pending_tree: tuple[int, tuple[int, ...]] | None = None
    open_tree: tuple[int, tuple[int, ...]] | None = None
    credit: float = 0.0  # engine thread: seconds of the scheduler's fair share it kept from earlier passes
    # Engine thread (time.perf_counter): when its last tensor frame was answered with no other queued behind it, until
    # its next one arrives; and the usual gap between the two (the device's turn), for the anticipation of a flood's
    # passes (policies/fair_share.py).
    answered_at: float | None = None
    reply_gap: MovingAverage = field(default_factory=lambda: MovingAverage(alpha=0.5))

    @property
    def hex(self) -> str:
        return self.id.hex()

    # --- sequence order (event loop) ---------------------------------------------------------------

    def seq_error(self, seq: int, max_reorder: int) -> EngineError | None:
        """Why this session cannot take a frame numbered `seq`: already used, or too far ahead of the next expected."""
        if seq < self.expected_seq or seq in self.held:
            return EngineError(409, Reason.SEQ, f"frame seq {seq} was already used; next expected {self.expected_seq}")
        if seq - self.expected_seq > max_reorder:
            return EngineError(
                409, Reason.SEQ, f"frame seq {seq} is too far ahead of the next expected {self.expected_seq}"
            )
        return None

    def hold(self, item: Item) -> list[Item]:
        """Hold a frame until every frame before it has arrived; returns the frames now in sequence, in order (a
        refused frame, whose ERROR reply used its seq up, is passed over)."""
        self.held[item.seq] = item
        released: list[Item] = []
        while self.expected_seq in self.held:
            ready = self.held.pop(self.expected_seq)
            self.expected_seq += 1
            if ready.frame is not None:
                released.append(ready)
        return released

    # --- HAT state told to the device (engine thread) ----------------------------------------------

    def status_due(self, mu: float, slope: float, intercept: float, rows: int, tolerance: float) -> bool:
        """Whether mu, or g's prediction for a round of `rows`, moved by more than `tolerance` (a share) since the
        device was last told; when it did, the new values count as told."""
        told = self.told
        if told is not None:
            old_mu, old_slope, old_intercept = told
            old_g = max(0.0, old_slope * (old_mu + rows) + old_intercept)
            new_g = max(0.0, slope * (mu + rows) + intercept)
            moved_mu = abs(mu - old_mu) > tolerance * max(abs(old_mu), 1.0)
            moved_g = abs(new_g - old_g) > tolerance * max(old_g, 1e-4)
            if not (moved_mu or moved_g):
                return False
        self.told = (mu, slope, intercept)
        return True

    # --- control frames (engine thread) ------------------------------------------------------------

    def rollback(self, keep: int) -> None:
        """ROLLBACK: the cache keeps its first `keep` positions (rejected drafts go). Raises EngineError."""
        have = len(self.cache)
        if keep > have:
            raise EngineError(400, Reason.POSITION, f"ROLLBACK keeps {keep} positions but the cache holds only {have}")
        if self.open_tree is not None and keep > self.open_tree[0] + 1:
            msg = "ROLLBACK cannot keep part of a token tree's nodes; send KEEP with the accepted path"
            raise EngineError(409, Reason.POSITION, msg)
        self.open_tree = None
        self.cache.crop(keep)

    def expect_tree(self, first: int, parents: tuple[int, ...]) -> None:
        """TREE: the structure of the session's next DRAFT (paired with it by `attach_tree`)."""
        self.pending_tree = (first, parents)

    def keep_path(self, first: int, nodes: list[int]) -> None:
        """KEEP: the verified tree's accepted path stays in the cache, its other nodes go. Raises EngineError."""
        tree = self.open_tree
        if tree is None or tree[0] != first:
            where = "no token tree is open" if tree is None else f"the open tree starts at position {tree[0]}"
            raise EngineError(409, Reason.POSITION, f"KEEP for a tree at position {first}: {where}")
        start, parents = tree
        if not is_root_path(parents, nodes):
            msg = f"KEEP {nodes} is not a path from the root of the {len(parents)}-node tree"
            raise EngineError(400, Reason.MALFORMED, msg)
        self.cache.keep([*range(start), *(start + n for n in nodes)])
        self.open_tree = None

    def attach_tree(self, item: Item) -> None:
        """Pair a tensor frame about to run with the TREE frame before it, which must announce exactly this DRAFT;
        refuse any tensor frame while the last tree is still open. Raises EngineError."""
        frame = item.frame
        assert frame is not None
        pending, self.pending_tree = self.pending_tree, None
        if self.open_tree is not None:
            raise EngineError(409, Reason.POSITION, "the last token tree is still open: send KEEP (or ROLLBACK) first")
        if pending is None:
            return
        first, parents = pending
        if frame.kind != wire.Kind.DRAFT or frame.arg != first or item.rows != len(parents):
            raise EngineError(
                400,
                Reason.SHAPE,
                f"a TREE of {len(parents)} nodes at position {first} must be followed by a DRAFT of exactly those "
                f"rows; got {frame.kind.name} of {item.rows} rows at {frame.arg}",
            )
        item.tree = parents


# --- checks ----------------------------------------------------------------------------------------


def parse_open(data: bytes, hidden_size: int, num_layers: int, m: int, dtype: str) -> OpenParams:
    """An OPEN frame's parameters, checked against the worker's model. Raises EngineError."""
    try:
        frame = wire.decode_frame(data, max_frame_bytes=OPEN_MAX_BYTES, expected_kinds={wire.Kind.OPEN})
        params = OpenParams.model_validate(json.loads(frame.text()))
    except wire.FrameError as e:
        raise EngineError(400, Reason.MALFORMED, f"bad OPEN frame: {e}") from None
    except (ValueError, ValidationError) as e:
        raise EngineError(400, Reason.OPEN, f"bad OPEN parameters: {_short(e)}") from None
    mismatch = [
        f"{name} {got} != worker's {want}"
        for name, got, want in (
            ("protocol", params.protocol, PROTOCOL),
            ("hidden_size", params.hidden_size, hidden_size),
            ("num_layers", params.num_layers, num_layers),
            ("m", params.m, m),
            ("dtype", params.dtype, dtype),
        )
        if got != want
    ]
    if mismatch:
        raise EngineError(400, Reason.OPEN, "session does not match this worker's model: " + "; ".join(mismatch))
    return params


def check_frame(
    session: Session, data: bytes, max_frame_bytes: int, hidden_size: int, wire_dtype: torch.dtype
) -> tuple[wire.Frame | None, torch.Tensor | None, EngineError | None]:
    """Decode and check a device frame against the model. Returns (frame if its header parsed, tensor, error)."""
    frame = None
    if len(data) > wire.HEADER_SIZE + 4 * wire.MAX_NDIM + max_frame_bytes:
        msg = f"frame of {len(data)} bytes exceeds the {max_frame_bytes}-byte limit"
        return None, None, EngineError(413, Reason.OVERSIZED, msg)
    try:
        frame = wire.decode_frame(data, max_frame_bytes=max_frame_bytes)
    except wire.FrameError as e:
        reason = Reason.OVERSIZED if "exceeds" in str(e) else Reason.MALFORMED
        return None, None, EngineError(413 if reason is Reason.OVERSIZED else 400, reason, f"bad frame: {e}")
    try:
        if frame.session != session.id:
            raise EngineError(400, Reason.SESSION, f"frame is for session {frame.session.hex()}, this is {session.hex}")
        if frame.kind not in DEVICE_KINDS:
            raise EngineError(
                400,
                Reason.KIND,
                f"a device may not send {frame.kind.name} frames here; "
                f"expected one of {sorted(k.name for k in DEVICE_KINDS)}",
            )
        if frame.kind == wire.Kind.TREE:
            try:
                check_tree(frame.indices())
            except ValueError as e:
                raise EngineError(400, Reason.MALFORMED, f"bad TREE frame: {e}") from None
        if frame.kind not in wire.TENSOR_KINDS:
            return frame, None, None
        if frame.dtype != wire.dtype_code(wire_dtype):
            raise EngineError(
                400,
                Reason.DTYPE,
                f"{frame.kind.name} carries {frame.dtype.name}; this worker takes {wire.dtype_name(wire_dtype)}",
            )
        shape = frame.shape
        if len(shape) == 3 and shape[0] == 1:
            shape = shape[1:]
        if len(shape) != 2 or shape[1] != hidden_size or shape[0] < 1:
            raise EngineError(
                400,
                Reason.SHAPE,
                f"{frame.kind.name} shape {frame.shape} is not [tokens >= 1, hidden_size {hidden_size}]",
            )
        if frame.arg < 0:
            raise EngineError(400, Reason.POSITION, f"negative start position {frame.arg}")
        tensor = frame.tensor().reshape(shape)
        if not bool(torch.isfinite(tensor).all()):
            raise EngineError(400, Reason.NONFINITE, f"{frame.kind.name} carries NaN or infinite values")
        return frame, tensor, None
    except EngineError as e:
        return frame, None, e


def check_positions(have: int, start: int, n: int, max_context: int) -> EngineError | None:
    """A tensor frame of `n` positions from `start`, against a cache holding `have` of at most `max_context`."""
    if start != have:
        return EngineError(
            409,
            Reason.POSITION,
            f"frame starts at position {start} but the session's cache holds {have} positions "
            f"(send ROLLBACK first to drop rejected drafts)",
        )
    if start + n > max_context:
        return EngineError(
            413,
            Reason.CONTEXT,
            f"{start} cached + {n} new positions exceed the session's {max_context}-position context",
        )
    return None


def _short(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in x['loc']) or 'body'}: {x['msg']}" for x in e.errors())
    return str(e)
