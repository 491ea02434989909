"""The device side of STATUS frames: the worker's mu and g replace the OPEN values mid-session, and the next draft
length is planned with them (the stale-mu/g path), without disturbing reply matching."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from clients.base import BackendError
from clients.hat import wire
from clients.hat.session import FrameSession
from clients.hat.transport import LinkOptions
from policies.drafting import DraftLengthController, LinkState

H = 8
SID = bytes(range(16))
Kind = wire.Kind


class FakeTransport:
    """Answers OPEN with `info`, then hands out queued reply frames."""

    def __init__(self, info: dict) -> None:
        self.info = info
        self.sent: list[bytes] = []
        self.replies: asyncio.Queue[bytes] = asyncio.Queue()

    async def open(self, frame: bytes) -> bytes:
        return wire.encode_text(Kind.OPEN, SID, 0, json.dumps(self.info))

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)

    async def recv(self) -> bytes:
        return await self.replies.get()

    async def close(self, bye: bytes | None) -> None:
        pass


def _link_state(info: dict) -> LinkState:
    return LinkState(token_bytes=H * 4, beta_up=1e9, beta_down=1e9, mu=float(info["mu"]), g=tuple(info["g"]))


async def test_status_updates_mu_and_g_and_the_plan_follows() -> None:
    t = FakeTransport({"hidden_size": H, "num_layers": 4, "m": 2, "mu": 1.0, "g": [0.0, 0.001]})
    link = FrameSession(t, LinkOptions(name="hat", round_timeout=5), H)  # type: ignore[arg-type]
    await link.open(4, 2, "tiny")
    c = DraftLengthController(mode="eq7", max_len=8)
    c.step, c.head_row, c.rtt = 0.002, 0.0, 0.0
    c.pooled.prior_accepted, c.pooled.prior_rejections = 9.0, 1.0  # alpha 0.9
    before = c.plan(_link_state(link.info))

    seq = link.send_tensor(Kind.DRAFT, torch.zeros(3, H), 10)
    # The worker got busy: a fixed 200 ms per pass and 5 ms per token. STATUS first, then the reply.
    t.replies.put_nowait(wire.encode_status(SID, seq, 40.0, (0.005, 0.2), sessions=3))
    t.replies.put_nowait(wire.encode_tensor(Kind.VERIFY_RESULT, SID, seq, torch.zeros(3, H), arg=10))
    frame = await link.reply(seq, Kind.VERIFY_RESULT)
    assert frame.kind == Kind.VERIFY_RESULT and frame.seq == seq and not link.early  # STATUS answered nothing
    assert link.info["mu"] == 40.0 and link.info["g"] == [0.005, 0.2] and link.info["sessions"] == 3
    assert link.status_updates == 1
    after = c.plan(_link_state(link.info))
    assert after > before  # a dear verification: draft longer per round

    # A STATUS with a bad value is a bad frame from the worker: the round fails like any malformed reply.
    seq = link.send_tensor(Kind.DRAFT, torch.zeros(1, H), 13)
    bad = bytearray(wire.encode_status(SID, seq, 1.0, (0.0, 0.0)))
    bad[wire.HEADER_SIZE + 4 : wire.HEADER_SIZE + 12] = b"\xff" * 8  # mu = NaN
    t.replies.put_nowait(bytes(bad))
    with pytest.raises(BackendError, match="bad frame"):
        await link.reply(seq, Kind.VERIFY_RESULT)
