"""Where the worker's middle layers compute: the torch device a setting names, a stage's torch threads, the rows a
batched pass is padded to, and the wait for a device's queued kernels (a timing must cover the compute itself).
Shared by the worker's app factory (app/worker/server.py), the engine, stage 0's pipeline and the remote stages, none
of which imports another for it."""

from __future__ import annotations

import torch

from app.worker.settings import WorkerSettings

# Every batched pass over the middle layers packs at least this many rows (BLAS's blocked path: faster for 2-3 rows,
# and the same kernels whatever the batch). Stage 0 sends it to the other stages, so every stage pads alike.
MIN_ROWS = 4


def compute_device(setting: str) -> torch.device:
    """`[worker] device`: "auto" = the first CUDA GPU if torch sees one, else the CPU."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("worker.device is cuda but torch sees no CUDA device")
    return torch.device(setting)


def stage_threads(settings: WorkerSettings, rank: int) -> int | None:
    """Torch intra-op threads of stage `rank`: its `stage_threads` entry, else `num_threads` (None: torch's default)."""
    if settings.stage_threads:
        return int(settings.stage_threads[rank])
    return settings.num_threads


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on `device` (CUDA runs them asynchronously; the CPU has none queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
