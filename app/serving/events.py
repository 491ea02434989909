"""The gateway's one event bus: what the serving core decides, as it decides it (GET /v1/events, the dashboard, the
OpenTelemetry spans).

Publishers (the orchestrator, the ledger's change listener, a HAT backend's session hook) call `publish`; it never
waits and never fails for a viewer. Two kinds of reader:

- listeners (`listen`): called synchronously in publish, in order (app/serving/telemetry.py turns events into
  spans). A listener that raises is logged and kept; it must be cheap.
- viewers (`subscribe`): each has its own bounded queue. A viewer that reads too slowly is never waited for: once
  its queue is full, further events are dropped *for that viewer only*, counted, and the next event it reads is a
  `dropped` event saying how many and from which id, so it knows to reload what it shows.

Every event gets an increasing id; the bus keeps the last `history` events, so a viewer that reconnects with
`Last-Event-ID` resumes after that id when it is still held (else it is told with a `dropped` event too).

Events are plain JSON-able dicts: {"id", "type", "time" (Unix seconds), ...fields}. No event carries prompt or answer
text. Types (docs/dashboard.md lists each one's fields): request.planned, request.finished, request.failed,
endpoint.started, endpoint.won, endpoint.lost, endpoint.failed, endpoint.finished, migration.started,
migration.completed, migration.failed, budget.changed, hat.session.opened, hat.session.closed.

What a viewer costs serving: publish appends to its queue and sets its wake-up, nothing more. The viewer's task then
waits `coalesce` seconds before it takes its queue, so each viewer writes at most a few batches a second however
busy the gateway is, and each event is rendered once for all viewers (`rendered`).

Threads: publish may be called from any thread (a backend's model thread); the bookkeeping takes a lock, and a
viewer's wake-up goes through its loop's call_soon_threadsafe when the caller is on another thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

log = logging.getLogger(__name__)

Event = dict
Listener = Callable[[Event], None]


class Viewer:
    """One reader of the bus: its bounded queue, what it lost, the loop that reads it."""

    def __init__(self, bus: EventBus, capacity: int):
        self.bus = bus
        self.capacity = capacity
        self.queue: deque[Event] = deque()
        self.dropped = 0
        self.first_dropped: int | None = None
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()

    def offer(self, event: Event) -> None:
        """Called under the bus's lock."""
        if len(self.queue) >= self.capacity:
            if not self.dropped:
                self.first_dropped = event["id"]
            self.dropped += 1
            self.bus.dropped_total += 1
            return
        self.queue.append(event)
        if self.loop is _running_loop():
            self.wake.set()
        else:
            self.loop.call_soon_threadsafe(self.wake.set)

    def take(self) -> list[Event]:
        """What is queued, preceded by a `dropped` event when some were lost since the last take."""
        with self.bus.lock:
            events = list(self.queue)
            self.queue.clear()
            if self.dropped:
                events.insert(0, self.bus.notice(self.dropped, self.first_dropped))
                self.dropped, self.first_dropped = 0, None
            self.wake.clear()
        return events

    async def events(self, keepalive: float | None = None) -> AsyncIterator[list[Event]]:
        """Batches of events as they come (each at most `coalesce` seconds late); an empty batch when `keepalive`
        seconds passed without any."""
        try:
            while True:
                if not self.queue and not self.dropped:
                    try:
                        await asyncio.wait_for(self.wake.wait(), keepalive)
                    except TimeoutError:
                        yield []
                        continue
                    if self.bus.coalesce:
                        await asyncio.sleep(self.bus.coalesce)  # what else comes meanwhile goes in the same batch
                batch = self.take()
                if batch:
                    yield batch
        finally:
            self.bus.unsubscribe(self)


class EventBus:
    def __init__(self, history: int = 1024, viewer_capacity: int = 256, coalesce: float = 0.0):
        self.history: deque[Event] = deque(maxlen=history)
        self.coalesce = coalesce
        self._rendered: dict[int, bytes] = {}
        self.viewer_capacity = viewer_capacity
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._viewers: list[Viewer] = []
        self._listeners: list[Listener] = []
        self.dropped_total = 0  # events not delivered to some viewer, all viewers together

    # -- publishing ------------------------------------------------------------------------------------------------
    def publish(self, kind: str, **fields) -> Event:
        event = {"id": 0, "type": kind, "time": time.time(), **fields}
        with self.lock:
            event["id"] = next(self._ids)
            self.history.append(event)
            for viewer in self._viewers:
                viewer.offer(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", kind)
        return event

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    # -- viewers ---------------------------------------------------------------------------------------------------
    @property
    def viewers(self) -> int:
        return len(self._viewers)

    def subscribe(self, last_id: int | None = None) -> Viewer:
        """A new viewer (on the running loop). With `last_id` (a reconnect's Last-Event-ID), the held events after it
        are queued first; when some after it are no longer held, a `dropped` event says so."""
        viewer = Viewer(self, self.viewer_capacity)
        with self.lock:
            if last_id is not None:
                held = [e for e in self.history if e["id"] > last_id][-viewer.capacity :]
                next_id = self.history[-1]["id"] + 1 if self.history else 1
                first = held[0]["id"] if held else next_id
                if last_id < next_id and first > last_id + 1:
                    viewer.dropped, viewer.first_dropped = first - last_id - 1, last_id + 1
                viewer.queue.extend(held)
            self._viewers.append(viewer)
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        with self.lock:
            if viewer in self._viewers:
                self._viewers.remove(viewer)

    def rendered(self, event: Event, render: Callable[[Event], bytes]) -> bytes:
        """`render(event)`, computed once for every viewer (on the event loop, as the viewers are)."""
        key = event["id"]
        if key is None:
            return render(event)
        data = self._rendered.get(key)
        if data is None:
            data = self._rendered[key] = render(event)
            while len(self._rendered) > (self.history.maxlen or 0):
                del self._rendered[next(iter(self._rendered))]
        return data

    def notice(self, count: int, first_id: int | None) -> Event:
        """The event that tells a viewer it missed `count` events from `first_id` on (not in the history)."""
        return {"id": None, "type": "dropped", "time": time.time(), "count": count, "from_id": first_id}


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
