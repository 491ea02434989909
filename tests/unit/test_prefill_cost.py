"""The worker's prefill cost τ(x | y) travelling to the device: the engine fits it (start-up profile or its own lone
prefill pieces) and reports it at OPEN; the device half reads it (validated plain numbers) and plans its DP chunks
with it instead of g. Tiny random Llama (conftest's `tiny`), no sockets."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM

from app.worker.engine import Engine
from app.worker.prefill_cost import fit_stage_costs
from app.worker.settings import EngineLimits
from clients.hat import wire
from clients.hat.options import HATOptions
from clients.hat.prefill_plan import PrefillPlanner, worker_prefill_cost
from clients.hat.split import split_model
from policies.sequence_partition import ChunkCost, plan_device_prefill

Kind = wire.Kind
H = 32  # the tiny model's hidden size


@pytest.fixture
def engine(tiny: LlamaForCausalLM) -> Iterator[Engine]:
    e = Engine(split_model(tiny, 2).middle, EngineLimits(max_sessions=2, max_context=512), model_name="tiny")
    e.start()
    yield e
    e.stop()


def opened(engine: Engine):
    params = {"hidden_size": H, "num_layers": 4, "m": 2, "dtype": "float32"}
    session, reply = engine.open(wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(params)))
    return session, json.loads(wire.decode_frame(reply).text())


def test_the_engine_fits_tau_from_its_own_lone_prefill_pieces_and_reports_it_at_open(engine: Engine) -> None:
    session, info = opened(engine)
    assert info["prefill_tau"] is None  # nothing measured yet: devices fall back to g
    seq, position = 0, 0
    # four lone prefill frames of different lengths after growing contexts: enough to pin τ (d tied to c/2)
    for x in (16, 32, 24, 20):
        seq += 1
        frame = wire.encode_tensor(Kind.PREFILL_CHUNK, session.id, seq, torch.randn(x, H), arg=position)
        (reply,) = [wire.decode_frame(b) for b in engine.submit(session, frame).result(timeout=10)]
        assert reply.kind == Kind.DEEP_STATE
        position += x
    assert engine.prefill_cost.version >= 1 and len(engine.prefill_cost.points) == 4
    _, info = opened(engine)  # a new session is told the fit
    (row,) = info["prefill_tau"]
    assert len(row) == 4 and all(isinstance(v, float) and math.isfinite(v) for v in row)
    # The least-squares fit of those four pieces (d tied to c/2: no profile), what the engine plans with.
    (fit,) = fit_stage_costs(list(engine.prefill_cost.points), 1, tied=True)  # type: ignore[misc]
    assert ChunkCost(*row) == fit == engine.prefill_cost.costs[0]  # type: ignore[index]


def test_lone_chains_of_drafts_feed_tau_too_and_a_tree_does_not(engine: Engine) -> None:
    """A chain of drafts is the prefill's computation (consecutive positions after the cache), so a lone one times
    τ(x | y) as well: a worker whose sessions only verify (or flood it with drafts) learns τ, which prices their fair
    share of a pass (app/worker/scheduler.py). A token tree attends otherwise and is not a point."""
    session, _ = opened(engine)
    seq, position = 0, 0
    for x in (16, 32, 24):
        seq += 1
        frame = wire.encode_tensor(Kind.DRAFT, session.id, seq, torch.randn(x, H), arg=position)
        *_status, reply = [wire.decode_frame(b) for b in engine.submit(session, frame).result(timeout=10)]
        assert reply.kind == Kind.VERIFY_RESULT
        position += x
    assert [(x, y) for x, y, _ in engine.prefill_cost.points] == [(16, 0), (32, 16), (24, 48)]
    assert engine.prefill_cost.total() == engine.prefill_cost.costs[0]  # type: ignore[index]  # one stage: its τ
    parents = [-1, *range(15), 0]  # a 17-node tree: a chain of 16 and a branch at the root
    seq += 1
    engine.submit(session, wire.encode_indices(Kind.TREE, session.id, seq, parents, arg=position))
    seq += 1
    tree = wire.encode_tensor(Kind.DRAFT, session.id, seq, torch.randn(len(parents), H), arg=position)
    *_status, reply = [wire.decode_frame(b) for b in engine.submit(session, tree).result(timeout=10)]
    assert reply.kind == Kind.VERIFY_RESULT and len(engine.prefill_cost.points) == 3


def test_the_start_up_profile_determines_tau_before_any_session(engine: Engine) -> None:
    engine.call(engine.profile_prefill).result(timeout=60)
    fit = engine.prefill_cost
    assert [(x, y) for x, y, _ in fit.profiled] == [(16, 0), (64, 0), (192, 0), (16, 256), (64, 256), (192, 256)]
    _, info = opened(engine)
    (row,) = info["prefill_tau"]
    cost = ChunkCost(*row)
    # The fit of the profile's six timings (clamped non-negative: that part cannot fail) reaches a new session.
    assert (cost,) == fit_stage_costs(fit.profiled, 1) and cost(192, 0) > 0


def test_the_device_reads_tau_as_one_stage_and_refuses_malformed_values() -> None:
    one = {"prefill_tau": [[0.1, 2e-3, 1e-6, 5e-7]]}
    assert worker_prefill_cost(one) == ChunkCost(0.1, 2e-3, 1e-6, 5e-7)
    two = {"prefill_tau": [[0.1, 2e-3, 1e-6, 0.0], [0.2, 1e-3, 0.0, 5e-7]]}  # a staged worker: the stages' sum
    summed = worker_prefill_cost(two)
    assert summed is not None and summed(100, 50) == pytest.approx(ChunkCost(0.3, 3e-3, 1e-6, 5e-7)(100, 50))
    assert worker_prefill_cost({}) is None and worker_prefill_cost({"prefill_tau": None}) is None
    for bad in ([], [[0.1, 0.2, 0.3]], [[0.1, -1.0, 0.0, 0.0]], [[0.1, "x", 0.0, 0.0]], [[0.1, math.nan, 0, 0]],
                [[True, 0.0, 0.0, 0.0]], "0.1,0.2", [0.1, 0.2, 0.3, 0.4]):  # fmt: skip
        assert worker_prefill_cost({"prefill_tau": bad}) is None, bad


def test_dp_chunks_are_planned_with_the_workers_tau_when_it_sends_one() -> None:
    planner = PrefillPlanner(
        HATOptions(worker_url="ws://127.0.0.1:1", chunking="dp", chunk_size=None),
        state_bytes=H * 4,  # what loading the device half would set (float32 on the wire)
        device_tau=ChunkCost(0.002, 1e-4),
    )
    base = {"g": [1e-4, 0.01], "mu": 1.0, "max_frame_bytes": 1 << 20}
    worker = ChunkCost(0.05, 1e-3, 2e-6, 1e-6)  # a pass's fixed cost and attention g knows nothing of
    with_tau = planner.plan(1024, {**base, "prefill_tau": [[worker.a, worker.b, worker.c, worker.d]]}, beta_up=5e6)
    assert with_tau.worker_tau == worker
    want = plan_device_prefill(
        1024, planner.device_tau, worker, token_bytes=H * 4, beta_up=5e6, min_len=16, granularity=16,
        max_len=(1 << 20) // (H * 4),
    )  # fmt: skip
    assert with_tau.bounds == want.bounds
    without = planner.plan(1024, base, beta_up=5e6)  # an older worker: g as a context-free τ
    assert without.worker_tau == ChunkCost(0.01, 1e-4)
    assert without.bounds != with_tau.bounds


def test_a_long_piece_beside_decode_sized_ones_times_tau_and_two_long_pieces_do_not(engine: Engine) -> None:
    """The engine holds a flood's pass for another session's round, so its pieces mostly share a pass with a few
    rows: such a pass still gives τ a point (the piece's x and y); a pass of two long pieces does not (whose?)."""
    # g as a profile primes it: the start-up check's two timings alone can fit a slope <= 0 on a busy host, and with
    # nothing to price by the fair share cuts the 24-row draft into 16-row pieces (this test failed 1 run in 8 so)
    engine.call(lambda: engine.stats.g.prime([(1, 0.01), (64, 0.1)])).result()
    (a, _), (b, _) = opened(engine), opened(engine)

    def together(frames: list[tuple[object, bytes]]) -> None:
        gate = threading.Event()
        engine.call(gate.wait)  # hold the engine thread so that the frames share its next pass
        futures = [engine.submit(session, frame) for session, frame in frames]  # type: ignore[arg-type]
        gate.set()
        for fut in futures:
            assert wire.decode_frame(fut.result(timeout=10)[-1]).kind == Kind.VERIFY_RESULT

    def draft(session, seq: int, rows: int, at: int) -> tuple[object, bytes]:
        return session, wire.encode_tensor(Kind.DRAFT, session.id, seq, torch.randn(rows, H), arg=at)

    together([draft(a, 1, 24, 0), draft(b, 1, 3, 0)])
    assert [(x, y) for x, y, _ in engine.prefill_cost.points] == [(24, 0)]
    together([draft(a, 2, 20, 24), draft(b, 2, 16, 3)])
    assert len(engine.prefill_cost.points) == 1
