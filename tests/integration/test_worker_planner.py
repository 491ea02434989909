"""The worker's planned batching on real weights (SmolLM2-135M): a verification round is not held behind a prefill,
and a prefill frame split into sub-chunks inside the worker gives the same deep state and the same next token."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from app.worker.engine import Engine
from app.worker.settings import EngineLimits
from clients.hat import wire
from clients.hat.split import SplitModel, split_model
from tests.integration.hf_fixtures import SMOL, chat_prompt, load

Kind = wire.Kind
TOLERANCE = 1e-3  # Engine.self_check's relative tolerance


class FrozenG:
    """A fixed delay predictor g(x) = 0.002·x + 0.048 s, so the sub-chunk budget (96 tokens) does not depend on this
    machine's timings: a 128-token prefill frame is split in two 64-token pieces."""

    def coefficients(self) -> tuple[float, float]:
        return 0.002, 0.048

    def update(self, batch_tokens: float, delay: float) -> None:
        pass

    def __call__(self, x: float) -> float:
        return 0.002 * x + 0.048


@pytest.fixture(scope="module")
def split() -> SplitModel:
    model, _ = load(SMOL)
    return split_model(model, 2)


@pytest.fixture(scope="module")
def shallow(split: SplitModel) -> torch.Tensor:
    _, tok = load(SMOL)
    text = chat_prompt(tok, "Explain, step by step and with examples, how a hash map handles collisions. " * 12)
    ids = tok(text, add_special_tokens=False)["input_ids"][:160]
    assert len(ids) == 160
    with torch.inference_mode():
        return split.input(torch.tensor([ids]))[0]


@pytest.fixture
def engine(split: SplitModel) -> Iterator[Engine]:
    e = Engine(split.middle, EngineLimits(max_sessions=6, batching="planned"), model_name=SMOL)
    e.start()
    e.stats.g = FrozenG()  # type: ignore[assignment]
    yield e
    e.stop()


def open_session(engine: Engine) -> Any:
    params = {"hidden_size": engine.hidden_size, "num_layers": engine.num_layers, "m": 2, "dtype": "float32"}
    session, _ = engine.open(wire.encode_text(Kind.OPEN, bytes(16), 0, json.dumps(params)))
    return session


def frame(session: Any, seq: int, x: torch.Tensor, arg: int, kind: Kind) -> bytes:
    return wire.encode_tensor(kind, session.id, seq, x.contiguous(), arg=arg)


def result(fut: Any) -> wire.Frame:
    # A STATUS (the worker's mu and g) may ride with a verification reply: informational, skipped here.
    (f,) = [f for f in (wire.decode_frame(b) for b in fut.result(timeout=120)) if f.kind != Kind.STATUS]
    assert f.kind != Kind.ERROR, f.text()
    return f


def test_verification_first_and_subchunked_prefill_exact(
    engine: Engine, split: SplitModel, shallow: torch.Tensor
) -> None:
    prefix, draft, long = shallow[:20], shallow[20:23], shallow[:128]
    # References, each frame alone on an idle engine.
    ref_session = open_session(engine)
    result(engine.submit(ref_session, frame(ref_session, 1, prefix, 0, Kind.PREFILL_CHUNK)))
    alone = result(engine.submit(ref_session, frame(ref_session, 2, draft, 20, Kind.DRAFT))).tensor()
    with torch.inference_mode():
        unsplit = split.middle(long[None])[0]  # the model's own layers, one shot

    verifier, prefiller = open_session(engine), open_session(engine)
    result(engine.submit(verifier, frame(verifier, 1, prefix, 0, Kind.PREFILL_CHUNK)))
    order: list[str] = []
    gate = threading.Event()
    engine.call(gate.wait)  # hold the engine thread: both frames are pending in the same tick
    split_before = engine.stats.split_frames
    f_prefill = engine.submit(prefiller, frame(prefiller, 1, long, 0, Kind.PREFILL_CHUNK))
    f_verify = engine.submit(verifier, frame(verifier, 2, draft, 20, Kind.DRAFT))
    f_prefill.add_done_callback(lambda _: order.append("prefill"))
    f_verify.add_done_callback(lambda _: order.append("verify"))
    gate.set()
    got_verify = result(f_verify)
    got_prefill = result(f_prefill)

    assert order == ["verify", "prefill"]
    # The round shared its pass with the prefill's first piece: a ragged pass of other rows, whose matrix products
    # the CPU's kernels may block and sum otherwise than the round's alone (bit-identical on some CPUs, not on this
    # project's AVX-512 ones): the same within the engine's tolerance (a round verified at another position or
    # against another cache is off by far more).
    assert got_verify.kind == Kind.VERIFY_RESULT
    diff = float((got_verify.tensor() - alone).abs().max()) / max(1.0, float(alone.abs().max()))
    assert diff <= TOLERANCE, diff

    assert engine.stats.split_frames == split_before + 1 and engine.stats.subchunk_passes >= 2
    assert got_prefill.kind == Kind.DEEP_STATE and got_prefill.arg == 127
    deep = got_prefill.tensor()[0]
    ref = unsplit[-1]
    diff = float((deep - ref).abs().max()) / max(1.0, float(ref.abs().max()))
    print(f"sub-chunked vs one-shot prefill: relative difference {diff:.2e}")
    assert diff <= TOLERANCE
    with torch.inference_mode():
        assert int(split.output(deep[None]).argmax()) == int(split.output(ref[None]).argmax())
    # The split prefill left the cache exactly as long as the frame: the next round continues at position 128.
    nxt = result(engine.submit(prefiller, frame(prefiller, 2, shallow[128:131], 128, Kind.DRAFT)))
    assert nxt.kind == Kind.VERIFY_RESULT and nxt.tensor().shape[0] == 3


def test_bench_worker_batching_measures_pure_decode_throughput(tmp_path) -> None:
    """`tandem bench worker-batching --decode-only`: both modes serve the decoders and the report compares them."""
    from app.tools.bench.worker_batching_bench import main

    out = tmp_path / "report.md"
    args = ["--model", "smollm2-135m-instruct", "--decoders", "2", "--warmup", "0.3", "--decode-only", "1.0"]
    assert main([*args, "--out", str(out)]) == 0
    text = out.read_text()
    assert "pure-decode throughput" in text
    row = next(line for line in text.splitlines() if line.startswith("| rounds per second"))
    greedy, planned = (float(x) for x in row.split("|")[2:4])
    assert greedy > 0 and planned > 0
