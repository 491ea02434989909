"""HAT end to end on real weights: a worker (uvicorn on loopback, in a thread) and HATBackend device halves.

SmolLM2-135M for most tests (fast); Qwen2.5-Coder-0.5B where its vocabulary's tool-call tokens matter (the grammar
tests; the bundled default's greedy run with its shipped adapter is test_hat_cheap_drafts.py's).
Device and worker share one loaded model object in this process (neither mutates it), so nothing loads twice.

Greedy exactness: HAT must produce the plain U-shape greedy tokens (split model, one token per step). Verifying
k+1 positions in one pass is another computation path, which may flip an exact near-tie: every comparison with a
U-shape reference follows hf_fixtures' near-tie rule (check_against_reference). HAT's answers are compared with each
other exactly only along one path (the same options, or the batch-invariant passes of the worker and the station).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.launcher import free_port
from app.worker.server import create_worker, uvicorn_config_kwargs
from app.worker.settings import WorkerSettings
from clients.base import BackendError, GenerationRequest, TokenEvent
from clients.hat import wire
from clients.hat.adapter import draft_files
from clients.hat.device import HATBackend
from clients.hat.half import DeviceHalf
from clients.hat.link import LinkProfile
from clients.hat.options import HATOptions
from clients.hat.split import split_model
from clients.sampling import LogitAdjuster
from tests.integration.hf_fixtures import (
    QWEN05,
    SMOL,
    chat_prompt,
    check_against_reference,
    load,
    relayed,
    top2_gap,
)

Kind = wire.Kind
TOKEN = "worker-token-5c1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
N = 16  # long enough for accepted drafts, rollbacks and a stop string inside the answer
PROMPT = "Write a Python function that checks whether a number is prime."
OTHER = "List three colours of the rainbow."


class WorkerServer:
    """A real worker app on a free loopback port, served by uvicorn in a thread, recording every frame it gets."""

    def __init__(self, model: Any, name: str, **overrides: Any) -> None:
        self.settings = WorkerSettings(model=name, auth_token=TOKEN, **{"port": free_port(), **overrides})
        self.frames: list[tuple[bytes | None, bytes]] = []
        self.on_frame: Callable[[bytes | None, bytes], None] | None = None  # a test's hook, after recording
        self.app = create_worker(self.settings, model=model, frame_hook=self._record)
        kwargs = {**uvicorn_config_kwargs(self.settings), "log_level": "warning"}
        self.server = uvicorn.Server(uvicorn.Config(self.app, **kwargs))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.http = f"http://127.0.0.1:{self.settings.port}"
        self.ws = f"ws://127.0.0.1:{self.settings.port}"

    def _record(self, sid: bytes | None, data: bytes) -> None:
        self.frames.append((sid, data))
        if self.on_frame is not None:
            self.on_frame(sid, data)

    def start(self) -> WorkerServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.http + "/health/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("worker did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def engine(self):
        return self.app.state.worker.engine

    def backend(
        self,
        model: Any,
        tok: Any,
        name: str,
        url: str | None = None,
        *,
        adapter_path: Any = None,
        draft_vocab_path: Any = None,
        **kw: Any,
    ) -> HATBackend:
        """A device half of `model` for this worker; `kw`: HATOptions."""
        kw.setdefault("chunk_size", 16)
        kw.setdefault("auth_token", TOKEN)
        options = HATOptions(worker_url=url or self.ws, **kw)
        return HATBackend(
            options,
            model_id=name,
            adapter_path=adapter_path,
            draft_vocab_path=draft_vocab_path,
            model=model,
            tokenizer=tok,
        )


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    return load(SMOL)


@pytest.fixture(scope="module")
def worker(smol) -> Iterator[WorkerServer]:
    server = WorkerServer(smol[0], SMOL, max_sessions=6, max_frame_bytes=256 * 1024, idle_timeout=60).start()
    yield server
    server.stop()


def prompt_ids(tok: Any, user: str = PROMPT) -> list[int]:
    return tok(chat_prompt(tok, user), add_special_tokens=False)["input_ids"]


def u_shape_greedy(model: Any, ids: list[int], n: int, chunk: int = 16) -> tuple[list[int], list[float]]:
    """Plain U-shape greedy: split model, chunked prefill, then one token per forward. Tokens and top-2 gaps."""
    session = split_model(model, 2).session()
    logits = session.prefill(torch.tensor([ids]), chunk)[0, -1]
    tokens, gaps = [], []
    for _ in range(n):
        gaps.append(top2_gap(logits))
        tokens.append(int(logits.argmax()))
        logits = session.forward([[tokens[-1]]])[0, -1]
    return tokens, gaps


async def collect(backend: HATBackend, ids: list[int], **req: Any) -> list[TokenEvent]:
    request = GenerationRequest(prompt_text="", prompt_ids=tuple(ids), **{"max_tokens": N, "temperature": 0.0, **req})
    return [e async for e in backend.stream(request)]


def token_ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


@pytest.fixture(scope="module")
def reference(smol) -> tuple[list[int], list[float]]:
    return u_shape_greedy(smol[0], prompt_ids(smol[1]), N)


async def http(method: str, url: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.request(method, url, **kw)


async def wait_for(predicate, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


# --- exactness and transports -----------------------------------------------------------------------


async def test_greedy_equals_u_shape_over_both_transports(worker: WorkerServer, smol, reference) -> None:
    model, tok = smol
    ref, gaps = reference
    outputs = []
    for url in (worker.ws, worker.http):
        backend = worker.backend(model, tok, SMOL, url)
        await backend.start()
        assert await backend.ready()
        events = await collect(backend, prompt_ids(tok))
        outputs.append(token_ids(events))
        stats = backend.stats.summary()
        print(f"{backend.transport}: {stats}")
        assert backend.stats.prefill_chunks == -(-len(prompt_ids(tok)) // 16)  # chunked, pipelined prefill
        assert stats["rounds"] >= 1 and stats["accept_length"] >= 1.0
        await backend.close()
    assert outputs[0] == outputs[1]  # WebSocket and POST+SSE: same frames, same answer
    check_against_reference(outputs[0], ref, gaps)
    await wait_for(lambda: worker.engine.session_count == 0)


# --- privacy ----------------------------------------------------------------------------------------


async def test_only_hidden_states_and_control_frames_leave_the_device(worker: WorkerServer, smol) -> None:
    model, tok = smol
    backend = worker.backend(model, tok, SMOL)
    await backend.start()
    worker.frames.clear()
    ids = prompt_ids(tok)
    events = await collect(backend, ids, max_tokens=10)
    await backend.close()
    await wait_for(lambda: worker.engine.session_count == 0)
    assert worker.frames and backend.stats.rounds >= 1
    hidden = model.config.hidden_size
    text = chat_prompt(tok, PROMPT).encode()
    answer = "".join(e.text for e in events).encode()
    id_patterns = [
        torch.tensor(ids[i : i + 3], dtype=dt).numpy().tobytes() for i in (0, 10) for dt in (torch.int32, torch.int64)
    ]
    kinds = set()
    for _sid, data in worker.frames:
        frame = wire.decode_frame(data)
        kinds.add(frame.kind)
        if frame.kind == Kind.OPEN:
            params = json.loads(frame.text())
            assert set(params) <= {"protocol", "hidden_size", "num_layers", "m", "dtype", "model"}
            assert all(isinstance(v, int) for k, v in params.items() if k not in ("dtype", "model"))
            assert params["model"] == SMOL and params["dtype"] == "float32"
        elif frame.kind in (Kind.PREFILL_CHUNK, Kind.DRAFT):
            assert frame.dtype == wire.DType.FLOAT32
            assert len(frame.shape) == 2 and frame.shape[1] == hidden and frame.shape[0] >= 1
            assert bool(torch.isfinite(frame.tensor()).all())
        elif frame.kind in (Kind.TREE, Kind.KEEP):  # a lookup round's tree: node indices, never token ids
            nodes = frame.indices()  # TREE: parent indices (-1 for the root); KEEP: the kept path's node indices
            assert all(-1 <= v < 32 for v in nodes), nodes
        else:
            assert frame.kind in (Kind.ROLLBACK, Kind.CLOSE), frame.kind
            assert frame.payload == b"" and frame.shape == ()
        for secret in (text[:24], text[-24:], answer[:12], *id_patterns):
            assert secret not in data
    assert {Kind.OPEN, Kind.PREFILL_CHUNK, Kind.DRAFT, Kind.CLOSE} <= kinds


def sent_states(frames: list[tuple[bytes | None, bytes]], kind: Kind) -> list[torch.Tensor]:
    """The hidden states of the frames of `kind` the worker received, in order."""
    decoded = (wire.decode_frame(data) for _sid, data in frames)
    return [f.tensor().reshape(-1, f.shape[-1]) for f in decoded if f.kind == kind]


def relative_rms(got: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    return (got - clean).pow(2).mean(-1).sqrt() / clean.pow(2).mean(-1).sqrt()


async def test_noise_moves_the_sent_states_and_noise_zero_changes_nothing(worker: WorkerServer, smol, reference):
    model, tok = smol
    ids = prompt_ids(tok)
    runs = {}
    for name, kw in (("default", {}), ("zero", {"noise": 0.0, "noise_seed": 3}), ("noised", {"noise": 0.2})):
        backend = worker.backend(model, tok, SMOL, **kw)
        await backend.start()
        worker.frames.clear()
        events = await collect(backend, ids)
        await backend.close()
        await wait_for(lambda: worker.engine.session_count == 0)
        frames = list(worker.frames)
        runs[name] = (events, sent_states(frames, Kind.PREFILL_CHUNK), sent_states(frames, Kind.DRAFT))
    split = split_model(model, 2)
    with torch.inference_mode():
        clean = split.input(torch.tensor([ids]))[0]
    # noise = 0: the very same frames as without the option, and the same greedy answer as U-shape decoding
    events, prefill, drafts = runs["zero"]
    assert all(torch.equal(a, b) for a, b in zip(prefill, runs["default"][1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(drafts, runs["default"][2], strict=True))
    assert torch.allclose(torch.cat(prefill), clean, atol=1e-4)
    assert token_ids(events) == token_ids(runs["default"][0])
    check_against_reference(token_ids(events), *reference)
    # noise = 0.2: every sent state moved by ~0.2 of its RMS (prefill chunks and drafts), and the answer completes
    events, prefill, drafts = runs["noised"]
    print("noised answer:", repr("".join(e.text for e in events)), token_ids(events))
    assert len(prefill) == len(runs["zero"][1]) and drafts
    rel = relative_rms(torch.cat(prefill), clean)
    assert 0.15 < float(rel.min()) and float(rel.max()) < 0.25, rel
    first = token_ids(events)[0]
    with torch.inference_mode():
        first_clean = split.input(torch.tensor([[*ids, first]]))[0, -1:]
    assert 0.1 < float(relative_rms(drafts[0][:1], first_clean)[0]) < 0.3  # a draft frame's first row: noised too
    assert events[-1].finish_reason in ("stop", "length") and len(token_ids(events)) >= 1


# --- limits, rejections, rollback -------------------------------------------------------------------


async def open_raw(worker: WorkerServer):
    ws = await connect(worker.ws + "/v1/hidden/ws", additional_headers=AUTH, max_size=None, compression=None)
    await ws.send(wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(open_params(worker))))
    reply = wire.decode_frame(await ws.recv())
    assert reply.kind == Kind.OPEN, reply.text()
    return ws, reply.session, json.loads(reply.text())


def open_params(worker: WorkerServer) -> dict:
    e = worker.engine
    return {"hidden_size": e.hidden_size, "num_layers": e.num_layers, "m": e.m, "dtype": "float32"}


async def recv_reply(ws) -> wire.Frame:
    """The next reply frame, skipping STATUS frames (the worker's mu and g, which may ride with a verification)."""
    while True:
        frame = wire.decode_frame(await ws.recv())
        if frame.kind != Kind.STATUS:
            return frame


@torch.inference_mode()
def shallow_of(model: Any, ids: list[int]) -> torch.Tensor:
    return split_model(model, 2).input(torch.tensor([ids]))[0]


async def test_bad_frames_are_refused_while_another_session_keeps_working(
    worker: WorkerServer, smol, reference
) -> None:
    model, tok = smol
    ref, gaps = reference
    backend = worker.backend(model, tok, SMOL, chunk_size=8)
    await backend.start()
    good = asyncio.create_task(collect(backend, prompt_ids(tok)))
    before = dict(worker.engine.stats.rejected)
    ids = prompt_ids(tok, OTHER)
    x = shallow_of(model, ids)
    hidden = x.shape[1]
    ws, sid, info = await open_raw(worker)
    assert info["max_frame_bytes"] == 256 * 1024 and info["hidden_size"] == hidden
    try:
        cases = [
            (b"\x00" * 80, 400, "malformed"),
            ("a text message", 400, "malformed"),
            (wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 1, torch.randn(130, hidden)), 413, "oversized"),
            (wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 2, x.half()), 400, "dtype"),
            (wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 3, torch.randn(4, hidden - 1)), 400, "shape"),
            (wire.encode_tensor(Kind.VERIFY_RESULT, sid, 4, x), 400, "kind"),
            (wire.encode_tensor(Kind.DRAFT, sid, 5, x * float("inf")), 400, "nonfinite"),
            (wire.encode_tensor(Kind.DRAFT, sid, 6, x, arg=3), 409, "position"),
            (wire.encode_tensor(Kind.DRAFT, bytes(16), 7, x), 400, "session"),
            (wire.encode_control(Kind.ROLLBACK, sid, 8, arg=5), 400, "position"),
        ]
        for data, status, reason in cases:
            await ws.send(data)
            reply = wire.decode_frame(await ws.recv())
            assert reply.kind == Kind.ERROR and reply.arg == status, reply.text()
            assert reply.text().startswith(reason), reply.text()
        # The session is still usable after all that: a valid prefill gets the deep state of its last position.
        await ws.send(wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 9, x))
        reply = wire.decode_frame(await ws.recv())
        assert reply.kind == Kind.DEEP_STATE and reply.arg == len(ids) - 1 and reply.seq == 9
        with torch.inference_mode():
            want = split_model(model, 2).middle(x[None])[0, -1]
        assert torch.allclose(reply.tensor()[0], want, rtol=1e-4, atol=1e-3)
    finally:
        await ws.close()
    assert token_ids(await good) == token_ids(await collect(backend, prompt_ids(tok)))  # undisturbed
    check_against_reference(token_ids(await good), ref, gaps)
    await backend.close()
    after = worker.engine.stats.rejected
    for reason in ("malformed", "oversized", "dtype", "shape", "kind", "nonfinite", "position", "session"):
        assert after.get(reason, 0) > before.get(reason, 0), reason
    metrics = (await http("GET", worker.http + "/metrics")).text
    assert 'tandem_worker_frames_rejected_total{reason="oversized"}' in metrics


