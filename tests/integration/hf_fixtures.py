"""Real-model fixtures for the torch / HAT integration tests (import them into a test module).

Why not tests/conftest.py: that file belongs to the gateway tests. Loads are memoised per process, so a model is
converted (first run only, cached on disk) and loaded once however many modules import these fixtures.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from app.serving.relay import Relay
from clients.base import GenerationRequest, TokenEvent
from deploy.models import model_path

# One intra-op thread: batch-1 CPU inference is memory-bound (2 threads are no faster), and on a shared 2-core box
# OpenMP threads that spin while another process holds a core make runs 3-4x slower. Override to experiment.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_TORCH_THREADS", "1")))

SMOL = "smollm2-135m-instruct"
QWEN05 = "qwen2.5-coder-0.5b-instruct"

# Greedy text is bit-identical only along one computation path (README, "What is exact"). A reference computed along
# another (a plain forward per token against verified drafts, a whole prompt against chunks, other kernels) reassociates
# float sums (~1e-5 relative) and may pick the other of two nearly tied tokens. A difference is accepted only where the
# reference's top-2 logit gap is below NEAR_TIE, and is reported; after it the answers go separate ways.
NEAR_TIE = 5e-3


def gguf_or_skip(name: str) -> Path:
    path = model_path(name)
    if not path.is_file():
        pytest.skip(f"{name} not fetched; run: python -m deploy.models fetch {name}")
    return path


@functools.cache
def _load(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from clients.hf_model import load_hf_model

    return load_hf_model(model_path(name), dtype=dtype)


def load(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    gguf_or_skip(name)
    return _load(name, dtype)


def chat_prompt(tokenizer: Any, user: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="session")
def smollm() -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, fp32."""
    return load(SMOL)


@pytest.fixture(scope="session")
def qwen05() -> tuple[Any, Any]:
    """(model, tokenizer) of Qwen2.5-Coder-0.5B-Instruct, fp32."""
    return load(QWEN05)


def top2_gap(logits: torch.Tensor) -> float:
    """The gap between the two largest logits (inf where a mask leaves one token): how near a pick is to a tie."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def check_against_reference(got: list[int], ref: list[int], gaps: list[float]) -> int | None:
    """`got` equals the reference `ref` token for token, or up to a near-tie flip (gaps[i]: the reference's top-2
    logit gap at its token i, and at the end token where it ended there). Returns the flip's index, if any; nothing
    after it is compared."""
    for i, (g, r) in enumerate(zip(got, ref, strict=False)):
        if g != r:
            assert gaps[i] < NEAR_TIE, f"token {i}: {g} != the reference's {r} with a logit gap of {gaps[i]:.3g}"
            print(f"near-tie flip at token {i}: the reference's top-2 gap {gaps[i]:.2e}")
            return i
    if len(got) != len(ref):  # one ended (an end token) where the other went on: a flip at that token
        i = min(len(got), len(ref))
        assert i < len(gaps) and gaps[i] < NEAR_TIE, f"ended at {len(got)} tokens, the reference at {len(ref)}"
        print(f"near-tie flip at token {i} (an end): the reference's top-2 gap {gaps[i]:.2e}")
        return i
    return None


def relayed(request: GenerationRequest, events: list[TokenEvent]) -> tuple[str, str | None, int]:
    """What the gateway's relay (app/serving/relay.py), the one place stop sequences are enforced, delivers of a
    backend's `events`: its text, finish reason, and how many events it took to end the answer."""
    relay = Relay(request, t_first=0.0, consumption_rate=1.0)
    text = ""
    for n, event in enumerate(events, 1):
        delta = relay.feed(event, 0.0)
        text += delta.text
        if delta.finish_reason is not None:
            return text, delta.finish_reason, n
    return text, None, len(events)
