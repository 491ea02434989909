"""Hidden-state frame codec for the HAT device <-> worker link.

Why a hand-rolled format: frames cross a trust boundary (any peer can connect
to a worker), so decoding must never execute anything. We never pickle and
never `torch.load`; a frame is a fixed little-endian header followed by raw
tensor bytes, and every header field is validated before a byte of payload is
interpreted.

Layout (all integers little-endian):

    offset size field
    0      4    magic            b"TNDH"
    4      1    version          1
    5      1    kind             Kind enum
    6      1    dtype            DType enum (NONE for control frames)
    7      1    ndim             0..MAX_NDIM
    8      2    flags            reserved, must be 0
    10     16   session id       opaque 16 bytes (a UUID)
    26     8    seq              u64 sequence number (per session and direction)
    34     8    arg              i64, meaning depends on kind (see Kind)
    42     8    payload length   u64
    50     4*ndim shape          u32 per dimension
    ...    payload length bytes  raw little-endian elements, C order

Frame kinds and what they carry:

- OPEN            BYTES: UTF-8 session parameters (the caller's own format, e.g. JSON); arg unused.
- PREFILL_CHUNK   hidden states [tokens, hidden] (or [batch, tokens, hidden]); arg = position of the first token.
- DRAFT           shallow states of draft tokens; arg = position of the first draft token.
- VERIFY_RESULT   deep states for the DRAFT frame with the same seq; arg = position of the first state.
- DEEP_STATE      deep state(s) at the end of prefill; arg = position of the first state.
- ROLLBACK        no payload; arg = number of positions to keep in the worker's KV cache.
- ERROR           BYTES: UTF-8 message; arg = status code (HTTP-like).
- CLOSE           no payload; ends the session.
- STATUS          worker -> device only. BYTES: exactly 24 bytes, three little-endian float64s: mu (the worker's
                  moving average of tokens per forward pass), then its delay predictor g(x) = slope*x + intercept
                  (slope in s/token, intercept in s); all finite, mu >= 0. arg = the worker's open sessions (>= 0).
                  Sent mid-session just before a VERIFY_RESULT (same seq) when mu or g moved since the device was
                  last told (at OPEN or by an earlier STATUS), so a long session does not plan with stale values.
                  It answers nothing: a receiver applies it and keeps waiting for the reply it asked for.
- TREE            INT32 [w]: the parent index of each of the next DRAFT frame's w rows (a token tree, HAT with
                  Ghidorah-style verification; policies/trees.py). parents[0] = -1 (the root: the last accepted
                  token), 0 <= parents[i] < i. arg = the DRAFT's first position. Must come right before that DRAFT
                  (the next seq); no reply. Row i sits at position arg + depth(i) and attends to the cache and its
                  own ancestors only.
- KEEP            INT32 [a]: after a tree round, the node indices to keep (the accepted path: 0, then each next
                  node a child of the one before); every other node of the tree is dropped from the KV cache.
                  arg = the tree's first position. No reply (ERROR if it cannot be applied).
Parent and node indices are the tree's structure, never tokens: the worker still sees no token ids.
"""

from __future__ import annotations

import enum
import struct
import uuid
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"TNDH"
VERSION = 1
MAX_NDIM = 4
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024  # 64 MiB: ~18k tokens of Qwen 0.5B fp32 states

_HEADER = struct.Struct("<4sBBBBH16sQqQ")
HEADER_SIZE = _HEADER.size  # 50


class FrameError(ValueError):
    """A frame is malformed or not what the receiver expects. The message says which field and why."""


class Kind(enum.IntEnum):
    OPEN = 1
    PREFILL_CHUNK = 2
    DRAFT = 3
    VERIFY_RESULT = 4
    DEEP_STATE = 5
    ROLLBACK = 6
    ERROR = 7
    CLOSE = 8
    STATUS = 9
    TREE = 10
    KEEP = 11


class DType(enum.IntEnum):
    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    BYTES = 4  # opaque uint8, e.g. UTF-8 text
    INT32 = 5  # tree structure (TREE, KEEP)


