"""The 2-stage HAT worker on real weights (SmolLM2-135M): stage 0 in this process (uvicorn in a thread, as in
test_hat.py), stage 1 a real `tandem worker --stage-rank 1` process, gloo over loopback.

- deep states bit-identical to the single-process worker at the same chunk boundaries, and within 1e-3 relative
  when stage 0 re-splits a prefill frame into Jupiter's sub-sequences;
- rollback across stages, then re-decoding, equals a fresh session;
- greedy HAT (the real device half over the WebSocket) equals U-shape token for token, on SmolLM2 and once on the
  default Qwen2.5-Coder-0.5B with its shipped adapter;
- outline decoding pinned to HAT puts its points into the pipeline side by side, never more than the worker's
  sessions, so none is refused;
- killing stage 1 mid-answer fails the session with an ERROR, the worker reports not ready, and the gateway
  finishes the answer on the device (last: it breaks the module's worker).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from app.worker.engine import Engine
from app.worker.layer_placement import GIB, layer_memory
from app.worker.settings import EngineLimits, WorkerSettings
from clients.hat import wire
from clients.hat.adapter import draft_files
from clients.hat.split import SplitModel, split_model
from policies.sequence_partition import ChunkCost
from tests.conftest import start_gateway, stop_gateway
from tests.integration.disco_helpers import stream_chunks, trace
from tests.integration.hf_fixtures import QWEN05, SMOL, chat_prompt, check_against_reference, load
from tests.integration.test_hat import (
    WorkerServer,
    collect,
    prompt_ids,
    token_ids,
    u_shape_greedy,
)

Kind = wire.Kind
N = 16
QWEN_TOKENS = 10


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    return load(SMOL)


@pytest.fixture(scope="module")
def split(smol) -> SplitModel:
    return split_model(smol[0], 2)


# Stage 0's memory cap holds its first STAGE0_LAYERS middle layers and half of the next (weights + KV reserve for
# max_sessions x max_context): the time-balanced split would give it about half of SmolLM2's 28 middle layers.
STAGE0_LAYERS = 8
MAX_SESSIONS = 2


def stage0_cap(model: Any) -> float:
    context = min(WorkerSettings().max_context, int(model.config.max_position_embeddings))
    per_layer = layer_memory(model, 2, 2 + STAGE0_LAYERS + 1, MAX_SESSIONS * context)
    return sum(per_layer[:-1]) + per_layer[-1] / 2


@pytest.fixture(scope="module")
def staged(smol) -> Iterator[WorkerServer]:
    """Two stages, one thread each, the device's chunks kept as sent (sequence_partition "off"), stage 0 capped."""
    server = WorkerServer(
        smol[0], SMOL, stages=2, stage_threads=[1, 1], sequence_partition="off", max_sessions=MAX_SESSIONS,
        stage_timeout=60, stage_memory_gib=[stage0_cap(smol[0]) / GIB, 100.0],
    )  # fmt: skip
    server.start()
    pipeline = server.engine.pipeline
    try:
        yield server
    finally:
        server.stop()
        assert all(child.poll() is not None for child in pipeline.children), "a stage process was left running"


@pytest.fixture(scope="module")
def single(split) -> Iterator[Engine]:
    """The single-process engine the stages must match."""
    engine = Engine(split.middle, EngineLimits(max_sessions=4), model_name=SMOL)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def shallow(smol, split) -> torch.Tensor:
    _, tok = smol
    text = chat_prompt(tok, "Explain, with examples, how a hash map handles collisions and resizing. " * 12)
    ids = tok(text, add_special_tokens=False)["input_ids"][:200]
    assert len(ids) == 200
    with torch.inference_mode():
        return split.input(torch.tensor([ids]))[0]


def open_session(engine: Engine) -> tuple[Any, dict]:
    params = {"hidden_size": engine.hidden_size, "num_layers": engine.num_layers, "m": 2, "dtype": "float32"}
    session, reply = engine.open(wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(params)))
    return session, json.loads(wire.decode_frame(reply).text())


