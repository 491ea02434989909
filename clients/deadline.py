"""A time limit on each await of a stream: moved at every step, almost never reached.

Why not `asyncio.timeout` around each await: every use builds a Timeout, looks up the current task, pushes a timer
handle onto the event loop's heap and cancels it again on the way out. On the relay's hot path that happens for every
token, twice (the upstream's read and the stall check), and a profile of `tandem bench gateway`'s 32 unpaced streams
put it first among the gateway's own costs per relayed chunk (BENCHMARKS.md, gateway overhead).

A `Deadline` is armed by storing a float. Its one timer handle is re-armed only when it fires before the current
deadline — once per `seconds` of streaming rather than once per token — and only when the deadline has really
passed does it cancel the waiting task. The semantics are asyncio.timeout's: the await inside `with deadline:`
raises TimeoutError; any other cancellation of the task passes through unchanged.
"""

from __future__ import annotations

import asyncio


class Deadline:
    """`with deadline: await ...` fails with TimeoutError after `seconds` without the await completing.

    None: no limit. One task at a time may be inside it (a stream is read by one task at a time)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0
        self._armed = False
        self._fired = False
        self._cancelling = 0

    def __enter__(self) -> Deadline:
        if self.seconds is None:
            return self
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task(self._loop)
        self._at = self._loop.time() + self.seconds
        self._armed = True
        if self._handle is None:
            self._handle = self._loop.call_at(self._at, self._fire)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._armed = False
        if self._fired:
            self._fired = False
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _fire(self) -> None:
        self._handle = None
        if not self._armed:
            return  # between two awaits: the next `with` arms a new handle
        if self._loop.time() < self._at:
            self._handle = self._loop.call_at(self._at, self._fire)
            return
        self._fired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()

    def close(self) -> None:
        """Drop the timer handle (the stream is done)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
