"""Loopback link emulator for the HAT device half: one-way latency, jitter and bandwidth, per direction.

Why in-process: this kernel has no netem, and the question HAT answers ("when does shipping hidden states beat
running the model locally") depends on the link. The device half pushes every frame it sends through an uplink
`DelayLine` and every frame it receives through a downlink one, so a worker on loopback behaves like one across
a WiFi link of the given shape.

Model of one direction (a FIFO serial link, like a bottleneck router queue):

    start    = max(now, when the link finished the previous message)
    finished = start + bytes / bandwidth                   (serialisation; messages queue behind each other)
    arrival  = max(finished + latency + jitter, previous arrival)     (propagation; order is preserved)

Jitter is uniform in [-jitter, +jitter] and never makes the delay negative. Bandwidth None = unlimited. All
scheduling is in `DelayLine.schedule` (pure, clock passed in), so it is unit-testable without sleeping.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_UNITS = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024.0, "mib": 1024.0**2, "gib": 1024.0**3}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True)
class LinkProfile:
    """Shape of the device <-> worker link. Bandwidths in bytes/s (None = unlimited); times in seconds."""

    latency: float = 0.0  # one-way
    jitter: float = 0.0
    up_bandwidth: float | None = None  # device -> worker
    down_bandwidth: float | None = None  # worker -> device
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.latency < 0 or self.jitter < 0:
            raise ValueError("latency and jitter must be >= 0")
        for bw in (self.up_bandwidth, self.down_bandwidth):
            if bw is not None and bw <= 0:
                raise ValueError("bandwidths must be positive (or None for unlimited)")

    @classmethod
    def parse(cls, spec: str) -> LinkProfile:
        """From e.g. "latency=20ms,jitter=2ms,up=10MB/s,down=15MB/s" (units: s/ms/us; B, kB, MB, GB, KiB, MiB)."""
        fields: dict[str, float | int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            key, value = key.strip().lower(), value.strip().lower()
            if key in ("latency", "jitter"):
                m = re.fullmatch(r"([0-9.]+)\s*(s|ms|us)?", value)
                if not m:
                    raise ValueError(f"bad {key} {value!r}; use e.g. 20ms")
                fields[key] = float(m.group(1)) * _TIME[m.group(2) or "s"]
            elif key in ("up", "down"):
                m = re.fullmatch(r"([0-9.]+)\s*([kmg]i?b|b)?(/s)?", value)
                if not m:
                    raise ValueError(f"bad bandwidth {value!r}; use e.g. 10MB/s")
                fields[f"{key}_bandwidth"] = float(m.group(1)) * _UNITS[m.group(2) or ""]
            elif key == "seed":
                fields["seed"] = int(value)
            else:
                raise ValueError(f"unknown link field {key!r} (latency, jitter, up, down, seed)")
        return cls(**fields)  # type: ignore[arg-type]


class DelayLine(Generic[T]):
    """One direction of an emulated link: `put` never blocks; `get` returns items at their arrival time, in order."""

    def __init__(
        self, bandwidth: float | None = None, latency: float = 0.0, jitter: float = 0.0, seed: int | None = None
    ) -> None:
        self.bandwidth = bandwidth
        self.latency = latency
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._free_at = 0.0
        self._last_arrival = 0.0
        self._items: deque[tuple[float, T]] = deque()
        self._wakeup: asyncio.Event | None = None
        self.bytes = 0
        self.messages = 0

    @property
    def passthrough(self) -> bool:
        return self.bandwidth is None and self.latency == 0 and self.jitter == 0

    def schedule(self, nbytes: int, now: float) -> float:
        """Arrival time of a message of `nbytes` entering the link at `now` (updates the link's state)."""
        start = max(now, self._free_at)
        finished = start + (nbytes / self.bandwidth if self.bandwidth else 0.0)
        self._free_at = finished
        delay = self.latency
        if self.jitter:
            delay = max(0.0, delay + self._rng.uniform(-self.jitter, self.jitter))
        arrival = max(finished + delay, self._last_arrival)
        self._last_arrival = arrival
        self.bytes += nbytes
        self.messages += 1
        return arrival

    def put(self, item: T, nbytes: int) -> float:
        """Enqueue `item` (of `nbytes` on the wire); returns its arrival time on the running loop's clock."""
        arrival = self.schedule(nbytes, asyncio.get_running_loop().time())
        self._items.append((arrival, item))
        if self._wakeup is not None:
            self._wakeup.set()
        return arrival

    async def get(self) -> T:
        """The next item, once it has arrived."""
        loop = asyncio.get_running_loop()
        while True:
            if self._items:
                arrival, item = self._items[0]
                wait = arrival - loop.time()
                if wait <= 0:
                    self._items.popleft()
                    return item
                await asyncio.sleep(wait)
                continue
            self._wakeup = self._wakeup or asyncio.Event()
            self._wakeup.clear()
            await self._wakeup.wait()

    def __len__(self) -> int:
        return len(self._items)


class Link:
    """Both directions of one device <-> worker connection."""

    def __init__(self, profile: LinkProfile | None = None) -> None:
        p = profile or LinkProfile()
        seed_down = None if p.seed is None else p.seed + 1
        self.profile = p
        self.up: DelayLine[bytes] = DelayLine(p.up_bandwidth, p.latency, p.jitter, p.seed)
        self.down: DelayLine[bytes] = DelayLine(p.down_bandwidth, p.latency, p.jitter, seed_down)