async def test_kv_rollback_over_the_wire(worker: WorkerServer, smol) -> None:
    model, tok = smol
    ids = prompt_ids(tok)
    x = shallow_of(model, [*ids, 42, 43])
    prompt, nxt = x[: len(ids)], x[len(ids) :]
    results = []
    for drafts_first in (False, True):
        ws, sid, _ = await open_raw(worker)
        seq = 1
        await ws.send(wire.encode_tensor(Kind.PREFILL_CHUNK, sid, seq, prompt))
        assert (await recv_reply(ws)).kind == Kind.DEEP_STATE
        if drafts_first:  # three drafts the device then rejects
            seq += 1
            await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, torch.randn(3, x.shape[1]), arg=len(ids)))
            assert (await recv_reply(ws)).shape == (3, x.shape[1])
            seq += 1
            await ws.send(wire.encode_control(Kind.ROLLBACK, sid, seq, arg=len(ids)))
            seq += 1
            await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, nxt, arg=len(ids) + 3))  # stale position
            assert (await recv_reply(ws)).arg == 409
        seq += 1
        await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, nxt, arg=len(ids)))
        reply = await recv_reply(ws)
        assert reply.kind == Kind.VERIFY_RESULT and reply.seq == seq and reply.arg == len(ids)
        results.append(reply.tensor())
        await ws.close()
    assert torch.equal(results[0], results[1])  # after rollback: exactly as if the drafts had never been sent


