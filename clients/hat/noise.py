"""A measured privacy defence: Gaussian noise on the hidden states the device sends (HATOptions.noise).

The worker sees the input submodel's output for every prompt and draft position, and a worker operator can
invert it back to tokens (`tandem bench privacy` measures how well). Adding noise to what goes on the wire makes
that harder at a cost in quality: the worker computes on noised states, so the deep states it returns (and the
device's verified tokens) change — greedy exactness with the unsplit model no longer holds for noise > 0.

Per hidden vector h (one position), the device sends h + level * rms(h) * z with z ~ N(0, I) and
rms(h) = ||h|| / sqrt(hidden): `level` is the noise's standard deviation relative to the vector's own RMS. The
device's own caches keep the clean states; only the copy on the wire is noised. Level 0 sends the states
untouched (byte for byte what the device sent before this option existed).
"""

from __future__ import annotations

import secrets

import torch


def noise_generator(seed: int | None = None) -> torch.Generator:
    """A generator for one session's noise: seeded with `seed` (tests, benchmarks) or from the OS (default).

    A fixed seed gives every session the same noise sequence, which lets a worker subtract it out by comparing
    sessions: use one only to make measurements reproducible."""
    gen = torch.Generator()
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    return gen


def add_noise(hidden: torch.Tensor, level: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """`hidden` [..., hidden_size] plus Gaussian noise of std `level` x each vector's RMS (a new tensor);
    `hidden` itself when level is 0."""
    if level < 0:
        raise ValueError(f"noise level must be >= 0, got {level}")
    if level == 0:
        return hidden
    h = hidden.float()
    rms = h.pow(2).mean(dim=-1, keepdim=True).sqrt()
    z = torch.randn(h.shape, generator=generator, dtype=torch.float32)
    return (h + level * rms * z).to(hidden.dtype)
