"""The worker engine's counters and HAT's state monitoring (Eqs. 1-2), shared by the engine thread, which writes
them, the scheduler, which counts its plans in them, and the metrics view (app/worker/server.py), which reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.drafting import DelayPredictor
from policies.estimate import MovingAverage


@dataclass
class EngineStats:
    """Counters and HAT state monitoring (Eqs. 1-2). Written on the engine thread, read anywhere."""

    mu: MovingAverage = field(default_factory=MovingAverage)  # batched tokens per forward
    eta: MovingAverage = field(default_factory=MovingAverage)  # compute delay per forward (s)
    g: DelayPredictor = field(default_factory=DelayPredictor)  # predicted delay of a batch of x tokens
    forwards: int = 0
    batched_forwards: int = 0  # forwards that carried >= 2 sessions
    max_rows: int = 0
    last_rows: int = 0
    tokens: int = 0
    frames: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    sessions_opened: int = 0
    sessions_expired: int = 0
    # Planned batching (policies/worker_batching.py)
    planned_passes: int = 0  # passes chosen by the planner
    planned_groups: int = 0  # groups in those plans (1 = everything pending ran together)
    deferred_frames: int = 0  # times a pending frame was left for a later pass
    forced_frames: int = 0  # times a frame went in because it had been left out max_defer times
    split_frames: int = 0  # prefill frames split into sub-chunks
    subchunk_passes: int = 0  # sub-chunks run (pieces of split frames)
    subchunk_budget: int = 0  # the current sub-chunk size from g (tokens)
    fair_quantum: float = 0.0  # the fair share's quantum: seconds of work a session may add to a pass
    status_frames: int = 0  # STATUS frames sent mid-session (mu and g moved since the device was told)
    stage_seconds: list[float] = field(default_factory=list)  # staged worker: compute seconds so far, per stage
