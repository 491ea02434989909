"""One device <-> worker session as frames: OPEN, numbered requests, and their replies matched by seq.

The device sends without waiting (prefill chunks are pipelined), so replies may be asked for in any order: a reply
to a frame nobody asked for yet is kept until it is. Every reply is validated (size, kind, hidden size, dtype,
session) before it is used; an ERROR frame from the worker becomes a BackendError with a gateway status. A STATUS
frame (the worker's current mu and g, sent mid-session when they moved) answers nothing: it updates `info` (the
OPEN reply's "mu" and "g", which the device plans with) and the wait goes on.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import torch

from clients.base import BackendError
from clients.hat import wire
from clients.hat.noise import add_noise, noise_generator
from clients.hat.transport import LinkOptions, Transport

PROTOCOL = 1
_NO_SESSION = b"\0" * 16
_REPLY_KINDS = frozenset(
    {wire.Kind.OPEN, wire.Kind.DEEP_STATE, wire.Kind.VERIFY_RESULT, wire.Kind.ERROR, wire.Kind.STATUS}
)


class FrameSession:
    """Frames of one generation over `transport`. Used on the event loop only."""

    def __init__(self, transport: Transport, opts: LinkOptions, hidden_size: int) -> None:
        self.t = transport
        self.opts = opts
        self.hidden_size = hidden_size
        self.sid = _NO_SESSION
        self.seq = 0
        self.early: dict[int, wire.Frame] = {}
        self.info: dict[str, Any] = {}
        # Noise on every hidden-state frame this session sends (prefill chunks and drafts), from its own generator.
        self.noise_gen = noise_generator(opts.noise_seed) if opts.noise > 0 else None
        self.status_updates = 0  # STATUS frames applied to `info`

    async def open(self, num_layers: int, m: int, model: str) -> dict[str, Any]:
        """Open the session (structural facts only: no prompt, no text); the worker's session info."""
        name = self.opts.name
        params = {
            "protocol": PROTOCOL,
            "hidden_size": self.hidden_size,
            "num_layers": num_layers,
            "m": m,
            "dtype": wire.dtype_name(self.opts.wire_dtype),
            "model": model,
        }
        reply = await asyncio.wait_for(
            self.t.open(wire.encode_text(wire.Kind.OPEN, _NO_SESSION, 0, json.dumps(params))),
            self.opts.connect_timeout + 5,
        )
        frame = self._decode(reply)
        if frame.kind != wire.Kind.OPEN:
            raise BackendError(f"{name}: worker answered OPEN with {frame.kind.name}", 502, name)
        info = json.loads(frame.text())
        for key in ("hidden_size", "num_layers", "m"):
            if info.get(key) != params[key]:
                raise BackendError(f"{name}: worker's {key} {info.get(key)} != device's {params[key]}", 502, name)
        self.sid = frame.session
        self.info = info
        return info

    async def close(self) -> None:
        """Say CLOSE (if the session opened) and shut the transport."""
        bye = None if self.sid == _NO_SESSION else wire.encode_control(wire.Kind.CLOSE, self.sid, self.seq + 1)
        await self.t.close(bye)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send_tensor(self, kind: wire.Kind, tensor: torch.Tensor, arg: int) -> int:
        seq = self.next_seq()
        if self.noise_gen is not None:
            tensor = add_noise(tensor, self.opts.noise, self.noise_gen)
        self.t.send(wire.encode_tensor(kind, self.sid, seq, tensor, arg=arg, wire_dtype=self.opts.wire_dtype))
        return seq

    def send_indices(self, kind: wire.Kind, indices: list[int], arg: int) -> int:
        """A TREE (parent indices) or KEEP (kept node indices) frame: structure, never tokens."""
        seq = self.next_seq()
        self.t.send(wire.encode_indices(kind, self.sid, seq, indices, arg=arg))
        return seq

    def send_control(self, kind: wire.Kind, arg: int = 0) -> int:
        seq = self.next_seq()
        self.t.send(wire.encode_control(kind, self.sid, seq, arg=arg))
        return seq

    def _decode(self, data: bytes) -> wire.Frame:
        try:
            frame = wire.decode_frame(
                data,
                max_frame_bytes=self.opts.max_frame_bytes,
                hidden_size=self.hidden_size,
                expected_dtype=self.opts.wire_dtype,
                expected_kinds=_REPLY_KINDS,
            )
        except wire.FrameError as e:
            raise BackendError(f"{self.opts.name}: bad frame from the worker: {e}", 502, self.opts.name) from None
        if frame.kind == wire.Kind.ERROR:
            raise _worker_error(self.opts.name, frame)
        return frame

    def apply_status(self, status: wire.WorkerStatus) -> None:
        """The worker's current mu and g replace the ones it sent at OPEN (or in an earlier STATUS)."""
        self.info["mu"] = status.mu
        self.info["g"] = [status.g_slope, status.g_intercept]
        self.info["sessions"] = status.sessions
        self.status_updates += 1

    async def reply(self, seq: int, kind: wire.Kind) -> wire.Frame:
        """The reply to frame `seq` (replies to other frames are kept until asked for)."""
        name, timeout = self.opts.name, self.opts.round_timeout
        while seq not in self.early:
            try:
                data = await asyncio.wait_for(self.t.recv(), timeout)
            except TimeoutError:
                raise BackendError(f"{name}: no reply from the worker within {timeout:g} s", 504, name) from None
            frame = self._decode(data)
            if frame.session != self.sid:
                raise BackendError(f"{name}: reply for another session", 502, name)
            if frame.kind == wire.Kind.STATUS:
                self.apply_status(frame.status())
                continue
            self.early[frame.seq] = frame
        frame = self.early.pop(seq)
        if frame.kind != kind:
            raise BackendError(f"{name}: expected {kind.name} for frame {seq}, got {frame.kind.name}", 502, name)
        return frame


def _worker_error(name: str, frame: wire.Frame) -> BackendError:
    try:
        text = frame.text()
    except wire.FrameError:
        text = "(unreadable message)"
    status = frame.arg
    if status == 413 and text.startswith("context"):
        mapped = 400  # the prompt does not fit the worker's context: the request's fault
    else:
        mapped = {503: 503, 408: 504}.get(status, 502)
    return BackendError(f"{name}: worker error {status}: {text}", mapped, name)