class Frames:
    """One session's frames, with consecutive sequence numbers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session, self.info = open_session(engine)
        self.seq = 0

    def send(self, kind: Kind, x: torch.Tensor | None = None, arg: int = 0) -> wire.Frame | None:
        self.seq += 1
        sid = self.session.id
        if x is None:
            data = wire.encode_control(kind, sid, self.seq, arg=arg)
        else:
            data = wire.encode_tensor(kind, sid, self.seq, x.contiguous(), arg=arg)
        frames = [wire.decode_frame(b) for b in self.engine.submit(self.session, data).result(timeout=120)]
        frames = [f for f in frames if f.kind != Kind.STATUS]
        if not frames:
            return None
        (f,) = frames
        assert f.kind != Kind.ERROR, f.text()
        return f

    def prefill(self, x: torch.Tensor, chunk: int, start: int = 0) -> list[torch.Tensor]:
        return [
            self.send(Kind.PREFILL_CHUNK, x[i : i + chunk], start + i).tensor()  # type: ignore[union-attr]
            for i in range(0, x.shape[0], chunk)
        ]

    def close(self) -> None:
        self.engine.close(self.session)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def test_two_stages_bit_identical_and_rollback_equals_a_fresh_session(staged, single, shallow, smol) -> None:
    engine = staged.engine
    assert engine.stages == 2 and len(engine.pipeline.bounds) == 2
    (a0, b0), (a1, b1) = engine.pipeline.bounds
    assert a0 == 2 and b0 == a1 and b1 == 30  # SmolLM2: 30 layers, the device keeps 2
    # the memory cap binds: stage 0 holds no more than its cap allows, and the partition counted exactly that
    assert 1 <= b0 - a0 <= STAGE0_LAYERS
    context = min(WorkerSettings().max_context, int(smol[0].config.max_position_embeddings))
    counted = sum(layer_memory(smol[0], a0, b0, MAX_SESSIONS * context))
    assert engine.pipeline.stage_memory[0] == counted <= stage0_cap(smol[0])
    prompt, drafts, other = shallow[:120], shallow[120:124], shallow[124:127]

    staged_s, single_s = Frames(engine), Frames(single)
    assert staged_s.info["pipeline"] == 2 and single_s.info["pipeline"] == 1
    assert staged_s.info["trees"] is False and single_s.info["trees"] is True  # a staged worker verifies no token trees
    got, want = staged_s.prefill(prompt, 24), single_s.prefill(prompt, 24)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # same chunk boundaries: bit-identical
    got_v = staged_s.send(Kind.DRAFT, drafts, 120).tensor()  # type: ignore[union-attr]
    assert torch.equal(got_v, single_s.send(Kind.DRAFT, drafts, 120).tensor())  # type: ignore[union-attr]

    # The device rejects the drafts: ROLLBACK reaches stage 1 (its cache is cropped too), then a new round continues
    # at 120 exactly as in a fresh session that never saw the rejected drafts.
    assert staged_s.send(Kind.ROLLBACK, arg=120) is None
    after = staged_s.send(Kind.DRAFT, other, 120).tensor()  # type: ignore[union-attr]
    # ... and a rollback that keeps one accepted draft leaves both stages at 121 positions
    assert staged_s.send(Kind.ROLLBACK, arg=121) is None
    assert staged_s.send(Kind.DRAFT, other, 121).tensor().shape[0] == 3  # type: ignore[union-attr]
    staged_s.close()
    single_s.close()
    # alone on the worker, as staged_s was: the planner cuts no frame of a lone session, so the chunks are the same
    fresh = Frames(engine)
    fresh.prefill(prompt, 24)
    assert torch.equal(after, fresh.send(Kind.DRAFT, other, 120).tensor())  # type: ignore[union-attr]
    fresh.close()


def test_prefill_split_into_jupiter_subsequences_matches_within_tolerance(staged, split, shallow) -> None:
    engine = staged.engine
    planner = engine.pipeline.planner
    saved = planner.mode, planner.fit.costs, planner.cache
    # Fixed per-stage costs (1 ms a pass + 1 ms a token) so the plan does not depend on this machine's timing.
    planner.mode, planner.fit.costs = "dp", (ChunkCost(1e-3, 1e-3), ChunkCost(1e-3, 1e-3))
    planner.cache = type(saved[2])(16)
    try:
        lengths = planner.lengths(200, 0)
        assert len(lengths) > 2 and sum(lengths) == 200
        forwards = engine.stats.forwards
        s = Frames(engine)
        # Stage 1 paused: stage 0 runs ahead by exactly max_inflight = P = 2 pieces, then waits.
        child = engine.pipeline.children[0]
        os.kill(child.pid, signal.SIGSTOP)
        try:
            data = wire.encode_tensor(Kind.PREFILL_CHUNK, s.session.id, 1, shallow.contiguous(), arg=0)
            fut = engine.submit(s.session, data)  # one frame of 200 positions, run as len(lengths) micro-batches
            deadline = time.monotonic() + 60
            while engine.pipeline.inflight < 2:
                assert time.monotonic() < deadline, "stage 0 did not run ahead"
                time.sleep(0.02)
            time.sleep(0.5)
            assert engine.pipeline.inflight == 2 and not fut.done()
        finally:
            os.kill(child.pid, signal.SIGCONT)
        (reply,) = [wire.decode_frame(b) for b in fut.result(timeout=120)]
        assert reply.kind == Kind.DEEP_STATE and reply.arg == 199, reply.text() if reply.kind == Kind.ERROR else ""
        deep = reply.tensor()
        s.seq = 1
        assert engine.stats.forwards - forwards == len(lengths)
        with torch.inference_mode():
            ref = split.middle(shallow[None])[0, -1:]
        assert relative(deep, ref) <= 1e-3
        s.close()
    finally:
        planner.mode, planner.fit.costs, planner.cache = saved


async def test_greedy_hat_through_two_stages_equals_u_shape(staged, smol) -> None:
    model, tok = smol
    ids = prompt_ids(tok)
    ref, gaps = u_shape_greedy(model, ids, N)
    backend = staged.backend(model, tok, SMOL)
    await backend.start()
    try:
        got = token_ids(await collect(backend, ids, max_tokens=N))
        assert backend.stats.rounds >= 1
    finally:
        await backend.close()
    check_against_reference(got, ref, gaps)


async def test_qwen_greedy_hat_through_two_stages_equals_u_shape() -> None:
    """The default pair, Qwen2.5-Coder-0.5B with its shipped adapter and draft vocabulary (so real drafts are
    accepted and verified across both stages), against plain U-shape. Kept short: 10 tokens, no start-up timing of
    the layers (an even split) and no τ profile: this test needs neither a balanced split nor sub-sequence plans,
    and on this box the timing costs ~4 s and the τ profile ~20 s of Qwen passes."""
    model, tok = load(QWEN05)
    ids = prompt_ids(tok)
    adapter, draft_vocab = draft_files(QWEN05, 2)
    assert adapter is not None and draft_vocab is not None
    server = WorkerServer(
        model, QWEN05, stages=2, stage_threads=[1, 1], sequence_partition="off", max_sessions=1, stage_timeout=60,
        stage_probe_rounds=0, prefill_profile=False,
    ).start()  # fmt: skip
    pipeline = server.engine.pipeline
    try:
        assert server.engine.pipeline.bounds == ((2, 13), (13, 24))  # Qwen2.5-0.5B: 24 layers, 22 in the middle
        backend = server.backend(model, tok, QWEN05, adapter_path=adapter, draft_vocab_path=draft_vocab)
        await backend.start()
        try:
            got = token_ids(await collect(backend, ids, max_tokens=QWEN_TOKENS))
            assert backend.stats.rounds >= 1 and backend.stats.accepted > 0
        finally:
            await backend.close()
    finally:
        server.stop()
        assert all(child.poll() is not None for child in pipeline.children), "a stage process was left running"
    ref, gaps = u_shape_greedy(model, ids, QWEN_TOKENS)
    check_against_reference(got, ref, gaps)


@pytest.fixture(scope="module")
def hat_gateway(staged) -> Iterator[Any]:
    """A gateway whose cloud is HAT at the 2-stage worker, with SmolLM2 on the device to finish answers."""
    gw = start_gateway(f"""
