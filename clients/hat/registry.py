"""The workers a shared store lists (app/worker/registry.py announces them), read by a device half's pool
(clients/hat/pool.py; `worker_registry`): each live worker's endpoint and what its placement predicts delay from.
Only workers splitting at the device's m are listed (one of another model fails its OPEN, and its breaker keeps it
out); an announcement whose TTL ran out is gone (its id is dropped from the set on the way)."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis


class WorkerRegistry:
    def __init__(self, url: str, prefix: str, timeout: float = 1.0) -> None:
        self.members = f"{prefix}workers"
        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    async def workers(self, m: int) -> dict[str, dict[str, Any]]:
        """url -> the worker's info (model, m, sessions, max_sessions, max_context, mu, g) for every live worker
        that keeps m layers on the device. Raises the client's error when the store cannot be reached."""
        ids = sorted(await self._redis.smembers(self.members))
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hgetall(f"{self.prefix}worker:{worker_id}")
            entries = await pipe.execute()
        gone = [worker_id for worker_id, entry in zip(ids, entries, strict=True) if not entry]
        if gone:
            await self._redis.srem(self.members, *gone)
        live = {}
        for entry in entries:
            if not entry or int(entry.get("m", -1)) != m:
                continue
            live[entry["url"]] = {
                "model": entry["model"],
                "m": int(entry["m"]),
                "sessions": int(entry["sessions"]),
                "max_sessions": int(entry["max_sessions"]),
                "max_context": int(entry["max_context"]),
                "mu": float(entry["mu"]),
                "g": json.loads(entry["g"]),
            }
        return live

    async def close(self) -> None:
        await self._redis.aclose()
