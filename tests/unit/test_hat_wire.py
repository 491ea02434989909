"""The hidden-state frame codec: exact round trips and strict rejection of anything malformed."""

from __future__ import annotations

import pickle
import struct
import uuid

import pytest
import torch

from clients.hat import wire
from clients.hat.wire import DType, FrameError, Kind

SESSION = uuid.UUID("12345678-1234-5678-1234-567812345678")


def _frame(
    kind: Kind = Kind.PREFILL_CHUNK, shape: tuple[int, ...] = (3, 8), dtype: torch.dtype = torch.float32
) -> bytes:
    return wire.encode_tensor(kind, SESSION, 7, torch.randn(shape).to(dtype), arg=42)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 16), (1, 1, 16), (2, 3, 16), (0, 16)])
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 100).to(dtype)
    data = wire.encode_tensor(Kind.DRAFT, SESSION, 2**64 - 1, t, arg=-5)
    frame, got = wire.decode_tensor(data, hidden_size=16, expected_dtype=dtype)
    assert frame.kind == Kind.DRAFT and frame.seq == 2**64 - 1 and frame.arg == -5
    assert frame.session_uuid == SESSION and frame.shape == shape
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(
        got.view(torch.int16) if dtype != torch.float32 else got.view(torch.int32),
        t.view(torch.int16) if dtype != torch.float32 else t.view(torch.int32),
    )
    got.add_(1)  # decoded tensors own writable memory


def test_special_values_and_noncontiguous_input() -> None:
    t = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0]]).t().contiguous().t()  # [1, 4]
    t = torch.cat([t, t]).t()  # non-contiguous [4, 2]
    _, got = wire.decode_tensor(wire.encode_tensor(Kind.DEEP_STATE, SESSION, 0, t))
    assert torch.equal(got.isnan(), t.isnan()) and torch.equal(got.nan_to_num(), t.nan_to_num())
    assert torch.signbit(got[3, 0])


def test_wire_dtype_casts_and_halves_bytes() -> None:
    t = torch.randn(4, 32)
    full = wire.encode_tensor(Kind.PREFILL_CHUNK, SESSION, 0, t)
    half = wire.encode_tensor(Kind.PREFILL_CHUNK, SESSION, 0, t, wire_dtype=torch.float16)
    assert len(full) - wire.HEADER_SIZE - 8 == 2 * (len(half) - wire.HEADER_SIZE - 8)
    _, got = wire.decode_tensor(half)
    assert got.dtype == torch.float16 and torch.allclose(got.float(), t, atol=1e-2)


def test_header_layout_is_explicit() -> None:
    data = _frame(shape=(3, 8))
    magic, version, kind, code, ndim, flags, session, seq, arg, plen = struct.unpack_from("<4sBBBBH16sQqQ", data)
    assert (magic, version, kind, code, ndim, flags) == (b"TNDH", 1, Kind.PREFILL_CHUNK, DType.FLOAT32, 2, 0)
    assert session == SESSION.bytes and seq == 7 and arg == 42 and plen == 3 * 8 * 4
    assert struct.unpack_from("<2I", data, wire.HEADER_SIZE) == (3, 8)
    assert len(data) == wire.HEADER_SIZE + 8 + plen
    assert wire.parse_header(data[: wire.HEADER_SIZE + 8]).frame_size == len(data)


def test_control_and_text_frames() -> None:
    rb = wire.decode_frame(wire.encode_control(Kind.ROLLBACK, SESSION, 3, arg=17))
    assert rb.kind == Kind.ROLLBACK and rb.arg == 17 and rb.payload == b"" and rb.shape == ()
    assert wire.decode_frame(wire.encode_control(Kind.CLOSE, SESSION.bytes, 4)).kind == Kind.CLOSE
    err = wire.decode_frame(wire.encode_error(str(SESSION), 5, "middle submodel exploded: ünïcode", status=503))
    assert err.kind == Kind.ERROR and err.arg == 503 and err.text() == "middle submodel exploded: ünïcode"
    opened = wire.decode_frame(wire.encode_text(Kind.OPEN, SESSION, 0, '{"hidden": 896}'))
    assert opened.text() == '{"hidden": 896}'
    with pytest.raises(FrameError):
        opened.tensor()
    with pytest.raises(FrameError):
        rb.text()