TENSOR_KINDS = frozenset({Kind.PREFILL_CHUNK, Kind.DRAFT, Kind.VERIFY_RESULT, Kind.DEEP_STATE})
TEXT_KINDS = frozenset({Kind.OPEN, Kind.ERROR})
CONTROL_KINDS = frozenset({Kind.ROLLBACK, Kind.CLOSE})
STATUS_KINDS = frozenset({Kind.STATUS})
INDEX_KINDS = frozenset({Kind.TREE, Kind.KEEP})
MAX_TREE_NODES = 1024
_STATUS = struct.Struct("<ddd")
STATUS_BYTES = _STATUS.size  # 24

# Hidden-state dtypes by the names settings, OPEN parameters and CLIs use.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TORCH_TO_CODE = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16}
_CODE_TO_TORCH = {v: k for k, v in _TORCH_TO_CODE.items()}
# numpy dtype used to move the bytes; bfloat16 travels as its int16 bit pattern (numpy has no bfloat16).
_CODE_TO_NUMPY = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype("<i2"),
    DType.BYTES: np.dtype("u1"),
    DType.INT32: np.dtype("<i4"),
}
_ITEMSIZE = {DType.NONE: 0, DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.BYTES: 1, DType.INT32: 4}


def dtype_code(dtype: torch.dtype) -> DType:
    """Wire code of a torch float dtype; FrameError for anything else."""
    try:
        return _TORCH_TO_CODE[dtype]
    except KeyError:
        raise FrameError(f"dtype {dtype} cannot be sent; use float32, float16 or bfloat16") from None


def dtype_by_name(name: str) -> torch.dtype:
    """The torch dtype called `name` in DTYPES; ValueError for any other name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The DTYPES name of a torch dtype."""
    return next(k for k, v in DTYPES.items() if v == dtype)


def session_bytes(session: bytes | uuid.UUID | str) -> bytes:
    """Normalise a session id (16 raw bytes, a UUID, or a UUID string) to the 16 wire bytes."""
    if isinstance(session, uuid.UUID):
        return session.bytes
    if isinstance(session, str):
        return uuid.UUID(session).bytes
    if isinstance(session, (bytes, bytearray, memoryview)) and len(session) == 16:
        return bytes(session)
    raise FrameError(
        f"session id must be 16 bytes or a UUID, got {type(session).__name__} of length "
        f"{len(session) if hasattr(session, '__len__') else '?'}"
    )


@dataclass(frozen=True)
class Header:
    kind: Kind
    dtype: DType
    session: bytes
    seq: int
    arg: int
    shape: tuple[int, ...]
    payload_len: int

    @property
    def frame_size(self) -> int:
        """Total bytes of the frame this header starts (header + shape + payload)."""
        return HEADER_SIZE + 4 * len(self.shape) + self.payload_len


@dataclass(frozen=True)
class Frame:
    kind: Kind
    session: bytes
    seq: int
    arg: int = 0
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()
    payload: bytes = b""

    @property
    def session_uuid(self) -> uuid.UUID:
        return uuid.UUID(bytes=self.session)

    def tensor(self) -> torch.Tensor:
        """The payload as a fresh (writable, native-endian) torch tensor of the frame's dtype and shape."""
        if self.dtype not in _CODE_TO_TORCH:
            raise FrameError(f"{self.kind.name} frame carries {self.dtype.name}, not a tensor")
        arr = np.frombuffer(self.payload, dtype=_CODE_TO_NUMPY[self.dtype]).reshape(self.shape)
        arr = arr.astype(arr.dtype.newbyteorder("="), copy=True)  # own the memory; native byte order
        t = torch.from_numpy(arr)
        if self.dtype == DType.BFLOAT16:
            t = t.view(torch.bfloat16)
        return t

    def status(self) -> WorkerStatus:
        """The values of a STATUS frame (FrameError for any other kind or a malformed payload)."""
        if self.kind != Kind.STATUS or self.dtype != DType.BYTES or len(self.payload) != STATUS_BYTES:
            raise FrameError(f"{self.kind.name} frame is not a {STATUS_BYTES}-byte STATUS frame")
        mu, slope, intercept = _STATUS.unpack(self.payload)
        _check_status(mu, slope, intercept, self.arg)
        return WorkerStatus(mu, slope, intercept, self.arg)

    def indices(self) -> list[int]:
        """The int32 payload of a TREE / KEEP frame."""
        if self.kind not in INDEX_KINDS or self.dtype != DType.INT32:
            raise FrameError(f"{self.kind.name} frame carries {self.dtype.name}, not tree indices")
        return [int(v) for v in np.frombuffer(self.payload, dtype=_CODE_TO_NUMPY[DType.INT32])]

    def text(self) -> str:
        """The payload of an OPEN / ERROR frame as text."""
        if self.dtype != DType.BYTES:
            raise FrameError(f"{self.kind.name} frame carries {self.dtype.name}, not bytes")
        try:
            return self.payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FrameError(f"{self.kind.name} payload is not valid UTF-8: {e}") from None


