"""clients/deadline.py: asyncio.timeout's semantics for each await of a stream, with one timer handle per period."""

from __future__ import annotations

import asyncio

import pytest

from clients.deadline import Deadline


async def test_an_await_that_outlasts_the_deadline_raises_timeout_error() -> None:
    deadline = Deadline(0.05)
    with pytest.raises(TimeoutError):
        with deadline:
            await asyncio.sleep(1)
    assert not asyncio.current_task().cancelling()  # the cancel it used is taken back
    await asyncio.sleep(0)  # and no stray cancellation is left for the next await


async def test_each_await_gets_the_whole_limit_and_one_timer_serves_many() -> None:
    loop = asyncio.get_running_loop()
    armed = []
    real = loop.call_at

    def counting(when, callback, *args, **kw):
        if getattr(callback, "__self__", None) is deadline:
            armed.append(when)
        return real(when, callback, *args, **kw)

    limit = 0.5  # far above one await's time even on a loaded box, so no await times out
    deadline = Deadline(limit)
    awaits = 0
    loop.call_at = counting
    try:
        t0 = loop.time()
        while loop.time() - t0 < 3 * limit:  # longer than the limit in all, each await well within it
            with deadline:
                await asyncio.sleep(0.01)
            awaits += 1
        elapsed = loop.time() - t0
        deadline.close()
    finally:
        del loop.call_at
    # About one timer per limit's worth of streaming, not one per await (~150 on an idle box, fewer on a loaded one).
    assert 1 <= len(armed) <= elapsed / limit + 2
    assert awaits > 2 * len(armed)


async def test_another_cancellation_passes_through_unchanged() -> None:
    deadline = Deadline(10)

    async def waiter() -> None:
        with deadline:
            await asyncio.sleep(10)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline.close()


async def test_no_limit() -> None:
    """None: no timer is ever armed, so no await is cut, and nothing is left to cancel."""
    loop = asyncio.get_running_loop()
    armed = []
    real = loop.call_at

    def counting(when, callback, *args, **kw):
        if getattr(callback, "__self__", None) is deadline:
            armed.append(when)
        return real(when, callback, *args, **kw)

    deadline = Deadline(None)
    loop.call_at = counting
    try:
        for _ in range(3):
            with deadline:
                assert await asyncio.sleep(0.01, result="done") == "done"
        deadline.close()
    finally:
        del loop.call_at
    assert armed == []
    assert not asyncio.current_task().cancelling()