def _corrupt(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: _corrupt(d, 4, "<B", 2), "version"),
        (lambda d: _corrupt(d, 5, "<B", 99), "kind"),
        (lambda d: _corrupt(d, 6, "<B", 77), "dtype"),
        (lambda d: _corrupt(d, 6, "<B", DType.FLOAT16), "payload length"),  # shape x itemsize != payload
        (lambda d: _corrupt(d, 6, "<B", DType.BYTES), "payload length"),
        (lambda d: _corrupt(d, 7, "<B", 9), "ndim"),
        (lambda d: _corrupt(d, 8, "<H", 1), "flags"),
        (lambda d: _corrupt(d, 42, "<Q", 10**12), "exceeds"),
        (lambda d: _corrupt(d, 42, "<Q", 3 * 8 * 4 - 1), "payload length"),
        (lambda d: _corrupt(d, wire.HEADER_SIZE, "<I", 4), "payload length"),  # shape lies
        (lambda d: d[:-1], "frame is"),  # truncated payload
        (lambda d: d + b"\0", "frame is"),  # trailing bytes
        (lambda d: d[:20], "too short"),
        (lambda d: d[: wire.HEADER_SIZE + 2], "too short"),
    ],
)
def test_malformed_frames_raise_frame_error(mutate, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        wire.decode_frame(mutate(_frame(shape=(3, 8))))


def test_expectations_are_enforced() -> None:
    data = _frame(shape=(3, 8))
    with pytest.raises(FrameError, match="hidden size"):
        wire.decode_frame(data, hidden_size=896)
    with pytest.raises(FrameError, match="dtype"):
        wire.decode_frame(data, expected_dtype=torch.float16)
    with pytest.raises(FrameError, match="unexpected"):
        wire.decode_frame(data, expected_kinds={Kind.DRAFT})
    with pytest.raises(FrameError, match="exceeds"):
        wire.decode_frame(data, max_frame_bytes=64)
    with pytest.raises(FrameError, match=r"no tensor|unexpected"):
        wire.decode_tensor(wire.encode_control(Kind.CLOSE, SESSION, 0))
    assert wire.decode_frame(data, hidden_size=8, expected_dtype=torch.float32).shape == (3, 8)


def test_control_frames_with_payload_and_negative_rollback_are_rejected() -> None:
    bad = wire._pack(Kind.CLOSE, SESSION.bytes, 0, 0, DType.FLOAT32, (1,), b"\0" * 4)
    with pytest.raises(FrameError, match="no payload"):
        wire.decode_frame(bad)
    bad = wire._pack(Kind.ROLLBACK, SESSION.bytes, 0, -1, DType.NONE, (), b"")
    with pytest.raises(FrameError, match="non-negative"):
        wire.decode_frame(bad)
    as_bytes = wire._pack(Kind.DRAFT, SESSION.bytes, 0, 0, DType.BYTES, (4,), b"\0" * 4)
    with pytest.raises(FrameError, match="must carry"):
        wire.decode_frame(as_bytes)
    scalar = wire._pack(Kind.DRAFT, SESSION.bytes, 0, 0, DType.FLOAT32, (), b"")
    with pytest.raises(FrameError, match="at least one dimension"):
        wire.decode_frame(scalar)


def test_encoder_refuses_what_decoder_would_refuse() -> None:
    with pytest.raises(FrameError):
        wire.encode_tensor(Kind.DRAFT, SESSION, 0, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(FrameError):
        wire.encode_tensor(Kind.DRAFT, SESSION, 0, torch.zeros(1, 1, 1, 1, 1))
    with pytest.raises(FrameError):
        wire.encode_tensor(Kind.ROLLBACK, SESSION, 0, torch.zeros(2, 2))
    with pytest.raises(FrameError):
        wire.encode_control(Kind.DRAFT, SESSION, 0)
    with pytest.raises(FrameError):
        wire.encode_control(Kind.ROLLBACK, SESSION, 0, arg=-1)
    with pytest.raises(FrameError):
        wire.encode_tensor(Kind.DRAFT, b"short", 0, torch.zeros(2, 2))
    with pytest.raises(FrameError):
        wire.encode_tensor(Kind.DRAFT, SESSION, -1, torch.zeros(2, 2))


def test_pickle_payload_is_just_bytes() -> None:
    """A peer sending a pickle gets a FrameError, never code execution."""
    evil = pickle.dumps(torch.zeros(2))
    with pytest.raises(FrameError):
        wire.decode_frame(evil)
    data = wire._pack(Kind.OPEN, SESSION.bytes, 0, 0, DType.BYTES, (len(evil),), evil)
    assert wire.decode_frame(data).payload == evil  # opaque bytes, never unpickled


def test_bytes_helpers() -> None:
    t = torch.randn(2, 3).to(torch.bfloat16)
    code, shape, payload = wire.tensor_to_bytes(t)
    assert code == DType.BFLOAT16 and shape == (2, 3) and len(payload) == 12
    assert torch.equal(wire.bytes_to_tensor(code, shape, payload), t)
    with pytest.raises(FrameError):
        wire.bytes_to_tensor(code, (2, 4), payload)


def test_peeks_read_a_header_that_fails_validation() -> None:
    data = bytearray(_frame())
    data[8] = 1  # reserved flags: decode refuses the frame, its seq and kind are still readable
    with pytest.raises(FrameError):
        wire.decode_frame(bytes(data))
    assert wire.peek_seq(bytes(data)) == 7 and wire.peek_kind(bytes(data)) == Kind.PREFILL_CHUNK
    assert wire.peek_seq(b"XXXX" + bytes(data[4:])) is None and wire.peek_kind(bytes(data[:10])) is None


def test_dtype_names() -> None:
    assert wire.dtype_by_name("float16") is torch.float16 and wire.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        wire.dtype_by_name("int8")


# --- STATUS (the worker's mu and g, mid-session) ---------------------------------------------------------------


def test_status_round_trip_is_exact() -> None:
    data = wire.encode_status(SESSION, 9, 3.25, (1.5e-4, -2e-3), sessions=3)
    assert len(data) == wire.HEADER_SIZE + 4 + wire.STATUS_BYTES
    frame = wire.decode_frame(data, expected_kinds={Kind.STATUS, Kind.VERIFY_RESULT})
    assert frame.kind == Kind.STATUS and frame.seq == 9 and frame.arg == 3 and frame.shape == (wire.STATUS_BYTES,)
    status = frame.status()
    assert status == wire.WorkerStatus(3.25, 1.5e-4, -2e-3, 3)  # float64 on the wire: bit-exact
    assert status.g == (1.5e-4, -2e-3)
    assert struct.unpack("<ddd", frame.payload) == (3.25, 1.5e-4, -2e-3)  # explicit little-endian layout
    with pytest.raises(FrameError):
        frame.tensor()
    with pytest.raises(FrameError, match="STATUS"):
        wire.decode_frame(wire.encode_control(Kind.CLOSE, SESSION, 0)).status()


@pytest.mark.parametrize(
    ("code", "shape", "payload", "arg", "message"),
    [
        (DType.BYTES, (23,), b"\0" * 23, 0, "exactly 24"),  # short
        (DType.BYTES, (25,), b"\0" * 25, 0, "exactly 24"),  # long
        (DType.FLOAT32, (6,), b"\0" * 24, 0, "exactly 24"),  # a tensor dtype
        (DType.NONE, (), b"", 0, "exactly 24"),  # no payload
        (DType.BYTES, (2, 12), b"\0" * 24, 0, "exactly 24"),  # two dims
        (DType.BYTES, (24,), b"\0" * 24, -1, "session count"),
        (DType.BYTES, (24,), struct.pack("<ddd", float("nan"), 0, 0), 0, "finite"),
        (DType.BYTES, (24,), struct.pack("<ddd", 1.0, float("inf"), 0), 0, "finite"),
        (DType.BYTES, (24,), struct.pack("<ddd", -1.0, 0, 0), 0, "mu must be"),
    ],
)
def test_malformed_status_frames_are_refused(code, shape, payload, arg, message) -> None:
    bad = wire._pack(Kind.STATUS, SESSION.bytes, 1, arg, code, shape, payload)
    with pytest.raises(FrameError, match=message):
        wire.decode_frame(bad)


def test_status_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(FrameError, match="finite"):
        wire.encode_status(SESSION, 1, float("nan"), (0.0, 0.0))
    with pytest.raises(FrameError, match="mu must be"):
        wire.encode_status(SESSION, 1, -0.5, (0.0, 0.0))
    with pytest.raises(FrameError, match="session count"):
        wire.encode_status(SESSION, 1, 1.0, (0.0, 0.0), sessions=-2)
    with pytest.raises(FrameError, match="do not carry text"):
        wire.encode_text(Kind.STATUS, SESSION, 1, "mu=3")
    with pytest.raises(FrameError, match="not a control frame"):
        wire.encode_control(Kind.STATUS, SESSION, 1)