async def test_auth_health_metrics_and_session_limit(worker: WorkerServer, smol) -> None:
    # WebSocket without / with a wrong token: closed with 4401.
    for headers in (None, {"Authorization": "Bearer nope"}):
        async with connect(worker.ws + "/v1/hidden/ws", additional_headers=headers) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    # HTTP: 401 in the OpenAI envelope.
    r = await http("POST", worker.http + "/v1/hidden/sessions", content=b"x")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_worker_token"
    r = await http("POST", worker.http + "/v1/hidden/sessions/00/frames", content=b"x", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    health = (await http("GET", worker.http + "/health")).json()
    assert health["status"] == "ok" and health["ready"] is True
    model, tok = smol
    wrong = worker.backend(model, tok, SMOL, auth_token="nope")
    await wrong.start()
    with pytest.raises(BackendError, match="token"):
        await collect(wrong, prompt_ids(tok), max_tokens=2)
    await wrong.close()

    # Session limit: the 7th session is refused (503 / close 1013), the others are unaffected.
    await wait_for(lambda: worker.engine.session_count == 0)
    raws = [await open_raw(worker) for _ in range(worker.settings.max_sessions)]
    try:
        async with connect(worker.ws + "/v1/hidden/ws", additional_headers=AUTH) as ws:
            await ws.send(wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(open_params(worker))))
            refused = wire.decode_frame(await ws.recv())
            assert refused.kind == Kind.ERROR and refused.arg == 503 and "maximum of 6 sessions" in refused.text()
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1013
        r = await http(
            "POST",
            worker.http + "/v1/hidden/sessions",
            content=wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(open_params(worker))),
            headers=AUTH,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "full"
        metrics = (await http("GET", worker.http + "/metrics")).text
        for name in (
            "tandem_worker_sessions 6.0",
            "tandem_worker_batch_tokens_avg",
            "tandem_worker_compute_delay_avg_seconds",
            "tandem_worker_delay_slope_seconds",
            "tandem_worker_predicted_delay_seconds",
            'tandem_worker_frames_rejected_total{reason="full"}',
        ):
            assert name in metrics, name
    finally:
        for ws, _, _ in raws:
            await ws.close()
    await wait_for(lambda: worker.engine.session_count == 0)


async def test_idle_session_is_dropped_with_4408(smol) -> None:
    server = WorkerServer(smol[0], SMOL, idle_timeout=0.4).start()
    try:
        ws, sid, _ = await open_raw(server)
        reply = wire.decode_frame(await asyncio.wait_for(ws.recv(), 5))
        assert reply.kind == Kind.ERROR and reply.arg == 408 and reply.text().startswith("idle")
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd.code == 4408 and server.engine.session_count == 0
        # POST+SSE sessions expire too: the next frame gets a 404.
        r = await http(
            "POST",
            server.http + "/v1/hidden/sessions",
            content=wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(open_params(server))),
            headers=AUTH,
        )
        sid = r.headers["x-tandem-session"]
        await asyncio.sleep(1.0)
        r = await http("POST", f"{server.http}/v1/hidden/sessions/{sid}/frames", content=b"x", headers=AUTH)
        assert r.status_code == 404
    finally:
        server.stop()


async def test_a_sequence_gap_neither_keeps_a_session_alive_nor_delays_its_close(smol) -> None:
    model, _ = smol
    x = shallow_of(model, [1, 2, 3])
    expiring = WorkerServer(model, SMOL, idle_timeout=0.5).start()
    try:
        # Frame 2 arrives, frame 1 never does: the session still expires once it has been idle.
        ws, sid, _ = await open_raw(expiring)
        await ws.send(wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 2, x))
        reply = wire.decode_frame(await asyncio.wait_for(ws.recv(), 5))
        assert reply.kind == Kind.ERROR and reply.arg == 408
        await wait_for(lambda: expiring.engine.session_count == 0)
        await ws.close()
    finally:
        expiring.stop()
    server = WorkerServer(model, SMOL, idle_timeout=60).start()
    try:
        # The device's CLOSE does not wait behind the gap either (POST transport: no connection whose end
        # would close the session anyway).
        opened = await http(
            "POST",
            server.http + "/v1/hidden/sessions",
            content=wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(open_params(server))),
            headers=AUTH,
        )
        sid = opened.headers["x-tandem-session"]
        url = f"{server.http}/v1/hidden/sessions/{sid}/frames"
        held = asyncio.create_task(
            http("POST", url, content=wire.encode_tensor(Kind.PREFILL_CHUNK, bytes.fromhex(sid), 2, x), headers=AUTH)
        )
        await wait_for(lambda: bool(server.engine.session(sid).held))
        r = await http("POST", url, content=wire.encode_control(Kind.CLOSE, bytes.fromhex(sid), 3), headers=AUTH)
        assert r.status_code == 200 and server.engine.session_count == 0
        assert (await held).status_code == 200  # the held frame's request ends too, with no frame
    finally:
        server.stop()


async def test_one_sessions_backlog_is_bounded_and_fails_alone(smol, reference) -> None:
    model, tok = smol
    ref, gaps = reference
    server = WorkerServer(model, SMOL, max_session_bytes=256 * 1024).start()
    try:
        ws, sid, info = await open_raw(server)
        hidden = info["hidden_size"]
        # Defaults come from the model: one frame may carry a whole context of states, no more.
        assert info["max_frame_bytes"] == server.engine.max_context * hidden * 4
        backend = server.backend(model, tok, SMOL)
        await backend.start()
        good = asyncio.create_task(collect(backend, prompt_ids(tok)))
        chunk = torch.randn(32, hidden)  # 72 KiB a frame: the backlog bound holds about three
        for i in range(48):
            await ws.send(wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 1 + i, chunk, arg=32 * i))
        replies = [wire.decode_frame(await asyncio.wait_for(ws.recv(), 60)) for _ in range(48)]
        refused = [r for r in replies if r.kind == Kind.ERROR and r.arg == 429]
        assert refused and all(r.text().startswith("backlog") for r in refused), [r.text() for r in refused][:3]
        assert all(r.kind == Kind.DEEP_STATE or r.arg in (409, 429) for r in replies)
        assert [r.seq for r in replies] == list(range(1, 49))  # every frame answered once, in order
        check_against_reference(token_ids(await good), ref, gaps)  # the other session did not notice
        assert server.engine.stats.rejected["backlog"] == len(refused)
        await ws.close()
        await backend.close()
    finally:
        server.stop()


