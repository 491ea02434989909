"""The lifespan the gateway and the worker share: serve at once, load in the background.

Models take seconds to minutes to load; the server listens from the first moment, so `/health` answers and
`/health/ready` says 503 until `start` has finished. Shutting down cancels a start still under way and then
always runs `stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI


def starting_in_background(
    start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(start())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await stop()

    return lifespan