@dataclass(frozen=True)
class WorkerStatus:
    """A STATUS frame's values: the worker's mu and its delay predictor g(x) = g_slope*x + g_intercept."""

    mu: float
    g_slope: float
    g_intercept: float
    sessions: int = 0

    @property
    def g(self) -> tuple[float, float]:
        return self.g_slope, self.g_intercept


def _check_status(mu: float, slope: float, intercept: float, sessions: int) -> None:
    if not all(np.isfinite(v) for v in (mu, slope, intercept)):
        raise FrameError(f"STATUS values must be finite, got mu={mu}, g=({slope}, {intercept})")
    if mu < 0:
        raise FrameError(f"STATUS mu must be >= 0, got {mu}")
    if sessions < 0:
        raise FrameError(f"STATUS session count must be >= 0, got {sessions}")


def tensor_to_bytes(t: torch.Tensor) -> tuple[DType, tuple[int, ...], bytes]:
    """Raw little-endian C-order bytes of a CPU float tensor, with its wire dtype and shape."""
    code = dtype_code(t.dtype)
    t = t.detach().to("cpu").contiguous()
    arr = t.view(torch.int16).numpy() if code == DType.BFLOAT16 else t.numpy()  # numpy has no bfloat16
    arr = arr.astype(_CODE_TO_NUMPY[code], copy=False)  # byte-swaps only on big-endian hosts
    return code, tuple(int(d) for d in t.shape), arr.tobytes(order="C")


def bytes_to_tensor(code: DType, shape: tuple[int, ...], payload: bytes) -> torch.Tensor:
    """Inverse of `tensor_to_bytes` (validates the length)."""
    code = DType(code)
    expected = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[code]
    if expected != len(payload):
        raise FrameError(f"shape {shape} x {_ITEMSIZE[code]} bytes = {expected} != payload length {len(payload)}")
    return Frame(Kind.PREFILL_CHUNK, b"\0" * 16, 0, dtype=code, shape=shape, payload=payload).tensor()


def _pack(kind: Kind, session: bytes, seq: int, arg: int, code: DType, shape: tuple[int, ...], payload: bytes) -> bytes:
    if not 0 <= seq < 2**64:
        raise FrameError(f"seq {seq} out of u64 range")
    if not -(2**63) <= arg < 2**63:
        raise FrameError(f"arg {arg} out of i64 range")
    if len(shape) > MAX_NDIM:
        raise FrameError(f"ndim {len(shape)} > {MAX_NDIM}")
    if any(not 0 <= d < 2**32 for d in shape):
        raise FrameError(f"shape {shape} has a dimension outside u32")
    head = _HEADER.pack(MAGIC, VERSION, int(kind), int(code), len(shape), 0, session, seq, arg, len(payload))
    return b"".join((head, struct.pack(f"<{len(shape)}I", *shape), payload))


def encode_tensor(
    kind: Kind,
    session: bytes | uuid.UUID | str,
    seq: int,
    tensor: torch.Tensor,
    *,
    arg: int = 0,
    wire_dtype: torch.dtype | None = None,
) -> bytes:
    """A hidden-state frame. `wire_dtype` (e.g. torch.float16) casts before sending to halve the bytes."""
    kind = Kind(kind)
    if kind not in TENSOR_KINDS:
        raise FrameError(f"{kind.name} frames do not carry tensors")
    if wire_dtype is not None and tensor.dtype != wire_dtype:
        tensor = tensor.to(wire_dtype)
    code, shape, payload = tensor_to_bytes(tensor)
    if not shape:
        raise FrameError("a hidden-state frame needs at least one dimension")
    return _pack(kind, session_bytes(session), seq, arg, code, shape, payload)


