"""What a single-process worker engine measures of its own layers at start-up, on its engine thread: the ragged
forward checked against the model's own layers (which also warms the kernels up and seeds g, HAT Eq. 2), and the
profile of the prefill cost τ(x | y) (app/worker/prefill_cost.py; `[worker] prefill_profile`). A staged worker checks
and profiles its whole pipeline instead (app/worker/pipeline.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from app.worker.compute import synchronize
from app.worker.prefill_cost import Point, profile_points
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import MiddleSubmodel
from policies.drafting import DelayPredictor


def check_ragged_forward(
    middle: MiddleSubmodel,
    ragged: RaggedMiddle,
    g: DelayPredictor,
    hidden_size: int,
    tokens: int = 8,
    tolerance: float = 1e-3,
) -> float:
    """Run the ragged forward and the model's own layers on the same random states; raise if they disagree.

    Also warms the kernels up and seeds g (Eq. 2) with two batch sizes. Returns the relative difference.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens + 1, hidden_size, generator=gen).to(ragged.device, ragged.dtype)
    ref_cache, got_cache = middle.new_cache(), middle.new_cache()
    ref = middle(x[None], ref_cache)[0]
    got = []
    for part in (x[:tokens], x[tokens:]):
        t0 = time.perf_counter()
        got.append(ragged.forward([(part, got_cache)])[0])
        synchronize(ragged.device)  # g must time the compute, not the kernels' launch (CUDA queues them)
        g.update(part.shape[0], time.perf_counter() - t0)
    diff = float((torch.cat(got) - ref).abs().max()) / max(1.0, float(ref.abs().max()))
    if not diff <= tolerance:
        raise RuntimeError(
            f"the engine's batched forward disagrees with the model's own layers (relative {diff:.2e}); "
            f"model type {getattr(middle.stack.config, 'model_type', '?')} is not supported by the engine"
        )
    return diff


def profile_prefill(middle: MiddleSubmodel, ragged: RaggedMiddle, hidden_size: int) -> list[Point]:
    """The start-up profile of τ(x | y) on this process's layers: pieces of random states timed after y cached ones."""
    gen = torch.Generator().manual_seed(1)

    def session(y: int) -> Callable[[int], list[float]]:
        cache = middle.new_cache()
        with torch.inference_mode():
            if y:
                ragged.forward([(torch.randn(y, hidden_size, generator=gen).to(ragged.device, ragged.dtype), cache)])

        def run(x: int) -> list[float]:
            piece = torch.randn(x, hidden_size, generator=gen).to(ragged.device, ragged.dtype)
            with torch.inference_mode():
                t0 = time.perf_counter()
                ragged.forward([(piece, cache)])
                synchronize(ragged.device)
                seconds = time.perf_counter() - t0
            cache.crop(y)
            return [seconds]

        return run

    return profile_points(session)
