"""A worker announcing itself in the shared store, for the pools of device halves that read it
(clients/hat/registry.py; `[worker] registry_url`).

Every `heartbeat_seconds` the worker writes a hash `<prefix>worker:<id>`: the endpoint devices should use, its
model and layer span, its free sessions and context, its μ and g (what a device's placement predicts delay from,
clients/hat/pool.py), with a TTL of three heartbeats, and keeps its id in the set `<prefix>workers`. A worker that
stops heartbeating (dead, hung, cut off from the store) leaves every pool once its hash expires; one that stops
cleanly removes itself at once. A store that cannot be reached is logged once and retried at the next beat: the
worker serves on regardless.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

TTL_BEATS = 3


class Heartbeat:
    def __init__(self, url: str, prefix: str, endpoint: str, every: float) -> None:
        self.endpoint = endpoint
        self.every = every
        self.id = uuid.uuid4().hex[:12]
        self.key = f"{prefix}worker:{self.id}"
        self.members = f"{prefix}workers"
        timeout = min(every, 1.0)
        self._redis = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self._task: asyncio.Task | None = None
        self._failing = False
        self._stopped = False

    def start(self, info: Callable[[], dict[str, Any]]) -> None:
        self._task = asyncio.create_task(self._beat(info))

    async def _beat(self, info: Callable[[], dict[str, Any]]) -> None:
        while True:
            try:
                fields = self.fields(info())
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.hset(self.key, mapping=fields)
                    pipe.pexpire(self.key, int(TTL_BEATS * self.every * 1000))
                    pipe.sadd(self.members, self.id)
                    await pipe.execute()
                if self._failing:
                    log.info("worker registry reachable again: announcing %s", self.endpoint)
                self._failing = False
            except (RedisError, OSError) as exc:
                if not self._failing:
                    log.warning("worker registry unreachable (%s): serving on, retrying every beat", exc)
                self._failing = True
            await asyncio.sleep(self.every)

    def fields(self, info: dict[str, Any]) -> dict[str, str]:
        return {
            "url": self.endpoint,
            "model": str(info["model"]),
            "m": str(info["m"]),
            "layers": f"{info['m']}..{info['num_layers'] - 1}",
            "sessions": str(info["sessions"]),
            "max_sessions": str(info["max_sessions"]),
            "max_context": str(info["max_context"]),
            "mu": str(info["mu"]),
            "g": json.dumps(info["g"]),
        }

    def halt(self) -> None:
        """Stop beating without a goodbye, as a dead worker does (the pools notice when the TTL runs out)."""
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        """Stop beating and leave the registry at once (idempotent: a drain stops it before the shutdown does)."""
        if self._stopped:
            return
        self._stopped = True
        self.halt()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError, OSError):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)
                pipe.srem(self.members, self.id)
                await pipe.execute()
        await self._redis.aclose()