async def test_a_flooding_session_runs_in_fair_pieces_and_its_drafts_come_back_whole(worker: WorkerServer, smol):
    """One session sends two 48-row drafts at once beside another's 3-row rounds: the worker runs the flood in
    pieces of its fair share (app/worker/scheduler.py, policies/fair_share.py), so the small rounds never wait behind
    a whole flood frame, and each flood draft's VERIFY_RESULT carries all its rows, equal to the middle layers run
    on them at once."""
    model, tok = smol
    engine = worker.engine
    flood = shallow_of(model, (prompt_ids(tok) * 4)[:96])
    small = shallow_of(model, prompt_ids(tok, OTHER)[:9])
    (ws_flood, sid_flood, _), (ws_small, sid_small, _) = [await open_raw(worker) for _ in range(2)]
    before = engine.stats.split_frames
    limits = engine.scheduler.limits  # a quantum of 16 rows, whatever this CPU's fitted g says
    engine.scheduler.limits = limits.model_copy(update={"max_batch_tokens": 16})
    gate = threading.Event()
    engine.call(gate.wait)  # hold the engine until the flood is queued
    try:
        for i in range(2):
            await ws_flood.send(
                wire.encode_tensor(Kind.DRAFT, sid_flood, 1 + i, flood[48 * i : 48 * i + 48], arg=48 * i)
            )
        await wait_for(lambda: sum(1 for sid, d in worker.frames if sid == sid_flood and d[5] == Kind.DRAFT) >= 2)
        gate.set()
        rounds = []
        for i in range(3):
            small_draft = wire.encode_tensor(Kind.DRAFT, sid_small, 1 + i, small[3 * i : 3 * i + 3], arg=3 * i)
            await ws_small.send(small_draft)
            rounds.append(await recv_reply(ws_small))
        replies = [await recv_reply(ws_flood) for _ in range(2)]
    finally:
        gate.set()
        engine.scheduler.limits = limits
        await ws_flood.close()
        await ws_small.close()
    with torch.inference_mode():
        want_flood = split_model(model, 2).middle(flood[None])[0]
        want_small = split_model(model, 2).middle(small[None])[0]
    assert [r.kind for r in replies] == [Kind.VERIFY_RESULT] * 2 and [r.shape[0] for r in replies] == [48, 48]
    assert torch.allclose(torch.cat([r.tensor() for r in replies]), want_flood, rtol=1e-4, atol=1e-3)
    assert torch.allclose(torch.cat([r.tensor() for r in rounds]), want_small, rtol=1e-4, atol=1e-3)
    assert engine.stats.split_frames >= before + 2  # every flood draft ran in pieces


# --- batching -----------------------------------------------------------------------------------------