def encode_text(kind: Kind, session: bytes | uuid.UUID | str, seq: int, text: str | bytes, *, arg: int = 0) -> bytes:
    """An OPEN or ERROR frame carrying UTF-8 text (or bytes already encoded)."""
    kind = Kind(kind)
    if kind not in TEXT_KINDS:
        raise FrameError(f"{kind.name} frames do not carry text")
    payload = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return _pack(kind, session_bytes(session), seq, arg, DType.BYTES, (len(payload),), payload)


def encode_control(kind: Kind, session: bytes | uuid.UUID | str, seq: int, *, arg: int = 0) -> bytes:
    """A ROLLBACK (arg = positions to keep) or CLOSE frame; no payload."""
    kind = Kind(kind)
    if kind not in CONTROL_KINDS:
        raise FrameError(f"{kind.name} is not a control frame")
    if kind == Kind.ROLLBACK and arg < 0:
        raise FrameError(f"ROLLBACK keeps a non-negative number of positions, got {arg}")
    return _pack(kind, session_bytes(session), seq, arg, DType.NONE, (), b"")


def encode_indices(kind: Kind, session: bytes | uuid.UUID | str, seq: int, indices: list[int], *, arg: int) -> bytes:
    """A TREE (parent indices) or KEEP (kept node indices) frame; arg = the tree's first position."""
    kind = Kind(kind)
    if kind not in INDEX_KINDS:
        raise FrameError(f"{kind.name} frames do not carry tree indices")
    if not 1 <= len(indices) <= MAX_TREE_NODES:
        raise FrameError(f"{kind.name} carries 1..{MAX_TREE_NODES} indices, got {len(indices)}")
    if arg < 0:
        raise FrameError(f"{kind.name} position must be >= 0, got {arg}")
    payload = np.asarray(indices, dtype=_CODE_TO_NUMPY[DType.INT32]).tobytes()
    return _pack(kind, session_bytes(session), seq, arg, DType.INT32, (len(indices),), payload)


def encode_status(
    session: bytes | uuid.UUID | str, seq: int, mu: float, g: tuple[float, float], *, sessions: int = 0
) -> bytes:
    """A STATUS frame (worker -> device): mu and g = (slope, intercept); `seq` = the frame it travels with."""
    slope, intercept = (float(x) for x in g)
    _check_status(float(mu), slope, intercept, sessions)
    payload = _STATUS.pack(float(mu), slope, intercept)
    return _pack(Kind.STATUS, session_bytes(session), seq, sessions, DType.BYTES, (STATUS_BYTES,), payload)


def encode_error(session: bytes | uuid.UUID | str, seq: int, message: str, status: int = 500) -> bytes:
    return encode_text(Kind.ERROR, session, seq, message, arg=status)


def parse_header(data: bytes | bytearray | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Header:
    """Validate and parse the header (+ shape) at the start of `data`.

    Needs only HEADER_SIZE + 4*ndim bytes, so a stream reader can learn `frame_size` before the payload arrives
    and refuse an oversized frame without buffering it.
    """
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise FrameError(f"frame too short for a header: {len(view)} < {HEADER_SIZE} bytes")
    magic, version, kind, code, ndim, flags, session, seq, arg, payload_len = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r} (not a Tandem hidden-state frame)")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version}, this peer speaks {VERSION}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    try:
        code = DType(code)
    except ValueError:
        raise FrameError(f"unknown dtype code {code}") from None
    if flags != 0:
        raise FrameError(f"reserved flags must be 0, got {flags:#x}")
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim {ndim} > {MAX_NDIM}")
    if payload_len > max_frame_bytes:
        raise FrameError(f"payload of {payload_len} bytes exceeds the {max_frame_bytes}-byte frame limit")
    if len(view) < HEADER_SIZE + 4 * ndim:
        raise FrameError(f"frame too short for its {ndim}-dim shape")
    shape = struct.unpack_from(f"<{ndim}I", view, HEADER_SIZE)
    expected = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[code] if ndim else 0
    if expected != payload_len:
        raise FrameError(
            f"shape {shape} x {_ITEMSIZE[code]}-byte {code.name} = {expected} bytes != payload length {payload_len}"
        )
    if kind in TENSOR_KINDS:
        if code not in _CODE_TO_TORCH:
            raise FrameError(f"{kind.name} must carry float32/float16/bfloat16, got {code.name}")
        if ndim == 0:
            raise FrameError(f"{kind.name} must carry at least one dimension")
    elif kind in TEXT_KINDS:
        if code != DType.BYTES or ndim != 1:
            raise FrameError(f"{kind.name} must carry 1-dim BYTES, got {code.name} with ndim {ndim}")
    elif kind in STATUS_KINDS:
        if code != DType.BYTES or ndim != 1 or payload_len != STATUS_BYTES:
            raise FrameError(f"STATUS must carry exactly {STATUS_BYTES} BYTES, got {code.name} shape {shape}")
        if arg < 0:
            raise FrameError(f"STATUS session count must be >= 0, got {arg}")
    elif kind in INDEX_KINDS:
        if code != DType.INT32 or ndim != 1 or not 1 <= shape[0] <= MAX_TREE_NODES:
            raise FrameError(f"{kind.name} must carry 1..{MAX_TREE_NODES} INT32 indices, got {code.name} shape {shape}")
        if arg < 0:
            raise FrameError(f"{kind.name} position must be >= 0, got {arg}")
    elif code != DType.NONE or ndim != 0 or payload_len != 0:
        raise FrameError(f"{kind.name} must carry no payload, got {code.name} shape {shape}")
    if kind == Kind.ROLLBACK and arg < 0:
        raise FrameError(f"ROLLBACK keeps a non-negative number of positions, got {arg}")
    return Header(kind, code, bytes(session), seq, arg, tuple(shape), payload_len)


