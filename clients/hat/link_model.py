"""What the device half knows of its link to the worker and of the worker's compute, and what it derives from it.

Bandwidths start from the options (HAT's devices measure them, e.g. with iperf3), a LinkProfile's emulated ones or
a profile's measured ones; the upload estimate is then refined from large prefill chunks' round trips minus the
worker's predicted compute. The worker's mu (tokens per pass) and g(x) = slope*x + intercept come with its OPEN
reply and, when they move, in STATUS frames (a session's `info`). From both: Eq. 7's round-time inputs (LinkState,
policies/drafting.py) and Eq. 6's window for parallel drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.drafting import LinkState
from policies.estimate import MovingAverage

UNKNOWN_UP, UNKNOWN_DOWN = 10e6, 15e6  # bytes/s assumed for an estimate that has no value


@dataclass
class LinkModel:
    up: MovingAverage  # upload bandwidth, bytes/s
    down: MovingAverage  # download bandwidth, bytes/s
    state_bytes: int = 0  # one hidden state on the wire (hidden size x the wire dtype's size), set at load
    latency: float = 0.0  # one-way, seconds: an emulated link's, else a profile's measured round trip / 2

    @property
    def beta_up(self) -> float:
        return self.up.get(UNKNOWN_UP)

    @property
    def beta_down(self) -> float:
        return self.down.get(UNKNOWN_DOWN)

    @staticmethod
    def worker_seconds(info: dict[str, Any], positions: int) -> float:
        """The worker's predicted compute g(mu + positions) for a pass adding `positions` rows."""
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        return max(0.0, slope * (float(info.get("mu", 0.0)) + positions) + intercept)

    def state(self, info: dict[str, Any]) -> LinkState:
        """The round-time model's outside inputs: bandwidth estimates and the worker's latest mu and g."""
        slope, intercept = (float(x) for x in info.get("g", (0.0, 0.0)))
        return LinkState(
            token_bytes=self.state_bytes,
            beta_up=self.beta_up,
            beta_down=self.beta_down,
            mu=float(info.get("mu", 0.0)),
            g=(slope, intercept),
        )

    def reply_window(self, k: int, info: dict[str, Any]) -> tuple[float, float]:
        """(g, window) of a round of k drafts: the worker's predicted compute g(mu + k+1) for its k+1 positions, and
        the seconds until their deep states are expected back, (k+1)A/beta_up + g + (k+1)A/beta_down (Eq. 6's
        numerator)."""
        g = self.worker_seconds(info, k + 1)
        transfer = (k + 1) * self.state_bytes * (1 / self.beta_up + 1 / self.beta_down)
        return g, transfer + g

    def round_trip_seconds(self, positions: int) -> float:
        """The link's share of a round trip of `positions` rows up and their deep states down: two latencies and both
        transfers at the current estimates (with an emulated link, what the emulator adds, jitter aside)."""
        return 2 * self.latency + positions * self.state_bytes * (1 / self.beta_up + 1 / self.beta_down)

    def observe_upload(self, tokens: int, rtt: float, info: dict[str, Any]) -> None:
        """Refine the upload bandwidth from a chunk's round trip minus the worker's predicted compute."""
        nbytes = tokens * self.state_bytes
        if nbytes < 64 * 1024:
            return  # small frames measure latency, not bandwidth
        transfer = rtt - self.worker_seconds(info, tokens)
        if transfer > 1e-4:
            self.up.update(nbytes / transfer)