async def test_two_devices_batched_in_one_forward_equal_running_alone(worker: WorkerServer, smol) -> None:
    model, tok = smol
    prompts = [prompt_ids(tok), prompt_ids(tok, OTHER)]
    alone = []
    for ids in prompts:
        backend = worker.backend(model, tok, SMOL)
        await backend.start()
        alone.append(token_ids(await collect(backend, ids)))
        await backend.close()

    engine = worker.engine
    await wait_for(lambda: engine.session_count == 0)
    # Greedy packing puts both devices' frames in every pass; the planner may rightly run them apart (its choice
    # depends on the fitted pass time: tests/integration/test_worker_planner.py).
    planned = engine.limits
    # the engine (its anticipation hold) and its scheduler (the passes) each read their own copy
    engine.limits = engine.scheduler.limits = planned.model_copy(update={"batching": "greedy"})
    backends = [worker.backend(model, tok, SMOL) for _ in prompts]
    for b in backends:
        await b.start()
    gate = threading.Event()
    engine.call(gate.wait)  # hold the engine until both devices' prefill chunks are queued
    before = engine.stats.batched_forwards
    worker.frames.clear()
    tasks = [asyncio.create_task(collect(b, ids)) for b, ids in zip(backends, prompts, strict=True)]
    chunks = sum(-(-len(ids) // 16) for ids in prompts)
    try:
        await wait_for(lambda: sum(1 for _, d in worker.frames if d[5] == Kind.PREFILL_CHUNK) >= chunks)
    finally:
        gate.set()
    together = [token_ids(await t) for t in tasks]
    for b in backends:
        await b.close()
    engine.limits = engine.scheduler.limits = planned
    assert engine.stats.batched_forwards >= before + min(-(-len(ids) // 16) for ids in prompts)
    assert engine.stats.max_rows >= 2
    assert together == alone  # each device's answer is exactly what it got alone
    print(f"batched forwards: {engine.stats.batched_forwards - before} of {engine.stats.forwards}")


# --- the drafting station: concurrent streams of one backend drafted together -----------------------

JSON_PROMPT = "Invent a person. Answer in JSON with their name and age."


async def test_concurrent_streams_drafted_together_equal_running_alone(worker: WorkerServer, smol, reference) -> None:
    """Two and three streams of one backend at once: the station batches their draft steps, verification heads and
    prefill chunks, and each stream's tokens equal its run alone — greedy with accepted drafts (an oracle draft
    head for the first prompt), sampling at a fixed seed, and a JSON grammar. drafting = "solo" (one call at a
    time) gives the U-shape answer too."""
    from app.serving.structured import _json_rule

    model, tok = smol
    ref, gaps = reference
    ids = [prompt_ids(tok), prompt_ids(tok, OTHER), prompt_ids(tok, JSON_PROMPT)]
    answer = {len(ids[0]) + i: t for i, t in enumerate(ref)}
    grammar = "start: " + _json_rule(PERSON)
    n = 12
    requests = [
        {"max_tokens": n},
        {"max_tokens": n, "temperature": 0.7, "seed": 5},
        {"max_tokens": n, "grammar": grammar},
    ]

    def backend(**kw: Any) -> OracleHAT:
        options = HATOptions(worker_url=worker.ws, auth_token=TOKEN, chunk_size=16, **kw)
        return OracleHAT(options, model_id=SMOL, model=model, tokenizer=tok, answer=answer)

    station_backend = backend()
    await station_backend.start()
    station = station_backend.station
    assert station is not None
    try:
        alone = [token_ids(await collect(station_backend, i, **r)) for i, r in zip(ids, requests, strict=True)]
        assert station.stats.max_streams == 1
        check_against_reference(alone[0], ref[:n], gaps)
        print(f"fitted (device, verify) T(b, F) after the solo runs: {station.fits()}")
        # All streams in one group, then three streams in two groups pipelined (group 2 drafted while group 1 is at
        # the worker), then Alg. 1's own grouping: the answers never change, only which rows share a pass.
        for k, grouping in ((2, "one"), (3, 2), (3, "alg1")):
            station.grouping = grouping
            before = dict(station.stats.streams), dict(station.stats.units)
            together = await asyncio.gather(
                *(collect(station_backend, i, **r) for i, r in zip(ids[:k], requests[:k], strict=True))
            )
            assert [token_ids(e) for e in together] == alone[:k]
            drafted = station.stats.streams["draft"] - before[0]["draft"]
            units = station.stats.units["draft"] - before[1]["draft"]
            verified = station.stats.streams["verify"] - before[0]["verify"]
            print(
                f"K={k} {grouping}: {drafted} stream drafts in {units} units, group sizes {station.stats.widest_plan}"
            )
            if grouping != "alg1":  # rows of several streams shared draft and head passes
                assert drafted > units and verified > station.stats.units["verify"] - before[1]["verify"]
        assert station.stats.max_streams >= 2 and station_backend.stats.accepted > 0
    finally:
        await station_backend.close()

    solo = backend(drafting="solo")
    await solo.start()
    try:
        assert solo.station is None
        check_against_reference(token_ids(await collect(solo, ids[0], max_tokens=n)), ref[:n], gaps)
    finally:
        await solo.close()
    await wait_for(lambda: worker.engine.session_count == 0)


# --- the Backend contract ---------------------------------------------------------------------------


async def test_hat_backend_streams_token_events(worker: WorkerServer, smol, reference) -> None:
    model, tok = smol
    ref, gaps = reference
    ids = prompt_ids(tok)
    backend = worker.backend(model, tok, SMOL)
    await backend.start()
    assert backend.count_tokens("hello world") == (len(tok.encode("hello world", add_special_tokens=False)), True)

    events = await collect(backend, ids, max_tokens=6)
    check_against_reference([e.token_id for e in events], ref[:6], gaps)
    assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
    assert "".join(e.text for e in events) == tok.decode(token_ids(events), skip_special_tokens=True)

    # Continue from a delivered prefix (token ids, then text): the rest of the same answer (its prefill of the prefix
    # is another computation path than the rounds that wrote it: the near-tie rule).
    cont = token_ids(await collect(backend, ids, prefix_ids=tuple(ref[:8]), max_tokens=6))
    check_against_reference(cont, ref[8:14], gaps[8:14])
    prefix_text = tok.decode(ref[:8], skip_special_tokens=True)
    by_text = token_ids(await collect(backend, ids, prefix_text=prefix_text, max_tokens=4))
    check_against_reference(by_text, ref[8:12], gaps[8:12])

    # Stop strings are the relay's (clients/token_emitter.py): the stream goes on past them, and the relay fed it
    # ends the answer on the token that completes one, with the text cut before it. Compared with this backend's
    # own answer to the same request (one computation path).
    answer = token_ids(await collect(backend, ids))
    check_against_reference(answer, ref, gaps)
    full_text = tok.decode(answer, skip_special_tokens=True)
    stop = full_text[12:16]
    request = GenerationRequest(prompt_text="", prompt_ids=tuple(ids), max_tokens=N, temperature=0.0, stop=(stop,))
    events = [e async for e in backend.stream(request)]
    streamed = "".join(e.text for e in events)
    assert streamed.startswith(full_text[: full_text.find(stop) + len(stop)])  # not cut by the backend
    text, finish, ended_at = relayed(request, events)
    assert finish == "stop" and text == full_text[: full_text.find(stop)]
    before = "".join(e.text for e in events[: ended_at - 1])
    assert stop not in before and stop in before + events[ended_at - 1].text  # ended on the token completing it

    # Cancellation: closing the stream ends the answer where it was (no round after the close) and closes the worker
    # session (the limit only guards against a hang).
    stream = backend.stream(GenerationRequest(prompt_text="", prompt_ids=tuple(ids), max_tokens=200, temperature=0))
    generated = backend.tokens_generated
    got = [await stream.__anext__() for _ in range(3)]
    check_against_reference([e.token_id for e in got], ref[:3], gaps)
    await stream.aclose()
    await wait_for(lambda: worker.engine.session_count == 0, limit=5)
    assert backend.active == 0 and backend.tokens_generated - generated == 3

    # Sampling: speculative rejection sampling, reproducible with a seed.
    runs = [token_ids(await collect(backend, ids, temperature=0.8, seed=7, max_tokens=10)) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 10 and all(0 <= t < model.config.vocab_size for t in runs[0])
    await backend.close()


async def test_emulated_link_and_eq3_chunking(worker: WorkerServer, smol, reference) -> None:
    model, tok = smol
    ref, gaps = reference
    link = LinkProfile(latency=0.02, up_bandwidth=2e6, down_bandwidth=4e6, seed=1)
    backend = worker.backend(model, tok, SMOL, chunk_size=None, link=link)
    await backend.start()
    t0 = time.perf_counter()
    got = token_ids(await collect(backend, prompt_ids(tok), max_tokens=8))
    elapsed = time.perf_counter() - t0
    await backend.close()
    check_against_reference(got, ref[:8], gaps)
    stats = backend.stats
    # Every round trip pays 2 x 20 ms of latency (plus upload time) on top of compute: OPEN, prefill, 7 rounds.
    assert elapsed >= 0.04 * (2 + stats.rounds)
    assert 16 <= stats.last_chunk_size <= 256  # from Eq. 3 with the worker's g and the 2 MB/s uplink
    print(f"emulated link: {elapsed * 1e3:.0f} ms for 8 tokens, chunk {stats.last_chunk_size}, {stats.summary()}")


async def test_dp_chunking_plans_unequal_chunks_and_keeps_greedy_exact(worker: WorkerServer, smol) -> None:
    """chunking = "dp": the prompt's chunks come from Jupiter's partition over device -> link -> worker (the
    device's own step time fitted at load); the answer is unchanged."""
    model, tok = smol
    ids = prompt_ids(tok, PROMPT + " Explain each step. " + "Use clear names and short comments. " * 20)
    ref, gaps = u_shape_greedy(model, ids, 6)
    link = LinkProfile(latency=0.005, up_bandwidth=2e6, down_bandwidth=4e6, seed=1)
    backend = worker.backend(model, tok, SMOL, chunk_size=None, link=link, chunking="dp")
    await backend.start()
    tau = backend.prefill_planner.device_tau
    assert tau is not None and tau.b > 0  # seconds per token of the device's prefill step, measured
    got = token_ids(await collect(backend, ids, max_tokens=6))
    await backend.close()
    check_against_reference(got, ref, gaps)
    chunks = backend.stats.last_chunks
    print(f"dp chunks for {len(ids)} tokens: {chunks}")
    assert sum(chunks) == len(ids) and len(chunks) == backend.stats.prefill_chunks
    assert all(c >= 16 for c in chunks) and len(chunks) >= 2


def test_sse_frames_are_base64_events(worker: WorkerServer, smol) -> None:
    model, _ = smol
    params = json.dumps(open_params(worker))
    r = httpx.post(
        worker.http + "/v1/hidden/sessions", content=wire.encode_text(Kind.OPEN, bytes(16), 0, params), headers=AUTH
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    opened = wire.decode_frame(r.content)
    sid = r.headers["x-tandem-session"]
    assert opened.session.hex() == sid
    x = shallow_of(model, [1, 2, 3])
    r = httpx.post(
        f"{worker.http}/v1/hidden/sessions/{sid}/frames",
        content=wire.encode_tensor(Kind.PREFILL_CHUNK, opened.session, 1, x),
        headers=AUTH,
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    data = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
    frame = wire.decode_frame(base64.b64decode(data[0]))
    assert frame.kind == Kind.DEEP_STATE and frame.arg == 2 and "event: end" in r.text
    r = httpx.delete(f"{worker.http}/v1/hidden/sessions/{sid}", headers=AUTH)
    assert r.status_code == 204


async def test_float16_wire(smol, reference) -> None:
    model, tok = smol
    ref, _ = reference
    server = WorkerServer(model, SMOL, dtype="float16").start()
    try:
        mismatched = server.backend(model, tok, SMOL)  # a float32 device cannot join a float16 worker
        await mismatched.start()
        with pytest.raises(BackendError, match="dtype float32 != worker's float16"):
            await collect(mismatched, prompt_ids(tok), max_tokens=2)
        await mismatched.close()
        backend = server.backend(model, tok, SMOL, wire_dtype="float16")
        await backend.start()
        got = token_ids(await collect(backend, prompt_ids(tok), max_tokens=8))
        await backend.close()
    finally:
        server.stop()
    tensors = [
        f for f in (wire.decode_frame(d) for _, d in server.frames) if f.kind in (Kind.PREFILL_CHUNK, Kind.DRAFT)
    ]
    assert tensors and all(f.dtype == wire.DType.FLOAT16 for f in tensors)
    # Half-precision states halve the bytes; the answer usually matches fp32 but is not guaranteed to.
    print(f"float16 wire: {sum(a == b for a, b in zip(got, ref, strict=False))}/8 tokens equal to fp32 U-shape")
    assert len(got) == 8


async def test_unreachable_worker_and_cancel_mid_round(worker: WorkerServer, smol) -> None:
    model, tok = smol
    ids = prompt_ids(tok)
    dead_url = f"ws://127.0.0.1:{free_port()}"
    dead = HATBackend(HATOptions(worker_url=dead_url), model_id=SMOL, model=model, tokenizer=tok)
    await dead.start()
    with pytest.raises(BackendError) as err:
        await collect(dead, ids, max_tokens=2)
    assert err.value.status == 503 and "cannot reach worker" in str(err.value)
    assert not await dead.ready()
    await dead.close()

    backend = worker.backend(model, tok, SMOL)
    await backend.start()
    await wait_for(lambda: worker.engine.session_count == 0)
    gate = threading.Event()
    worker.engine.call(gate.wait)  # the worker stalls: the device is left waiting for a reply
    try:
        task = asyncio.create_task(collect(backend, ids))
        await wait_for(lambda: worker.engine.session_count == 1)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: worker.engine.session_count == 0, limit=3)  # connection closed, session dropped
        assert backend.active == 0
    finally:
        gate.set()
    await backend.close()


class OracleHalf(DeviceHalf):
    """A draft head that knows the U-shape answer: confident and right at most positions, unsure at every third
    (top-1 wrong at 0.5, the right token second at 0.4). A trained adapter's behaviour, made deterministic, to
    exercise multi-token acceptance, rollback of the rejected tail and parallel drafting's branch reuse."""

    def __init__(self, half: DeviceHalf, answer: dict[int, int]) -> None:
        sizes = {"hidden_size": half.hidden_size, "num_layers": half.num_layers, "vocab_size": half.vocab_size}
        super().__init__(half.input, half.adapter, half.output, **sizes)
        self.answer = answer

    def draft_logits(self, feats: torch.Tensor, position: int | list[int]) -> torch.Tensor:
        positions = position if isinstance(position, list) else [position] * feats.shape[0]  # per row at the station
        out = torch.full((feats.shape[0], self.vocab_size), -50.0)
        for row, pos in zip(out, positions, strict=True):
            want = self.answer.get(pos + 1, 0)
            if pos % 3:
                row[want], row[(want + 7) % self.vocab_size] = 0.0, -2.2  # p ~ 0.9
            else:
                row[(want + 1) % self.vocab_size], row[want], row[(want + 7) % self.vocab_size] = 0.0, -0.22, -1.6
        return out


class OracleHAT(HATBackend):
    """A HATBackend drafting with OracleHalf's draft head."""

    def __init__(self, *args: Any, answer: dict[int, int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.answer = answer

    def load_half(self, model: Any) -> DeviceHalf:
        return OracleHalf(super().load_half(model), self.answer)


async def test_accepted_drafts_and_parallel_drafting_keep_greedy_exact(worker: WorkerServer, smol, reference) -> None:
    model, tok = smol
    ref, gaps = reference
    ids = prompt_ids(tok)
    answer = {len(ids) + i: t for i, t in enumerate(ref)}
    outputs = {}
    for parallel in (False, True):
        options = HATOptions(
            worker_url=worker.ws, auth_token=TOKEN, parallel_drafting=parallel, proactive_drafting=False
        )
        backend = OracleHAT(options, model_id=SMOL, model=model, tokenizer=tok, answer=answer)
        await backend.start()
        outputs[parallel] = token_ids(await collect(backend, ids))
        stats = backend.stats.summary()
        print(f"oracle drafts, parallel drafting {parallel}: {stats}")
        assert stats["accept_length"] > 1.8 and backend.stats.accepted > 0
        assert backend.stats.accepted < backend.stats.drafted  # the unsure drafts were rejected and rolled back
        if parallel:
            assert backend.stats.parallel_hits >= 2 and backend.stats.parallel_steps >= 2
        else:
            assert backend.stats.parallel_hits == 0
        await backend.close()
    # How far parallel drafting reaches depends on the round trip's measured time, and with it the next round's draft
    # and the shape of its verification pass: the two runs are two computation paths, each held to the reference.
    for parallel in (False, True):
        check_against_reference(outputs[parallel], ref, gaps)


async def test_proactive_drafts_dropped_on_a_mismatch_never_reach_the_client(
    worker: WorkerServer, smol, reference
) -> None:
    """Proactive drafting (SpecEdge): while the worker verifies, the device drafts the next round as if all of this
    one were accepted. The oracle's one-draft rounds make both outcomes certain: from a position p = 1 (mod 3) the
    draft is right and so is the guess after it (a hit: the next round's draft is ready); from p = 2 the draft is
    right but the guess is not, from p = 0 the draft is rejected (misses: the drafted-ahead tokens are dropped).
    Solo drafting is one computation path for both runs (the ahead branch runs the same one-row forwards on a copy
    of the same caches), so the output is the plain run's token for token; at the station, the U-shape rule."""
    model, tok = smol
    ref, gaps = reference
    ids = prompt_ids(tok)
    answer = {len(ids) + i: t for i, t in enumerate(ref)}
    for drafting in ("solo", "batched"):
        outputs = {}
        for proactive in (False, True):
            options = HATOptions(
                worker_url=worker.ws,
                auth_token=TOKEN,
                max_draft=1,
                drafting=drafting,
                proactive_drafting=proactive,
                parallel_drafting=False,
            )
            backend = OracleHAT(options, model_id=SMOL, model=model, tokenizer=tok, answer=answer)
            await backend.start()
            outputs[proactive] = token_ids(await collect(backend, ids))
            stats = backend.stats
            print(f"oracle drafts, {drafting}, proactive {proactive}: {stats.summary()}")
            if proactive:
                assert stats.proactive_hits >= 2 and stats.proactive_misses >= 2 and stats.proactive_steps >= 2
                # each hit's draft was the next round's (unless the answer ended right after it)
                assert stats.proactive_hits - 1 <= stats.parallel_hits <= stats.proactive_hits
                assert stats.summary()["profile_ms_per_round"]["ahead"] > 0
            else:
                assert stats.proactive_steps == stats.proactive_hits == stats.parallel_hits == 0
            await backend.close()
        if drafting == "solo":
            assert outputs[True] == outputs[False]
        else:
            check_against_reference(outputs[True], outputs[False], gaps)
        check_against_reference(outputs[True], ref, gaps)


def greedy_drafter(model: Any, ids: list[int], max_draft: int) -> tuple[Any, Any, Any]:
    """(a Drafter over the untrained adapter, drafting max_draft tokens a round with no confidence stop; its draft
    state with all of `ids` but the last token prefilled, so the first round's root is ids[-1]; greedy sampling)."""
    from clients.hat.drafting import Drafter
    from clients.hat.request_sampling import Sampling
    from policies.drafting import DraftStopRule

    drafter = Drafter(DeviceHalf.load(model, 2), DraftStopRule(eta=0.0, max_draft=max_draft), 3)
    st = drafter.new_state()
    drafter.prefill(st, ids[:-1], 0)
    sampling = Sampling.of(GenerationRequest(prompt_text="", prompt_ids=tuple(ids), temperature=0.0), None, None, None)
    return drafter, st, sampling


def test_a_branch_fed_to_its_last_draft_inside_the_wait_is_adopted_without_another_feed(smol) -> None:
    """Drafting ahead feeds a branch's last draft before the reply comes (Drafter.feed_last), so taking the branch
    after verification runs no input layer: the prepared draft's states are those a teacher-forced feed gives."""
    model, tok = smol
    ids = prompt_ids(tok)
    position = len(ids) - 1
    drafter, st, sampling = greedy_drafter(model, ids, max_draft=3)
    chain = drafter.draft(st, ids[-1], position, 2, sampling)
    guessed = drafter.ahead(st, chain, position)
    assert guessed is not None
    while not drafter.branch_done(guessed):
        drafter.step(guessed, sampling)
    assert len(guessed.tokens) == 3 and len(guessed.shallows) == 3  # the third draft chosen, not yet fed
    drafter.feed_last(guessed)
    assert len(guessed.shallows) == 4
    with pytest.raises(RuntimeError, match="no more steps"):
        drafter.step(guessed, sampling)
    feeds = []
    real_feed = drafter._feed
    drafter._feed = lambda *a, **kw: feeds.append(a) or real_feed(*a, **kw)  # type: ignore[method-assign]
    drafter.adopt(st, guessed, 0)
    assert feeds == []
    prepared = st.prepared
    assert prepared is not None and prepared.tokens == [row[0] for row in guessed.tokens]
    fed = [*ids, *chain.tokens, guessed.candidates[0], *prepared.tokens]
    assert len(st.input_cache) == len(st.adapter_cache) == len(fed)
    teacher = drafter.new_state()
    rows = drafter.prefill(teacher, fed, 0)[-4:]
    torch.testing.assert_close(prepared.shallow, rows, rtol=1e-4, atol=1e-4)


class PlanRecorder(OracleHAT):
    """OracleHAT that records, each round, the worker's mu and g it plans with, and the draft cap it chose."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.plans: list[tuple[float, tuple[float, ...], int]] = []
        self.drafts: list[tuple[int, int]] = []  # per round: (the cap it got, drafts it sent)

    def _draft_cap(self, link: Any) -> int:
        cap = super()._draft_cap(link)
        self.plans.append((float(link.info["mu"]), tuple(link.info["g"]), cap))
        return cap

    async def _round(self, link: Any, st: Any, token: int, position: int, cap: int, *args: Any, **kw: Any):
        before = self.stats.drafted
        out = await super()._round(link, st, token, position, cap, *args, **kw)
        self.drafts.append((cap, self.stats.drafted - before))
        return out


@pytest.mark.parametrize(("mode", "transport"), [("eq7+eta", "ws"), ("eq7", "ws"), ("eq7+eta", "http")])
async def test_eq7_draft_length_keeps_greedy_exact_and_gets_status_mid_session(smol, reference, mode, transport):
    """Draft length from Eq. 7 changes how much is drafted per round, never the output, over both transports; the
    worker's mu and g reach the device in STATUS frames while the session runs (tolerance 0: whenever they moved)."""
    model, tok = smol
    ref, gaps = reference
    ids = prompt_ids(tok)
    answer = {len(ids) + i: t for i, t in enumerate(ref)}
    server = WorkerServer(model, SMOL, status_tolerance=0.0).start()
    try:
        url = server.ws if transport == "ws" else server.http
        # chains only (lookup_tokens 0): what is drafted is exactly the rule's, with no lookup branch beside it
        options = HATOptions(worker_url=url, auth_token=TOKEN, chunk_size=16, draft_length=mode, lookup_tokens=0)
        backend = PlanRecorder(options, model_id=SMOL, model=model, tokenizer=tok, answer=answer)
        await backend.start()
        sent_before = server.engine.stats.status_frames
        got = token_ids(await collect(backend, ids))
        stats = backend.stats.summary()
        print(f"{mode}: {stats}, alpha_hat {backend.controller.alpha:.3f}, plans {backend.plans}")
        check_against_reference(got, ref, gaps)
        assert backend.stats.accepted > 0 and stats["accept_length"] > 1.5
        assert all(1 <= cap <= options.max_draft for _, _, cap in backend.plans)
        if mode == "eq7":  # exactly the cap: l*, or fewer where the answer's remaining length is shorter
            assert all(sent == cap for cap, sent in backend.drafts), backend.drafts
        else:  # the eta stop within the cap
            assert all(sent <= cap for cap, sent in backend.drafts) and any(s < c for c, s in backend.drafts)
        # STATUS frames arrived mid-session, and later rounds planned with the values they carried.
        sent = server.engine.stats.status_frames - sent_before
        assert sent >= 1 and backend.stats.status_updates == sent
        assert len({(mu, g) for mu, g, _ in backend.plans}) >= 2
        await backend.close()
    finally:
        server.stop()


def u_shape_penalised(model: Any, ids: list[int], n: int, request: GenerationRequest) -> tuple[list[int], list[float]]:
    """Plain U-shape greedy with the request's penalties / logit_bias applied before every pick: tokens and the
    adjusted logits' top-2 gaps."""
    adjust = LogitAdjuster(request)
    session = split_model(model, 2).session()
    logits = session.prefill(torch.tensor([ids]), 16)[0, -1]
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(n):
        scores = adjust.apply(logits)
        gaps.append(top2_gap(scores))
        tokens.append(int(scores.argmax()))
        adjust.accept(tokens[-1])
        logits = session.forward([[tokens[-1]]])[0, -1]
    return tokens, gaps


async def test_logprobs_and_penalties_through_accepted_drafts(worker: WorkerServer, smol, reference) -> None:
    """Logprobs come from the head's logits at each token's position, accepted drafts included; penalties are
    applied in verification too, so drafts of the unpenalised answer are rejected where the penalised one differs."""
    model, tok = smol
    ref, gaps = reference
    ids = prompt_ids(tok)
    answer = {len(ids) + i: t for i, t in enumerate(ref)}
    options = HATOptions(worker_url=worker.ws, auth_token=TOKEN)
    backend = OracleHAT(options, model_id=SMOL, model=model, tokenizer=tok, answer=answer)
    await backend.start()
    try:
        events = [e for e in await collect(backend, ids, max_tokens=12, logprobs=2) if e.token_id is not None]
        assert backend.stats.accepted > 0
        got = [e.token_id for e in events]
        check_against_reference(got, ref[:12], gaps)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : len(ids) - 1 + len(got)]
        expected = torch.log_softmax(logits.float(), dim=-1)
        for i, e in enumerate(events):
            (entry,) = e.logprobs
            assert entry.logprob == pytest.approx(float(expected[i, got[i]]), abs=2e-3)
            assert len(entry.top) == 2 and entry.top[0][1] == pytest.approx(entry.logprob, abs=1e-5)
            assert entry.top[0][1] >= entry.top[1][1]

        accepted = backend.stats.accepted
        request = {
            "max_tokens": 12,
            "frequency_penalty": 1.5,
            "presence_penalty": 0.5,
            "logit_bias": ((ref[5], -100.0), (ref[6], 3.0)),
        }
        penalised = token_ids(await collect(backend, ids, **request))
        assert backend.stats.accepted > accepted  # speculation stays on under penalties
        want, want_gaps = u_shape_penalised(model, ids, 12, GenerationRequest(prompt_text="", **request))
        check_against_reference(penalised, want, want_gaps)
        assert penalised != got
    finally:
        await backend.close()


# --- grammars (tool_choice / response_format) -------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PERSON = {
    "type": "object",
    # Bounded, so the answer always fits max_tokens (an unbounded number can run on until it is cut).
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def u_shape_masked(model: Any, ids: list[int], n: int, mask: Any, eos: frozenset[int]) -> tuple[list[int], list[float]]:
    """Plain U-shape greedy with the grammar's mask applied before every pick (ends where the grammar does): tokens
    and the masked logits' top-2 gaps (the last one the end token's, when the answer ends on it)."""
    session = split_model(model, 2).session()
    logits = session.prefill(torch.tensor([ids]), 16)[0, -1]
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(n):
        scores = mask.apply(logits)
        gaps.append(top2_gap(scores))
        token = int(scores.argmax())
        if token in eos:
            break
        tokens.append(token)
        mask.accept(token)
        if mask.finished:
            break
        logits = session.forward([[token]])[0, -1]
    return tokens, gaps


def _valid_person(value: Any) -> bool:
    return set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int


@pytest.fixture(scope="module")
def qwen_hat() -> Iterator[tuple[WorkerServer, Any, Any, dict[str, Any]]]:
    """Qwen2.5-0.5B (its vocabulary has <tool_call> tokens) with the shipped adapter and draft vocabulary:
    speculative decoding on, parallel drafting configured on too."""
    model, tok = load(QWEN05)
    adapter, draft_vocab = draft_files("qwen2.5-coder-0.5b-instruct", 2)
    server = WorkerServer(model, QWEN05, max_sessions=2).start()
    kw = {"adapter_path": adapter, "draft_vocab_path": draft_vocab, "parallel_drafting": True}
    yield server, model, tok, kw
    server.stop()


async def test_forced_tool_call_and_json_schema_under_speculative_decoding(qwen_hat) -> None:
    """A forced call (special-token tags) and a json_schema answer: drafts and verified positions are masked, so
    the output is the plain masked greedy answer, it parses, and the answer ends as soon as the grammar does."""
    from app.serving.structured import _json_rule, tool_call_grammar
    from app.serving.tool_calls import ToolCallSplitter

    server, model, tok, kw = qwen_hat
    backend = server.backend(model, tok, QWEN05, **kw)
    await backend.start()
    try:
        tag = lambda text: f"<[{tok.convert_tokens_to_ids(text)}]>"  # noqa: E731 - Gateway._tag, Qwen's vocabulary
        tools_prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Tell me a joke."}],
            tools=[WEATHER],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tok(tools_prompt, add_special_tokens=False)["input_ids"]
        grammar = tool_call_grammar([WEATHER], ["get_weather"], False, tag)
        assert "<[" in grammar
        events = await collect(backend, ids, max_tokens=48, grammar=grammar)
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop"
        splitter = ToolCallSplitter()
        content, calls = [], []
        for e in events:
            c, done = splitter.feed(e.text)
            content.append(c)
            calls += done
        c, done = splitter.finish()
        calls += done
        assert not "".join([*content, c]).strip(), text
        assert [call.name for call in calls] == ["get_weather"], text
        assert isinstance(json.loads(calls[0].arguments)["city"], str)
        assert backend.stats.drafted > 0 and backend.stats.parallel_steps == 0  # speculation on, no branches
        got = token_ids(events)
        want, want_gaps = u_shape_masked(model, ids, 48, backend._grammars.mask(grammar), backend.eos_ids)
        check_against_reference(got, want, want_gaps)
        print(f"forced call: {text!r}; {backend.stats.summary()}")

        before = backend.stats.accepted
        ids = prompt_ids(tok, "Invent a person. Answer in JSON with their name and age.")
        grammar = "start: " + _json_rule(PERSON)
        for temperature in (0.0, 0.8):  # greedy verification, then speculative rejection sampling
            events = await collect(backend, ids, max_tokens=40, grammar=grammar, temperature=temperature, seed=3)
            text = "".join(e.text for e in events)
            assert events[-1].finish_reason == "stop", text
            assert _valid_person(json.loads(text)), text
            print(f"json_schema at T={temperature}: {text!r}")
        assert backend.stats.accepted > before  # masked drafts were accepted
        print(backend.stats.summary())
    finally:
        await backend.close()
    await wait_for(lambda: server.engine.session_count == 0)


async def test_json_continuation_from_a_delivered_prefix(qwen_hat) -> None:
    """A migration's continuation: the grammar is advanced over the delivered JSON prefix first, so the answer
    completes that JSON; logprobs still come from the head's own (unmasked) logits."""
    from app.serving.structured import _json_rule

    server, model, tok, kw = qwen_hat
    backend = server.backend(model, tok, QWEN05, **kw)
    await backend.start()
    try:
        ids = prompt_ids(tok, "Invent a person. Answer in JSON with their name and age.")
        prefix = '{"name": "Ada'
        prefix_ids = tuple(tok(prefix, add_special_tokens=False)["input_ids"])
        grammar = "start: " + _json_rule(PERSON)
        events = await collect(
            backend, ids, max_tokens=30, grammar=grammar, prefix_text=prefix, prefix_ids=prefix_ids, logprobs=1
        )
        text = prefix + "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", text
        value = json.loads(text)
        assert _valid_person(value) and value["name"].startswith("Ada"), text
        got = token_ids(events)
        context = ids + list(prefix_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([context + got])).logits[0, len(context) - 1 : len(context) - 1 + len(got)]
        expected = torch.log_softmax(logits.float(), dim=-1)
        for i, e in enumerate(e for e in events if e.token_id is not None):
            assert e.logprobs[0].logprob == pytest.approx(float(expected[i, got[i]]), abs=2e-3)
        assert min(float(expected[i, t]) for i, t in enumerate(got)) < -1e-3  # not the masked (forced: 0) ones
        with pytest.raises(BackendError) as err:  # a prefix the grammar cannot read: the request is wrong
            await collect(backend, ids, grammar=grammar, prefix_text="[1", prefix_ids=(58, 16))
        assert err.value.status == 400
    finally:
        await backend.close()
    await wait_for(lambda: server.engine.session_count == 0)
