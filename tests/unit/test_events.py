"""The event bus (app/serving/events.py): viewers' bounded queues, drops told and counted, Last-Event-ID resumes,
listeners, and publishing from another thread."""

from __future__ import annotations

import asyncio
import threading

from app.serving.events import EventBus


async def _next(viewer, wait: float = 1.0) -> list[dict]:
    """The next batch of a viewer's one stream (the stream owns the subscription: closing it unsubscribes)."""
    if not hasattr(viewer, "stream"):
        viewer.stream = viewer.events()
    return await asyncio.wait_for(anext(viewer.stream), wait)


async def test_a_viewer_gets_every_event_in_order():
    bus = EventBus()
    viewer = bus.subscribe()
    for i in range(3):
        bus.publish("request.planned", request_id=f"r{i}")
    batch = await _next(viewer)
    assert [(e["id"], e["type"], e["request_id"]) for e in batch] == [
        (1, "request.planned", "r0"),
        (2, "request.planned", "r1"),
        (3, "request.planned", "r2"),
    ]


async def test_a_slow_viewer_loses_events_alone_and_is_told_how_many():
    bus = EventBus(viewer_capacity=4)
    slow, fast = bus.subscribe(), bus.subscribe()
    fast_seen = []
    for i in range(10):
        bus.publish("endpoint.started", n=i)
        fast_seen += await _next(fast)  # the fast viewer reads as they come
    assert [e["n"] for e in fast_seen] == list(range(10))
    batch = await _next(slow)
    assert batch[0]["type"] == "dropped" and batch[0]["count"] == 6 and batch[0]["from_id"] == 5
    assert [e["n"] for e in batch[1:]] == [0, 1, 2, 3]
    assert bus.dropped_total == 6
    bus.publish("endpoint.started", n=10)  # after the notice, it is live again
    assert [e["n"] for e in await _next(slow)] == [10]


async def test_last_event_id_resumes_within_the_history_and_says_what_is_gone():
    bus = EventBus(history=5)
    for i in range(8):
        bus.publish("budget.changed", n=i)  # ids 1..8; ids 4..8 held
    resumed = await _next(bus.subscribe(last_id=5))
    assert [e["id"] for e in resumed] == [6, 7, 8]
    too_old = await _next(bus.subscribe(last_id=1))
    assert too_old[0]["type"] == "dropped" and (too_old[0]["count"], too_old[0]["from_id"]) == (2, 2)
    assert [e["id"] for e in too_old[1:]] == [4, 5, 6, 7, 8]
    up_to_date = bus.subscribe(last_id=8)
    assert not up_to_date.queue and not up_to_date.dropped


async def test_an_unsubscribed_viewer_is_forgotten_and_costs_publish_nothing():
    bus = EventBus()
    viewer = bus.subscribe()
    stream = viewer.events()
    bus.publish("x")
    await asyncio.wait_for(anext(stream), 1)
    await stream.aclose()
    assert bus.viewers == 0
    bus.publish("y")
    assert not viewer.queue


async def test_listeners_run_in_publish_and_one_that_raises_does_not_stop_the_others():
    bus = EventBus()
    seen = []

    def broken(event):
        raise RuntimeError("boom")

    bus.listen(broken)
    bus.listen(seen.append)
    event = bus.publish("request.finished", request_id="r")
    assert seen == [event]


async def test_publishing_from_another_thread_wakes_the_viewer():
    bus = EventBus()
    viewer = bus.subscribe()
    threading.Thread(target=bus.publish, args=("hat.session.opened",), kwargs={"session": "s1"}).start()
    batch = await _next(viewer, wait=5)
    assert batch[0]["session"] == "s1"


async def test_keepalive_yields_an_empty_batch_when_nothing_happens():
    bus = EventBus()
    viewer = bus.subscribe()
    assert await asyncio.wait_for(anext(viewer.events(keepalive=0.01)), 1) == []