def decode_frame(
    data: bytes | bytearray | memoryview,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hidden_size: int | None = None,
    expected_dtype: torch.dtype | None = None,
    expected_kinds: frozenset[Kind] | set[Kind] | None = None,
) -> Frame:
    """Validate and decode one complete frame.

    `hidden_size` checks the last dimension of hidden-state frames, `expected_dtype` their dtype, and
    `expected_kinds` which kinds this receiver accepts. Any violation raises FrameError; trailing bytes too.
    """
    header = parse_header(data, max_frame_bytes=max_frame_bytes)
    if len(data) != header.frame_size:
        raise FrameError(f"frame is {len(data)} bytes, header says {header.frame_size}")
    if expected_kinds is not None and header.kind not in expected_kinds:
        raise FrameError(
            f"unexpected {header.kind.name} frame; expected one of {sorted(k.name for k in expected_kinds)}"
        )
    if header.kind in TENSOR_KINDS:
        if hidden_size is not None and header.shape[-1] != hidden_size:
            raise FrameError(f"{header.kind.name} last dimension {header.shape[-1]} != hidden size {hidden_size}")
        if expected_dtype is not None and header.dtype != dtype_code(expected_dtype):
            raise FrameError(
                f"{header.kind.name} dtype {header.dtype.name} != expected {dtype_code(expected_dtype).name}"
            )
    start = header.frame_size - header.payload_len
    payload = bytes(memoryview(data)[start:])
    frame = Frame(header.kind, header.session, header.seq, header.arg, header.dtype, header.shape, payload)
    if frame.kind == Kind.STATUS:
        frame.status()  # non-finite or negative values: refused here, like any other malformed field
    return frame


def decode_tensor(data: bytes | bytearray | memoryview, **checks: object) -> tuple[Frame, torch.Tensor]:
    """Decode a hidden-state frame and return it with its tensor (FrameError if it is not one)."""
    kinds = checks.pop("expected_kinds", None) or TENSOR_KINDS
    frame = decode_frame(data, expected_kinds=kinds, **checks)  # type: ignore[arg-type]
    if frame.kind not in TENSOR_KINDS:
        raise FrameError(f"{frame.kind.name} frame carries no tensor")
    return frame, frame.tensor()


def _peek(data: bytes | bytearray | memoryview) -> tuple | None:
    """The raw header fields of anything that at least looks like a frame header, unvalidated."""
    if len(data) < HEADER_SIZE or bytes(data[:4]) != MAGIC:
        return None
    return _HEADER.unpack_from(data, 0)


def peek_seq(data: bytes | bytearray | memoryview) -> int | None:
    """The seq field of a frame that may fail validation (so that its ERROR reply can name it)."""
    fields = _peek(data)
    return None if fields is None else fields[7]


def peek_kind(data: bytes | bytearray | memoryview) -> int | None:
    """The kind byte of a frame that may fail validation (possibly no Kind at all)."""
    fields = _peek(data)
    return None if fields is None else fields[2]