[gateway]
policy = "cloud"
cloud = "hat"
[device]
model = "{SMOL}"
n_ctx = 2048
[disco]
migration = false
profile_device = false
[clouds.hat]
kind = "hat"
model = "{SMOL}"
m = 2
worker_url = "{staged.ws}"
auth_token = "worker-token-5c1e"
""")
    yield gw
    stop_gateway(gw)


def test_outline_points_fill_the_staged_workers_pipeline_without_a_refused_session(staged, hat_gateway) -> None:
    """Outline decoding pinned to HAT (Jupiter §V-B): the points are injected into the 2-stage worker's pipeline side
    by side — placement counts its P = 2 lanes — but never more at once than the worker takes sessions
    (MAX_SESSIONS), so no point is refused and falls back: every point finishes on HAT."""
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], staged.engine.session_count)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        r = httpx.post(hat_gateway.v1 + "/chat/completions", timeout=600, json={
            "model": "hat", "messages": [{"role": "user", "content": "List four ways to save money."}],
            "max_tokens": 160, "temperature": 0, "tandem": {"decoding": "outline"},
        })  # fmt: skip
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200, r.text
    decoding = trace(hat_gateway, r.json()["id"])["decoding"]
    assert decoding["outline"] is True and decoding["lanes"] == {"hat": 2}, decoding
    points = decoding["points"]
    assert len(points) > MAX_SESSIONS, points  # more points than the worker takes sessions at once
    assert {p["endpoint"] for p in points} == {"hat"}
    for part in decoding["parts"]:
        assert [(e["backend"], e["outcome"]) for e in trace(hat_gateway, part)["endpoints"]] == [("hat", "finished")]
    assert peak[0] == MAX_SESSIONS, peak  # the pipeline held as many points as the worker takes, never more
    assert staged.engine.session_count == 0


def test_killed_stage_fails_its_sessions_and_the_gateway_finishes_on_the_device(staged, hat_gateway) -> None:
    """Last in this module: it leaves the staged worker broken."""
    child = staged.engine.pipeline.children[0]
    killed = threading.Event()

    def kill_after_three(n: int) -> None:
        if n == 3 and not killed.is_set():
            os.kill(child.pid, signal.SIGKILL)
            killed.set()

    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
    rid, pieces, finish = stream_chunks(hat_gateway, messages, max_tokens=64, on_chunk=kill_after_three)
    assert killed.is_set() and finish in ("stop", "length")
    t = trace(hat_gateway, rid)
    outcomes = [(e["backend"], e["outcome"]) for e in t["endpoints"]]
    assert outcomes == [("hat", "failed"), ("device", "finished")], t
    assert "stage" in t["endpoints"][0]["error"], t["endpoints"][0]
    assert [m["reason"] for m in t["migrations"]] == ["error"]
    assert 0 < t["migrations"][0]["at_token"] < len(pieces)

    # The worker says why it is not ready, and refuses new sessions with a clear error.
    r = httpx.get(staged.http + "/health/ready", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "failed"
    assert "stage 1" in r.json()["error"], r.json()
    assert staged.engine.session_count == 0
    deadline = time.monotonic() + 5
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() == -signal.SIGKILL
