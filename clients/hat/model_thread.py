"""The one thread a HAT backend's model runs on, and how long it has been busy.

Every torch call of a device half goes through it: the drafting station's batched units and the solo path's calls
alike. One thread, because the draft caches are not thread-safe and torch calls from several threads would only
contend for the same cores; the event loop schedules, this thread computes. `busy_seconds` sums the time its calls
took (the device's busy time, whatever the calls are), which `tandem bench hat-streams` reports per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from clients.base import BackendError


class ModelThread:
    """Runs functions on one worker thread; started by `start`, ended by `close` (a call after that is a 503)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_seconds = 0.0
        self._executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hat-{self.name}")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the model thread."""
        if self._executor is None:
            raise BackendError(f"{self.name}: backend closed", status=503, backend=self.name)

        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.busy_seconds += time.perf_counter() - t0

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    async def close(self) -> None:
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.to_thread(executor.shutdown, True)
