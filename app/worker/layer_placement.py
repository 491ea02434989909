"""Layer placement for the P-stage worker: which contiguous slice of the middle layers each stage runs.

Every stage times each middle layer on its own hardware and threads (`time_layers`; stage 0 collects the times with a
PROBE down the chain, app/worker/pipeline.py); `policies.layer_partition.partition_layers` splits the layers min-max
over each stage's own per-layer times (a stage with twice the threads gets more layers) within each stage's memory cap
(`stage_memory_caps`: `stage_memory_gib`, and on CUDA the stage's share of its GPU's free memory; a layer weighs its
parameters plus its KV reserve, `layer_memory`; no split that fits fails the start-up). A stage then keeps only its
slice (`StageSlice`).
"""

from __future__ import annotations

import hashlib
import math
import socket
import time
from collections.abc import Sequence

import torch
from torch import nn

from app.worker.compute import synchronize
from clients.hat.ragged import RaggedMiddle
from clients.hat.split import LayerStack, SplitKVCache
from policies.layer_partition import InfeasiblePlan, LayerPartition, partition_layers

# The share of a GPU's free memory (at start-up, before any stage loads its slice there) the layer partition may
# fill: the rest is for a pass's activations and workspace and the allocator's fragmentation.
CUDA_MEMORY_SHARE = 0.9
GIB = 1 << 30


def time_layers(model: nn.Module, start: int, end: int, *, tokens: int = 32, reps: int = 5) -> list[float]:
    """Seconds of each decoder layer in [start, end) on `tokens` new positions (the worker's own forward): the least
    of `reps` runs, since other work on the machine only ever adds time. reps = 0: no timing (zeros)."""
    if reps < 1:
        return [0.0] * (end - start)
    hidden = int(model.config.hidden_size)
    out = []
    with torch.inference_mode():
        for i in range(start, end):
            stack = LayerStack.from_model(model, i, i + 1)
            ragged = RaggedMiddle(stack)
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(i)).to(ragged.device, ragged.dtype)
            ragged.forward([(x, stack.new_cache())])  # warm-up
            times = []
            for _ in range(reps):
                cache = stack.new_cache()
                t0 = time.perf_counter()
                ragged.forward([(x, cache)])
                synchronize(ragged.device)
                times.append(time.perf_counter() - t0)
            out.append(min(times))
    return out


class StageSlice(nn.Module):
    """Layers [start, end) of the model as the engine's "middle": what one stage runs, with its own caches."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.stack = LayerStack.from_model(model, start, end)

    def new_cache(self, max_positions: int | None = None) -> SplitKVCache:
        return self.stack.new_cache(max_positions)

    def forward(self, hidden: torch.Tensor, cache: SplitKVCache | None = None) -> torch.Tensor:
        return self.stack.run(hidden, cache)


def plan_layers(
    times: Sequence[Sequence[float]],
    stages: int,
    *,
    layer_memory: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
) -> LayerPartition:
    """Jupiter's layer partition from each stage's own timing of every middle layer (policies.layer_partition.
    partition_layers with one row per stage: a range costs stage s the sum of its own times for those layers, not
    one speed factor times a reference), each stage's layers within its memory cap (bytes; `layer_memory`: bytes per
    layer). InfeasiblePlan when no split fits: the message names every stage's cap and the layers' bytes."""
    rows = [list(row) for row in times]
    try:
        return partition_layers(rows, stages, layer_memory=layer_memory, memory_caps=memory_caps)
    except InfeasiblePlan as e:
        if layer_memory is None or memory_caps is None:
            raise
        caps = ", ".join(f"stage {s} {gib(c)}" for s, c in enumerate(memory_caps))
        raise InfeasiblePlan(
            f"the {len(rows[0])} middle layers ({gib(sum(layer_memory))} in all, {gib(min(layer_memory))} to "
            f"{gib(max(layer_memory))} per layer with its KV reserve) do not fit the stages' memory caps ({caps}): {e}"
        ) from None


def layer_memory(model: nn.Module, start: int, end: int, kv_positions: int) -> list[int]:
    """Bytes each decoder layer in [start, end) holds on its stage: its parameters (exact) plus a KV reserve of
    `kv_positions` cached positions (keys and values in the parameters' dtype, the layer's own k/v widths). The
    reserve is the worst case the worker admits (max_sessions x max_context), so a split that fits cannot run out
    of memory later because sessions filled their caches; activations are left to the caps' headroom."""
    layers = _decoder_layers(model)
    out = []
    for i in range(start, end):
        layer = layers[i]
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        attn = layer.self_attn
        kv_width = int(attn.k_proj.out_features) + int(attn.v_proj.out_features)
        itemsize = attn.k_proj.weight.element_size()
        out.append(params + kv_positions * kv_width * itemsize)
    return out


def _decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    inner = getattr(model, "model", model)
    return inner.layers  # type: ignore[return-value]


def stage_memory_caps(
    configured_gib: Sequence[float] | None, free_bytes: Sequence[int], device_keys: Sequence[int]
) -> list[float] | None:
    """Each stage's memory cap (bytes) for the layer partition: the configured cap (GiB), and on a GPU at most
    CUDA_MEMORY_SHARE of the free memory it reported, split evenly between the stages that reported the same device
    (several stages on one GPU share it). free_bytes[s] = 0: not on CUDA (no device limit). None: no caps at all."""
    stages = len(free_bytes)
    sharing: dict[int, int] = {}
    for key in device_keys:
        if key:
            sharing[key] = sharing.get(key, 0) + 1
    caps = []
    for s in range(stages):
        cap = math.inf if configured_gib is None else float(configured_gib[s]) * GIB
        if free_bytes[s] > 0 and device_keys[s]:
            cap = min(cap, CUDA_MEMORY_SHARE * free_bytes[s] / sharing[device_keys[s]])
        caps.append(cap)
    return None if all(math.isinf(c) for c in caps) else caps


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free bytes, a key naming the device) for PROBE replies: (0, 0) off CUDA. The key is the GPU's UUID hashed to
    63 bits, so stages on different hosts never collide and stages sharing one GPU report the same key."""
    if device.type != "cuda":
        return 0, 0
    free, _total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    name = str(getattr(props, "uuid", "") or f"{socket.gethostname()}:{device.index}")
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
    return int(free), key or 1


def gib(n: float) -> str:
    return "no cap" if math.isinf(n) else f"{n / GIB:.2f} GiB"
