"""How the device half cuts a prompt into prefill chunks (HAT §3.3; Jupiter's sequence partition).

- Equal chunks (`chunking = "eq3"`): X tokens each, X from Eq. 3 (policies/chunking.py) given the measured upload
  bandwidth and the worker's g(.) and mu from its OPEN reply, so the upload of chunk k+1 overlaps the worker's
  compute of chunk k; a fixed `chunk_size` overrides it.
- Unequal chunks (`chunking = "dp"`): Jupiter's partition over the device -> link -> worker pipeline
  (policies/sequence_partition.py plan_device_prefill, an LRU of plans): the device's own τ(x | y), fitted at load by
  `fit_device_tau`, the upload at the measured bandwidth, and the worker's prefill τ(x | y) from its OPEN reply
  (`prefill_tau`, read by `worker_prefill_cost`); a worker that sends none (an older one, or one that has not fitted
  it yet) is modelled by its g as a context-free τ.

Either way no chunk is longer than one of the worker's frames can carry.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from clients.hat import wire
from clients.hat.drafting import Drafter
from clients.hat.options import HATOptions
from policies.chunking import chunk_bounds, chunk_size, split_prompt
from policies.sequence_partition import ChunkCost, PlanCache, fit_chunk_cost, plan_device_prefill

log = logging.getLogger(__name__)


def worker_prefill_cost(info: dict[str, Any]) -> ChunkCost | None:
    """The worker's prefill cost from its OPEN reply as one stage of the device's plan, or None when it sent none or
    sent something malformed (then g stands in). `prefill_tau` is [a, b, c, d] per worker stage (seconds, finite,
    >= 0). A staged worker's stages become one stage here with τ their sum: a conservative model (the stages overlap
    one chunk's work with the next one's), chosen because planning P + 2 machines exactly per request would cost far
    more than it could save on the request path."""
    raw = info.get("prefill_tau")
    if raw is None:
        return None
    ok = isinstance(raw, list) and raw and all(isinstance(row, list) and len(row) == 4 for row in raw)
    if ok:
        values = [v for row in raw for v in row]
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)
    if not ok:
        log.warning("worker sent a malformed prefill_tau (%.200r); planning its chunks with g", raw)
        return None
    a, b, c, d = (float(sum(row[i] for row in raw)) for i in range(4))
    return ChunkCost(a, b, c, d)


def fit_device_tau(drafter: Drafter) -> ChunkCost:
    """τ(x | y) of this device's prefill step (input submodel + adapter): timed on a small grid."""
    points = []
    with torch.inference_mode():
        for y in (0, 128):
            for x in (16, 64, 128):
                st = drafter.new_state()
                if y:
                    drafter.prefill(st, [0] * y, 0)
                samples = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    drafter.prefill(st, [0] * x, y)
                    samples.append(time.perf_counter() - t0)
                    st.crop(y)
                points.append((x, y, min(samples)))
    return fit_chunk_cost(points)


@dataclass(frozen=True)
class PrefillPlan:
    bounds: list[tuple[int, int]]  # the chunks as [start, end) of the prompt
    worker_tau: ChunkCost | None = None  # "dp": the worker stage's τ(x | y) it used (its prefill_tau, or g)


class PrefillPlanner:
    """A backend's prefill chunking (see the module docstring). `state_bytes`: one hidden state on the wire;
    `device_tau`: this device's fitted prefill step time (`chunking = "dp"` plans with it; None: equal chunks)."""

    def __init__(self, options: HATOptions, state_bytes: int, device_tau: ChunkCost | None = None) -> None:
        self.options = options
        self.state_bytes = state_bytes
        self.device_tau = device_tau
        self.plans = PlanCache(64)

    def plan(self, length: int, info: dict[str, Any], beta_up: float) -> PrefillPlan:
        """The chunks of a `length`-token prompt for the worker that sent OPEN reply `info`, uploading at `beta_up`
        bytes/s."""
        o = self.options
        if o.chunking != "dp" or o.chunk_size or self.device_tau is None or length < 2:
            return PrefillPlan(chunk_bounds(split_prompt(length, self.chunk_size(length, info, beta_up))))
        worker = worker_prefill_cost(info)
        if worker is None:
            slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
            worker = ChunkCost(a=max(intercept, 0.0), b=max(slope, 0.0))
        plan = plan_device_prefill(
            length,
            self.device_tau,
            worker,
            token_bytes=self.state_bytes,
            beta_up=beta_up,
            min_len=min(o.min_chunk, length),
            granularity=min(16, length),
            max_len=self.frame_tokens(info),
            cache=self.plans,
        )
        return PrefillPlan(plan.bounds, worker)

    def chunk_size(self, length: int, info: dict[str, Any], beta_up: float) -> int:
        """Equal chunks' size: fixed, or Eq. 3; never more than fits one of the worker's frames."""
        fits = self.frame_tokens(info)
        if self.options.chunk_size:
            return max(1, min(self.options.chunk_size, fits))
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        x = chunk_size(
            token_bytes=self.state_bytes,
            beta_up=beta_up,
            g=(slope, intercept),
            mu=float(info.get("mu", 0.0)),
            pipeline=int(info.get("pipeline", 1)),
            min_chunk=self.options.min_chunk,
            max_chunk=self.options.max_chunk,
        )
        return max(1, min(x, length, fits))

    def frame_tokens(self, info: dict[str, Any]) -> int:
        """Most positions one of the worker's frames can carry."""
        limit = info.get("max_frame_bytes") or self.options.max_frame_bytes or wire.DEFAULT_MAX_FRAME_BYTES
        return max(1, int(limit) // self.state_bytes)
