"""HAT worker engine on a tiny random Llama (no weights): batching, limits, ordering; plus the link emulator."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM

from app.worker.engine import Engine
from app.worker.sessions import EngineError
from app.worker.settings import EngineLimits
from clients.hat import wire
from clients.hat.link import DelayLine, LinkProfile
from clients.hat.split import split_model

H = 32  # the hidden size of conftest's `tiny` model


pytestmark = pytest.mark.usefixtures("one_thread")


Kind = wire.Kind


def make_engine(model: LlamaForCausalLM, **limits) -> Engine:
    engine = Engine(split_model(model, 2).middle, EngineLimits(**limits), model_name="tiny")
    engine.start()
    return engine


@pytest.fixture
def engine(tiny: LlamaForCausalLM) -> Iterator[Engine]:
    e = make_engine(tiny, max_sessions=4, max_context=64, max_frame_bytes=64 * 1024)
    yield e
    e.stop()


def open_session(engine: Engine, **over):
    params = {"hidden_size": H, "num_layers": 4, "m": 2, "dtype": "float32", **over}
    session, reply = engine.open(wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(params)))
    frame = wire.decode_frame(reply)
    assert frame.kind == Kind.OPEN and frame.session == session.id
    return session, json.loads(frame.text())


def tensor_frame(session, seq: int, x: torch.Tensor, arg: int, kind: Kind = Kind.DRAFT) -> bytes:
    return wire.encode_tensor(kind, session.id, seq, x, arg=arg)


def replies(fut) -> list[wire.Frame]:
    return [wire.decode_frame(b) for b in fut.result(timeout=10)]


def one(fut) -> wire.Frame:
    """The one reply frame (a STATUS riding with a verification is informational, and skipped here)."""
    (frame,) = [f for f in replies(fut) if f.kind != Kind.STATUS]
    return frame


def error_of(fut) -> tuple[int, str]:
    frame = one(fut)
    assert frame.kind == Kind.ERROR, frame.kind
    return frame.arg, frame.text()


class Paused:
    """Holds the engine thread so that frames submitted meanwhile are all pending in the same tick."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.gate = engine, threading.Event()

    def __enter__(self):
        self.engine.call(self.gate.wait)
        return self

    def __exit__(self, *exc):
        self.gate.set()


@pytest.mark.parametrize("batching", ["greedy", "planned"])
def test_batched_sessions_equal_running_alone(tiny: LlamaForCausalLM, batching: str) -> None:
    engine = make_engine(tiny, max_sessions=4, max_context=64, max_frame_bytes=64 * 1024, batching=batching)
    try:
        _batched_sessions_equal_running_alone(engine, batching)
    finally:
        engine.stop()


