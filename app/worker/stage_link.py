"""The stages' link: the messages of the P-stage worker and the two process groups that carry them.

Messages (never pickle): every message starts with a fixed header of HEADER int64 slots, [command, batch id,
rows, tokens, hidden size, dtype code, a, b, c, d]; the tensors that follow have shapes the header fixes:

    FORWARD / RESULT  meta int64 [rows, 4] (session id as two int64, first position, tokens), hidden [tokens,
                      hidden size] in the compute dtype, per-stage compute times int64 [P] (ns)
    FAILED            the failing stage's message, uint8 [a]
    CROP / RELEASE    none: a, b = session id, c = positions to keep
    PROBE             per-layer times int64 [P, L + 2] (ns; then the stage's free device bytes, 0 off CUDA, and a key
                      naming its device, 0 off CUDA), a = tokens, b = repetitions, c = L (start-up profile)
    ASSIGN            the layer bounds int64 [P, 2], a = min_rows, b = batch_invariant, c = max_context: no
                      session's KV cache grows past it (start-up)
    HEARTBEAT / STOP  none

Two process groups carry them: `forward` (s → s + 1) and `back` (P − 1 → 0), so stage 0's sender and receiver
threads never share a channel. Gloo on CPU, NCCL when the stages compute on CUDA with a GPU each (chosen
automatically; gloo with CPU staging otherwise). Every receive has a timeout (`stage_timeout`).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

HEADER = 10
STOP_GRACE = 5.0  # seconds a stage gets to exit after STOP before it is terminated
# How long the stages may take to meet (each loads the model first): apart from `stage_timeout`, which bounds every
# receive once they run. A spawned stage that exits before it joins fails the start-up at once anyway.
JOIN_TIMEOUT = 600.0
PROBE_EXTRA = 2  # PROBE columns after the layer times: free device bytes, device key


class Cmd(enum.IntEnum):
    HEARTBEAT = 0
    FORWARD = 1
    RESULT = 2
    FAILED = 3
    CROP = 4
    RELEASE = 5
    STOP = 6
    PROBE = 7
    ASSIGN = 8


STAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtype codes of FORWARD / RESULT headers


class StageFailure(RuntimeError):
    """The pipeline is broken: a stage died, timed out or failed a forward."""


def sid_ints(sid: bytes) -> tuple[int, int]:
    """A 16-byte session id as two int64 (a header or meta row carries it without any encoding step)."""
    return int.from_bytes(sid[:8], "little", signed=True), int.from_bytes(sid[8:16], "little", signed=True)


def header(cmd: Cmd, batch: int = 0, rows: int = 0, tokens: int = 0, hidden: int = 0, dtype: int = 0, *args: int):
    values = [int(cmd), batch, rows, tokens, hidden, dtype, *args]
    if len(values) > HEADER:
        raise ValueError("too many header values")
    return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64)


def short_error(e: BaseException) -> str:
    """An exception's first line, at most 300 characters: what a stage logs and reports about a failure."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


@dataclass
class StageLink:
    """One stage's two process groups (forward: s → s + 1; back: P − 1 → 0) and where tensors must live to travel."""

    rank: int
    world: int
    forward: Any
    back: Any
    timeout: datetime.timedelta
    comm_device: torch.device
    store: Any  # kept alive: stage 0 hosts the rendezvous store

    @staticmethod
    def rendezvous(rank: int, world: int, addr: str, port: int, timeout: float) -> Any:
        """The rendezvous store: stage 0 hosts it (port 0 picks a free one: `.port`), the others connect to it."""
        td = datetime.timedelta(seconds=max(timeout, JOIN_TIMEOUT))
        return dist.TCPStore(addr, port, world, rank == 0, timeout=td, wait_for_workers=False)

    @classmethod
    def join(cls, store: Any, rank: int, world: int, timeout: float, compute: torch.device) -> StageLink:
        """Build both process groups (blocks until every stage has joined, at most JOIN_TIMEOUT); receives then wait
        at most `timeout`."""
        td = datetime.timedelta(seconds=max(timeout, JOIN_TIMEOUT))
        nccl = compute.type == "cuda" and dist.is_nccl_available() and torch.cuda.device_count() >= world
        groups = []
        for name in ("forward", "back"):
            prefixed = dist.PrefixStore(name, store)
            if nccl:
                groups.append(dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options()))
            else:
                groups.append(dist.ProcessGroupGloo(prefixed, rank, world, td))
        comm = compute if nccl else torch.device("cpu")
        return cls(rank, world, groups[0], groups[1], datetime.timedelta(seconds=timeout), comm, store)

    @property
    def port(self) -> int:
        return int(self.store.port)

    @property
    def backend(self) -> str:
        return "nccl" if self.comm_device.type == "cuda" else "gloo"

    def _peer(self, towards_next: bool) -> tuple[Any, int]:
        if towards_next and self.rank < self.world - 1:
            return self.forward, self.rank + 1
        if self.rank == self.world - 1:  # the last stage's "next" is stage 0, on the back channel
            return self.back, 0
        raise ValueError(f"stage {self.rank} has no peer there")

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send a message (header first) to the next stage (the last stage sends to stage 0)."""
        group, peer = self._peer(True)
        for t in tensors:
            group.send([t.to(self.comm_device).contiguous()], peer, 0).wait()

    def recv(self, shape: Sequence[int], dtype: torch.dtype, *, from_last: bool = False) -> torch.Tensor:
        """Receive one tensor of a known shape from the previous stage (stage 0: from the last, from_last=True)."""
        t = torch.empty(tuple(shape), dtype=dtype, device=self.comm_device)
        if from_last:
            self.back.recv([t], self.world - 1, 0).wait(self.timeout)
        else:
            self.forward.recv([t], self.rank - 1, 0).wait(self.timeout)
        return t

    def recv_message(self, *, from_last: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A header and the tensors its command says follow it."""
        head = self.recv((HEADER,), torch.int64, from_last=from_last).cpu()
        cmd, _batch, rows, tokens, hidden, dtype, a, _b, c, _d = (int(v) for v in head)
        if cmd in (Cmd.FORWARD, Cmd.RESULT):
            if not (0 <= dtype < len(STAGE_DTYPES)) or rows < 1 or tokens < 1 or hidden < 1:
                raise StageFailure(f"bad {Cmd(cmd).name} header {head.tolist()}")
            shapes = [((rows, 4), torch.int64), ((tokens, hidden), STAGE_DTYPES[dtype]), ((self.world,), torch.int64)]
        elif cmd == Cmd.FAILED:
            shapes = [((max(a, 0),), torch.uint8)]
        elif cmd == Cmd.PROBE:
            shapes = [((self.world, c + PROBE_EXTRA), torch.int64)]
        elif cmd == Cmd.ASSIGN:
            shapes = [((self.world, 2), torch.int64)]
        elif cmd in (Cmd.HEARTBEAT, Cmd.CROP, Cmd.RELEASE, Cmd.STOP):
            shapes = []
        else:
            raise StageFailure(f"unknown stage command {cmd}")
        return head, [self.recv(s, dt, from_last=from_last) for s, dt in shapes]
