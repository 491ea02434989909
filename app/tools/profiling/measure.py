"""The timed half of `tandem profile`: the device's draft step and head, the worker's middle, the link.

Device (this process, the real device-half code: clients.hat.half.DeviceHalf's input submodel, adapter and draft
head with its reduced vocabulary): one draft-model step for r rows, batched as a tree depth or parallel drafting
runs it (r continuations of one context, each fed one token, then the draft head over the r rows); the full LM
head over r rows as greedy verification runs it (DeviceHalf.argmax_rows: the int8 head exact for the argmax, unless
head_precision = "fp32"). Medians over repeats.

Worker (a running `tandem worker`, over the real protocol and transport, through the link emulator when one is
given): the middle layers' compute for w positions after c context positions, and the link's round-trip latency
and bandwidths. The compute time comes from the worker's own clock: its OPEN reply carries eta, the moving
average of its pass times (HAT Eq. 1's form, weight of history alpha = policies.estimate.DEFAULT_HISTORY_WEIGHT),
and its pass count; after exactly one pass, t = (eta_new - alpha * eta_old) / (1 - alpha). A second session opened
after each timed frame reads them (an OPEN runs no pass), so a sample whose pass count moved by more than one
(another device's work) is dropped. The link is then fitted by least squares on every sample's round trip minus
its compute: rtt + n_up * A / beta_up + n_down * A / beta_down (n_up / n_down: positions sent / returned; A: bytes
of one hidden state). A bandwidth too high to see (loopback) is reported as null.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from clients.hat.half import DeviceHalf
from policies.estimate import DEFAULT_HISTORY_WEIGHT


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn` over `repeats` calls after `warmup` untimed ones, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def device_times(half: DeviceHalf, rows: Sequence[int], context: int, repeats: int) -> dict[str, Any]:
    """Draft step and LM head for each row count, after `context` tokens (a loaded HATBackend's parts)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(half.vocab_size, 32000), (1, context + 1), generator=gen)
    in_cache, ad_cache = half.input.new_cache(), half.adapter.new_cache()
    half.adapter(half.input(ids[:, :context], in_cache, positions=0), ad_cache, positions=0)
    draft: dict[str, float] = {}
    head: dict[str, float] = {}

    def ms(fn: Callable[[], Any]) -> float:
        return round(median_ms(fn, repeats, warmup=2), 4)

    for r in rows:
        tok = ids[:, context:].expand(r, 1).contiguous()

        def step(r: int = r, tok: torch.Tensor = tok) -> None:
            ic, ac = in_cache.fork(r, context), ad_cache.fork(r, context)  # r continuations of one context
            feats = half.adapter(half.input(tok, ic, positions=context), ac, positions=context)
            torch.softmax(half.draft_logits(feats[:, -1], context), -1).max(-1)

        fork_only = ms(lambda r=r: (in_cache.fork(r, context), ad_cache.fork(r, context)))
        draft[str(r)] = round(max(ms(step) - fork_only, 1e-4), 4)
        deep = torch.randn(r, half.hidden_size, generator=gen)
        head[str(r)] = ms(lambda deep=deep: half.argmax_rows(deep).argmax(-1))  # greedy verification's head
    return {"context": context, "draft_step_ms": draft, "head_ms": head}


@dataclass
class _Sample:
    kind: str  # "draft" | "prefill"
    positions: int
    context: int
    round_trip: float  # s
    compute: float | None  # s, the worker's own pass time (None: not readable, see the module docstring)


class WorkerProbe:
    """A measuring session on a worker, and a way to read the worker's pass count and eta between frames."""

    def __init__(
        self,
        url: str,
        hidden: int,
        num_layers: int,
        m: int,
        model: str,
        link: Any = None,
        auth: str | None = None,
        wire_dtype: str = "float32",
    ):
        from clients.hat import wire
        from clients.hat.transport import LinkOptions, WorkerAddress

        dtype = wire.dtype_by_name(wire_dtype)
        self.address = WorkerAddress.parse(url)
        self.opts = LinkOptions(name="profile", auth_token=auth, profile=link, round_timeout=300.0, wire_dtype=dtype)
        self.token_bytes = hidden * torch.empty((), dtype=dtype).element_size()
        self.shape = (hidden, num_layers, m, model)
        self.wire = wire
        self.session: Any = None
        self.info: dict[str, Any] = {}

    async def _open(self) -> Any:
        from clients.hat.session import FrameSession

        hidden, layers, m, model = self.shape
        s = FrameSession(self.address.transport(self.opts), self.opts, hidden)
        await s.open(layers, m, model)
        return s

    async def __aenter__(self) -> WorkerProbe:
        self.session = await self._open()
        self.info = dict(self.session.info)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.session.close()

    async def counters(self) -> tuple[int, float]:
        """(passes so far, eta) from a fresh OPEN (which runs no pass)."""
        s = await self._open()
        try:
            return int(s.info["forwards"]), float(s.info["eta"])
        finally:
            await s.close()

    async def timed(self, kind: str, states: torch.Tensor, position: int) -> _Sample:
        wire = self.wire
        frame_kind, reply_kind = (
            (wire.Kind.DRAFT, wire.Kind.VERIFY_RESULT)
            if kind == "draft"
            else (wire.Kind.PREFILL_CHUNK, wire.Kind.DEEP_STATE)
        )
        before = await self.counters()
        t0 = time.perf_counter()
        seq = self.session.send_tensor(frame_kind, states, position)
        await self.session.reply(seq, reply_kind)
        rt = time.perf_counter() - t0
        after = await self.counters()
        compute = None
        if after[0] == before[0] + 1:
            a = DEFAULT_HISTORY_WEIGHT
            compute = after[1] if before[0] == 0 else (after[1] - a * before[1]) / (1 - a)
        return _Sample(kind, int(states.shape[0]), position, rt, compute)

    async def fill(self, states: torch.Tensor, start: int, chunk: int = 256) -> None:
        """Prefill context positions [start, start + len(states)) (untimed)."""
        wire = self.wire
        for s in range(0, states.shape[0], chunk):
            seq = self.session.send_tensor(wire.Kind.PREFILL_CHUNK, states[s : s + chunk], start + s)
            await self.session.reply(seq, wire.Kind.DEEP_STATE)

    def rollback(self, keep: int) -> None:
        self.session.send_control(self.wire.Kind.ROLLBACK, keep)


async def worker_times(
    probe: WorkerProbe,
    states: torch.Tensor,
    widths: Sequence[int],
    contexts: Sequence[int],
    link_positions: Sequence[int],
    repeats: int,
) -> dict[str, Any]:
    """Middle compute per (context, positions), and the link fitted on every sample (see the module docstring).

    `states`: shallow states to send (at least max(contexts) + max(widths, link_positions) rows; their values do not
    change a pass's time)."""
    samples: list[_Sample] = []
    middle: dict[str, dict[str, float]] = {}
    filled = 0
    for c in sorted(contexts):
        await probe.fill(states[filled:c], filled)
        filled = c
        per: dict[str, float] = {}
        for w in widths:
            got = []
            for _ in range(repeats):
                s = await probe.timed("draft", states[c : c + w], c)
                probe.rollback(c)
                samples.append(s)
                if s.compute is not None:
                    got.append(s.compute)
            if not got:
                raise RuntimeError(
                    f"could not read the worker's pass time for {w} positions at context {c}: "
                    "other devices are using the worker (profile an idle worker)"
                )
            per[str(w)] = round(1e3 * statistics.median(got), 4)
        middle[str(c)] = per
    c = min(contexts)
    probe.rollback(c)
    for n in link_positions:
        for kind in ("draft", "prefill"):
            for _ in range(repeats):
                samples.append(await probe.timed(kind, states[c : c + n], c))
                probe.rollback(c)
    return {"middle_ms": middle, "link": fit_link(samples, probe.token_bytes)}


def fit_link(samples: Sequence[_Sample], token_bytes: int) -> dict[str, Any]:
    """rtt, up and down bandwidths by least squares over the samples whose compute time is known."""
    rows, ys = [], []
    for s in samples:
        if s.compute is None:
            continue
        down = s.positions if s.kind == "draft" else 1
        rows.append([1.0, s.positions * token_bytes, down * token_bytes])
        ys.append(s.round_trip - s.compute)
    if len(rows) < 3:
        raise RuntimeError("too few link samples with a known worker pass time (is the worker busy?)")
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    rtt, inv_up, inv_down = (float(x) for x in coef)

    # A bandwidth whose transfer time is within the timing noise is not measured: loopback.
    def bandwidth(inv: float) -> float | None:
        return round(1.0 / inv, 1) if inv > 1e-10 else None

    residual = [y - float(np.dot(r, coef)) for r, y in zip(rows, ys, strict=True)]
    return {
        "rtt_ms": round(1e3 * max(rtt, 0.0), 4),
        "up_bytes_per_s": bandwidth(inv_up),
        "down_bytes_per_s": bandwidth(inv_down),
        "token_bytes": token_bytes,
        "samples": len(rows),
        "residual_ms_median": round(1e3 * statistics.median(abs(x) for x in residual), 4),
    }