def _batched_sessions_equal_running_alone(engine: Engine, batching: str) -> None:
    torch.manual_seed(1)
    xs = [torch.randn(n, H) for n in (7, 3, 1)]
    alone = []
    for x in xs:
        s, _ = open_session(engine)
        alone.append(one(engine.submit(s, tensor_frame(s, 1, x, 0, Kind.DRAFT))).tensor())
        engine.close(s)
    ref = [engine.middle(x[None])[0] for x in xs]  # the model's own layers (LayerStack), one sequence at a time
    sessions = [open_session(engine)[0] for _ in xs]
    before = engine.stats.batched_forwards
    with Paused(engine):
        futs = [engine.submit(s, tensor_frame(s, 1, x, 0)) for s, x in zip(sessions, xs, strict=True)]
    got = [one(f).tensor() for f in futs]
    if batching == "greedy":
        assert engine.stats.batched_forwards == before + 1 and engine.stats.last_rows == 3
    else:  # the planner may run them in several passes; every row's result is the same either way
        assert engine.stats.planned_passes >= 1
    # Nothing but the weights is shared between rows, yet a batched pass is another computation path: the CPU's
    # matrix kernels may block and sum a pass of more rows otherwise (bit-identical with this machine's AVX-512
    # kernels, not with torch's generic ones in `make test-portable`). So: equal within float rounding, and equal to
    # the model's own layers.
    for a, b, r in zip(alone, got, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert torch.allclose(a, r, atol=1e-5)

    # A second round mixes a decode row with a prefill continuation; again one pass, again equal to alone.
    more = [torch.randn(n, H) for n in (2, 5, 1)]
    with Paused(engine):
        futs = [engine.submit(s, tensor_frame(s, 2, x, len(x0))) for s, x, x0 in zip(sessions, more, xs, strict=True)]
    batched = [one(f).tensor() for f in futs]
    for x0, x, b in zip(xs, more, batched, strict=True):
        s, _ = open_session(engine)
        engine.submit(s, tensor_frame(s, 1, x0, 0, Kind.PREFILL_CHUNK)).result(10)
        assert torch.allclose(one(engine.submit(s, tensor_frame(s, 2, x, len(x0)))).tensor(), b, rtol=1e-5, atol=1e-6)
        engine.close(s)


def test_prefill_reply_is_the_last_position(engine: Engine) -> None:
    s, info = open_session(engine)
    assert info["hidden_size"] == H and info["max_context"] == 64 and len(info["g"]) == 2
    x = torch.randn(5, H)
    frame = one(engine.submit(s, tensor_frame(s, 1, x, 0, Kind.PREFILL_CHUNK)))
    assert frame.kind == Kind.DEEP_STATE and frame.shape == (1, H) and frame.arg == 4 and frame.seq == 1
    assert torch.allclose(frame.tensor()[0], engine.middle(x[None])[0, -1], atol=1e-5)


def test_bad_frames_are_rejected_and_the_session_keeps_working(engine: Engine) -> None:
    s, _ = open_session(engine)
    other, _ = open_session(engine)
    x = torch.randn(3, H)
    cases = [
        (b"not a frame at all", 400, "malformed"),
        (tensor_frame(s, 1, torch.randn(4000, H), 0), 413, "oversized"),
        (tensor_frame(s, 2, x.half(), 0), 400, "dtype"),
        (tensor_frame(s, 3, torch.randn(3, H + 1), 0), 400, "shape"),
        (tensor_frame(s, 4, torch.randn(2, 3, H), 0), 400, "shape"),
        (tensor_frame(s, 5, x, 0, Kind.VERIFY_RESULT), 400, "kind"),
        (wire.encode_text(Kind.OPEN, s.id, 6, "{}"), 400, "kind"),
        (tensor_frame(s, 7, torch.full((3, H), float("nan")), 0), 400, "nonfinite"),
        (tensor_frame(other, 8, x, 0), 400, "session"),
        (tensor_frame(s, 9, x, 5), 409, "position"),
        (wire.encode_control(Kind.ROLLBACK, s.id, 10, arg=3), 400, "position"),
        (tensor_frame(s, 10, x, 0), 409, "seq"),  # seq 10 was used by the bad ROLLBACK
        (tensor_frame(s, 500, x, 0), 409, "seq"),  # too far ahead
    ]
    for data, status, reason in cases:
        got_status, text = error_of(engine.submit(s, data))
        assert (got_status, text.split(":")[0]) == (status, reason), text
    assert engine.stats.rejected["oversized"] == 1 and engine.stats.rejected["shape"] == 2
    frame = one(engine.submit(s, tensor_frame(s, 11, x, 0)))
    assert frame.kind == Kind.VERIFY_RESULT and frame.seq == 11 and frame.shape == (3, H)
    assert one(engine.submit(other, tensor_frame(other, 1, x, 0))).kind == Kind.VERIFY_RESULT


def test_open_validation_and_session_limit(engine: Engine) -> None:
    with pytest.raises(EngineError) as e:
        open_session(engine, prompt="secret text")
    assert e.value.status == 400 and "prompt" in e.value.message
    with pytest.raises(EngineError) as e:
        open_session(engine, hidden_size=64)
    assert e.value.status == 400 and "hidden_size 64" in e.value.message
    with pytest.raises(EngineError) as e:
        open_session(engine, dtype="float16")
    assert "dtype" in e.value.message
    sessions = [open_session(engine)[0] for _ in range(4)]
    with pytest.raises(EngineError) as e:
        open_session(engine)
    assert e.value.status == 503 and e.value.reason == "full"
    engine.close(sessions[0])
    open_session(engine)  # the freed slot is usable at once


def test_context_limit_rollback_and_positions(engine: Engine) -> None:
    s, _ = open_session(engine)
    assert one(engine.submit(s, tensor_frame(s, 1, torch.randn(60, H), 0, Kind.PREFILL_CHUNK))).arg == 59
    status, text = error_of(engine.submit(s, tensor_frame(s, 2, torch.randn(5, H), 60)))
    assert status == 413 and text.startswith("context") and len(s.cache) == 60  # nothing appended
    assert one(engine.submit(s, tensor_frame(s, 3, torch.randn(4, H), 60))).shape == (4, H)
    assert error_of(engine.submit(s, tensor_frame(s, 4, torch.randn(1, H), 62)))[0] == 409
    assert engine.submit(s, wire.encode_control(Kind.ROLLBACK, s.id, 5, arg=61)).result(10) == []
    engine.call(lambda: None).result(10)
    assert len(s.cache) == 61 and s.cache.next_position == 61
    assert one(engine.submit(s, tensor_frame(s, 6, torch.randn(3, H), 61))).arg == 61


def test_rollback_then_redecode_is_exact(engine: Engine) -> None:
    torch.manual_seed(2)
    prompt, good = torch.randn(6, H), torch.randn(2, H)
    ref_s, _ = open_session(engine)
    engine.submit(ref_s, tensor_frame(ref_s, 1, prompt, 0, Kind.PREFILL_CHUNK)).result(10)
    want = one(engine.submit(ref_s, tensor_frame(ref_s, 2, good, 6))).tensor()
    s, _ = open_session(engine)
    engine.submit(s, tensor_frame(s, 1, prompt, 0, Kind.PREFILL_CHUNK)).result(10)
    engine.submit(s, tensor_frame(s, 2, torch.randn(4, H), 6)).result(10)  # drafts, all rejected
    engine.submit(s, wire.encode_control(Kind.ROLLBACK, s.id, 3, arg=6))
    assert torch.equal(one(engine.submit(s, tensor_frame(s, 4, good, 6))).tensor(), want)


def test_frames_are_applied_in_seq_order(engine: Engine) -> None:
    s, _ = open_session(engine)
    prompt, step = torch.randn(4, H), torch.randn(1, H)
    with Paused(engine):
        later = engine.submit(s, tensor_frame(s, 2, step, 4))  # arrives first, waits for seq 1
        first = engine.submit(s, tensor_frame(s, 1, prompt, 0, Kind.PREFILL_CHUNK))
    assert one(first).kind == Kind.DEEP_STATE and one(later).kind == Kind.VERIFY_RESULT
    assert error_of(engine.submit(s, tensor_frame(s, 2, step, 5)))[0] == 409  # duplicate seq


def test_idle_sessions_expire_without_touching_others(tiny: LlamaForCausalLM) -> None:
    # The engine's clock, moved by the test: which session is idle is decided by its time, not by how fast this
    # machine runs the frames (real 0.1 s gaps against a 0.3 s timeout expired the busy session too on a loaded box).
    now = [0.0]
    engine = Engine(
        split_model(tiny, 2).middle, EngineLimits(idle_timeout=10.0), model_name="tiny", clock=lambda: now[0]
    )
    engine.start()
    try:
        idle, _ = open_session(engine)
        busy, _ = open_session(engine)
        expired: list[str] = []
        idle.on_expire = lambda message, status: expired.append(message) if status == 408 else None
        for seq in range(1, 8):
            now[0] += 2.0  # 14 s in all: the idle session's last frame is past the timeout, the busy one's never
            assert (
                one(engine.submit(busy, tensor_frame(busy, seq, torch.randn(1, H), seq - 1))).kind == Kind.VERIFY_RESULT
            )
            assert engine.session(busy.id) is not None
            if now[0] <= 10.0:
                assert engine.session(idle.id) is not None, now[0]  # not before its time
        deadline = time.monotonic() + 30  # the engine thread's next check (every idle_timeout / 4, at most 0.5 s)
        while not expired:
            assert time.monotonic() < deadline, "the idle session did not expire"
            time.sleep(0.01)
        assert expired[0].startswith("idle") and engine.session(idle.id) is None
        assert engine.session(busy.id) is not None and engine.stats.rejected["idle"] == 1
        assert error_of(engine.submit(idle, tensor_frame(idle, 1, torch.randn(1, H), 0)))[0] == 410
    finally:
        engine.stop()


def test_a_failing_row_does_not_fail_its_batch(engine: Engine) -> None:
    good, _ = open_session(engine)
    bad, _ = open_session(engine)
    real = engine.ragged.forward

    def flaky(rows, trees=None):
        if any(cache is bad.cache for _, cache in rows):
            raise RuntimeError("boom")
        return real(rows, trees)

    engine.ragged.forward = flaky  # type: ignore[method-assign]
    with Paused(engine):
        f_good = engine.submit(good, tensor_frame(good, 1, torch.randn(2, H), 0))
        f_bad = engine.submit(bad, tensor_frame(bad, 1, torch.randn(2, H), 0))
    assert one(f_good).kind == Kind.VERIFY_RESULT
    assert error_of(f_bad)[0] == 500 and len(bad.cache) == 0


def test_close_frame_ends_the_session(engine: Engine) -> None:
    s, _ = open_session(engine)
    assert engine.submit(s, wire.encode_control(Kind.CLOSE, s.id, 1)).result(10) == []
    engine.call(lambda: None).result(10)
    assert engine.session(s.id) is None and engine.session_count == 0


# --- link emulator ----------------------------------------------------------------------------------


def test_delay_line_schedule() -> None:
    line: DelayLine[bytes] = DelayLine(bandwidth=1000.0, latency=0.05)
    assert line.schedule(100, now=0.0) == pytest.approx(0.15)  # 0.1 s on the wire + 50 ms
    assert line.schedule(100, now=0.0) == pytest.approx(0.25)  # queued behind the first
    assert line.schedule(10, now=1.0) == pytest.approx(1.06)
    jittery: DelayLine[bytes] = DelayLine(latency=0.01, jitter=0.01, seed=1)
    arrivals = [jittery.schedule(1, now=i * 0.001) for i in range(50)]
    assert arrivals == sorted(arrivals) and all(a >= i * 0.001 for i, a in enumerate(arrivals))
    p = LinkProfile.parse("latency=20ms, jitter=2ms, up=10MB/s, down=15MiB/s, seed=3")
    assert (p.latency, p.jitter, p.up_bandwidth, p.down_bandwidth, p.seed) == (0.02, 0.002, 10e6, 15 * 2**20, 3)
    with pytest.raises(ValueError):
        LinkProfile.parse("lag=3")


async def test_delay_line_delivers_in_order_after_the_delay() -> None:
    line: DelayLine[bytes] = DelayLine(bandwidth=100_000.0, latency=0.03)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    line.put(b"a" * 1000, 1000)  # 10 ms + 30 ms
    line.put(b"b", 1)
    assert await line.get() == b"a" * 1000
    assert loop.time() - t0 >= 0.039
    assert await line.get() == b"b"
    passthrough: DelayLine[bytes] = DelayLine()
    passthrough.put(b"x", 1)
    assert await asyncio.wait_for(passthrough.get(), 0.05) == b"x"


def test_worker_compute_device_setting() -> None:
    from app.worker.compute import compute_device
    from app.worker.settings import WorkerSettings

    assert WorkerSettings().device == "auto"
    assert compute_device("cpu") == torch.device("cpu")
    assert compute_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            compute_device("cuda")


# --- STATUS: the worker's mu and g reach the device mid-session -------------------------------------------------


def test_status_rides_with_a_verification_when_mu_or_g_moved(tiny: LlamaForCausalLM) -> None:
    engine = make_engine(tiny, max_sessions=4, max_context=64, max_frame_bytes=64 * 1024, status_tolerance=0.1)
    try:
        s, info = open_session(engine)
        assert s.told == (info["mu"], *info["g"])  # what OPEN told the device
        # A long prefill pass moves mu far from what OPEN said: the next verification brings a STATUS first.
        engine.submit(s, tensor_frame(s, 1, torch.randn(40, H), 0, Kind.PREFILL_CHUNK)).result(10)
        frames = replies(engine.submit(s, tensor_frame(s, 2, torch.randn(3, H), 40)))
        assert [f.kind for f in frames] == [Kind.STATUS, Kind.VERIFY_RESULT]
        status = frames[0].status()
        assert frames[0].seq == 2 and frames[0].session == s.id and status.sessions == 1
        assert (status.mu, status.g) == (engine.stats.mu.get(), engine.stats.g.coefficients())
        assert s.told == (status.mu, *status.g) and engine.stats.status_frames == 1
        # Prefill replies never carry one (the device plans rounds, not chunks, with them).
        other, _ = open_session(engine)
        assert [f.kind for f in replies(engine.submit(other, tensor_frame(other, 1, torch.randn(4, H), 0)))] in (
            [Kind.VERIFY_RESULT],
            [Kind.STATUS, Kind.VERIFY_RESULT],
        )
        # Nothing moved beyond the tolerance: no STATUS.
        s.told = (engine.stats.mu.get(), *engine.stats.g.coefficients())
        engine.limits = engine.limits.model_copy(update={"status_tolerance": 1e9})
        assert [f.kind for f in replies(engine.submit(s, tensor_frame(s, 3, torch.randn(3, H), 43)))] == [
            Kind.VERIFY_RESULT
        ]
    finally:
        engine.stop()


def test_the_engine_learns_each_sessions_turn_between_its_reply_and_its_next_frame(engine: Engine) -> None:
    """What anticipation (policies/fair_share.py) waits on: after a reply the session is answered (its turn), and its
    next tensor frame's arrival times the gap; a ROLLBACK in between does not end its turn."""
    session, _ = open_session(engine)
    assert one(engine.submit(session, tensor_frame(session, 1, torch.randn(3, H), 0))).kind == Kind.VERIFY_RESULT
    assert session.answered_at is not None and session.reply_gap.count == 0
    engine.submit(session, wire.encode_control(Kind.ROLLBACK, session.id, 2, arg=0)).result(timeout=10)
    time.sleep(0.02)
    assert session.answered_at is not None  # a control frame is not its next round
    assert one(engine.submit(session, tensor_frame(session, 3, torch.randn(3, H), 0))).kind == Kind.VERIFY_RESULT
    assert session.reply_gap.count == 1 and session.reply_gap.get() >= 0.02
