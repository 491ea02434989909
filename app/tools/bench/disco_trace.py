"""The workload of `tandem bench disco`: synthetic request traces and traces recorded by the gateway.

Synthetic traces (§5.3: "log-normal fits of prompt length and server TTFT") —
the paper publishes no fitted parameters, so:

* server TTFT, preset per provider from App. C Table 5: the typical TTFT is
  MAE/MAPE of the moving-average predictor (GPT-4o-mini: 0.0995 s / 24.55% =
  0.405 s; DeepSeek 1.424 s; Command 0.228 s; LLaMA-3-70b 0.785 s); the log-space
  σ is the one for which a median predictor of a log-normal has that MAPE:
  MAPE(σ) = e^{σ²/2}·erf(σ/√2) (GPT 0.30, DeepSeek 0.34, Command 0.46, LLaMA 0.49).
  This reproduces the bulk of the measured traces; their rare multi-second
  spikes (§2.3) are not in a log-normal this narrow, which *understates* the
  tail DiSCo protects against.
* prompt length: log-normal, median 48 tokens, σ = 0.6 (p99 ≈ 195). Alpaca
  instructions (the paper's prompts) average ~13 words (~17 tokens), ~40% carry
  an input field of ~20 words, and a chat template adds ~25-30 tokens; the
  spread reflects the optional input. Chosen, not fitted: override with flags.
* answer length: log-normal, median 150 tokens, σ = 0.7, capped at 128 (App. E's
  generation limit), so most answers hit the cap as chat answers to Alpaca
  instructions typically run past 128 tokens.
* device: §5.1's measured prefill/decode speeds (Xiaomi 14 + Qwen1.5-0.5B:
  79.90 / 21.47 tok/s by default): T_d(l) = l/prefill + 1/decode, with 5%
  log-normal jitter (Fig. 2b: device TTFT is stable). Cloud decode 80 tok/s
  (GPT-4o-mini class streaming). Arrivals Poisson, mean interval 30 s (§3).
* costs: Table 8 prices of the preset's provider; the device energy proxy is
  the real Qwen2.5-0.5B architecture (our bundled device model); λ = 0.3 and 5
  USD/PFLOP for the server- and device-constrained regimes (App. E).

Recorded traces are read in the format that `tandem bench disco --trace` documents (app/tools/bench/disco_sim.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policies.estimate import DeviceTTFTLine


def mape_of_lognormal(sigma: float) -> float:
    """MAPE of predicting a log-normal by its median: E|1 − m/X| = e^{σ²/2}·erf(σ/√2)."""
    return math.exp(sigma * sigma / 2) * math.erf(sigma / math.sqrt(2))


def sigma_from_mape(mape: float) -> float:
    """Inverse of `mape_of_lognormal` by bisection (it is increasing in σ)."""
    lo, hi = 0.0, 5.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mape_of_lognormal(mid) < mape else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class ServerPreset:
    """A cloud provider's TTFT log-normal (from App. C Table 5) and its Table 8 prices."""

    name: str
    mae: float  # s, Table 5, moving-average row
    mape: float  # fraction, same row
    prices: str  # key of policies.cost.PRICE_TABLE_USD_PER_MTOK

    @property
    def median(self) -> float:
        return self.mae / self.mape

    @property
    def sigma(self) -> float:
        return sigma_from_mape(self.mape)


SERVER_PRESETS = {
    "gpt": ServerPreset("GPT-4o-mini", 0.0995, 0.2455, "gpt-4o-mini"),
    "deepseek": ServerPreset("DeepSeek-V2.5", 0.3959, 0.2780, "deepseek-v2.5"),
    "command": ServerPreset("Command", 0.0899, 0.3940, "command"),
    "llama": ServerPreset("LLaMA-3-70b (Hyperbolic)", 0.3312, 0.4218, "llama-3.1-70b-hyperbolic"),
}


@dataclass(frozen=True)
class DevicePreset:
    """§5.1's measured device/model pairs: prefill and decode speed (tokens/s)."""

    name: str
    prefill_tps: float
    decode_tps: float


DEVICE_PRESETS = {
    "xiaomi14-qwen0.5b": DevicePreset("Xiaomi 14 + Qwen1.5-0.5B", 79.90, 21.47),
    "pixel7-bloom1.1b": DevicePreset("Pixel 7 Pro + BLOOM-1.1B", 31.32, 13.93),
    "pixel7-bloom560m": DevicePreset("Pixel 7 Pro + BLOOM-560M", 51.80, 20.14),
}


@dataclass
class Trace:
    """Per-request arrays. `device_k`/`device_c` is the device's true TTFT line (for
    migration prefills of prompt + delivered tokens); `device_ratio` each request's
    jitter factor on it; `u` the request's uniform draw (shared by all policies, so
    comparisons are paired)."""

    name: str
    arrival: np.ndarray
    prompt_tokens: np.ndarray
    server_ttft: np.ndarray
    device_ttft: np.ndarray
    output_tokens: np.ndarray
    server_ttft_migration: np.ndarray
    u: np.ndarray
    device_ratio: np.ndarray
    device_k: float
    device_c: float
    description: str = ""

    def __len__(self) -> int:
        return int(self.prompt_tokens.shape[0])

    def device_time(self, r: int, tokens: int) -> float:
        """True device TTFT of request r's jitter for a prompt of `tokens` tokens."""
        return (self.device_k * tokens + self.device_c) * float(self.device_ratio[r])


def synthetic_trace(
    n: int,
    *,
    seed: int = 0,
    server: ServerPreset = SERVER_PRESETS["gpt"],
    device: DevicePreset = DEVICE_PRESETS["xiaomi14-qwen0.5b"],
    prompt_median: float = 48.0,
    prompt_sigma: float = 0.6,
    output_median: float = 150.0,
    output_sigma: float = 0.7,
    max_tokens: int = 128,
    arrival_mean: float = 30.0,
    device_jitter: float = 0.05,
) -> Trace:
    """Log-normal synthetic trace (parameters and their sources in the module docstring)."""
    rng = np.random.default_rng(seed)
    prompt = np.maximum(1, np.rint(rng.lognormal(math.log(prompt_median), prompt_sigma, n))).astype(np.int64)
    ttft = rng.lognormal(math.log(server.median), server.sigma, n)
    ttft2 = rng.lognormal(math.log(server.median), server.sigma, n)
    out = np.clip(np.rint(rng.lognormal(math.log(output_median), output_sigma, n)), 1, max_tokens).astype(np.int64)
    k, c = 1.0 / device.prefill_tps, 1.0 / device.decode_tps
    ratio = rng.lognormal(0.0, device_jitter, n)
    return Trace(
        name=f"synthetic-{server.name}",
        arrival=np.cumsum(rng.exponential(arrival_mean, n)),
        prompt_tokens=prompt,
        server_ttft=ttft,
        device_ttft=(k * prompt + c) * ratio,
        output_tokens=out,
        server_ttft_migration=ttft2,
        u=rng.random(n),
        device_ratio=ratio,
        device_k=k,
        device_c=c,
        description=(
            f"synthetic, n={n}, seed={seed}; prompt lognormal(median {prompt_median:g}, σ {prompt_sigma:g}); "
            f"server TTFT lognormal(median {server.median:.3f} s, σ {server.sigma:.3f}) [{server.name}]; "
            f"device {device.name}: {device.prefill_tps:g}/{device.decode_tps:g} tok/s prefill/decode; "
            f"answers lognormal(median {output_median:g}, σ {output_sigma:g}) capped at {max_tokens}"
        ),
    )


def load_trace(path: Path, *, seed: int = 0, device: DevicePreset = DEVICE_PRESETS["xiaomi14-qwen0.5b"]) -> Trace:
    """Read a JSONL trace recorded by the gateway (format in disco_sim.py, which reads it for `--trace`)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(
                    (
                        float(row.get("arrival", lineno)),
                        int(row["prompt_tokens"]),
                        math.nan if row.get("server_ttft") is None else float(row["server_ttft"]),
                        math.nan if row.get("device_ttft") is None else float(row["device_ttft"]),
                        int(row["output_tokens"]),
                        math.nan if row.get("server_ttft_migration") is None else float(row["server_ttft_migration"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace row ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: empty trace")
    rows.sort(key=lambda r: r[0])
    arr = np.array(rows, dtype=np.float64)
    prompt, out = arr[:, 1].astype(np.int64), np.maximum(1, arr[:, 4].astype(np.int64))
    rng = np.random.default_rng(seed)
    ttft = arr[:, 2]
    seen = ttft[~np.isnan(ttft)]
    if seen.size == 0:
        raise ValueError(f"{path}: no request has a server_ttft; cannot model the cloud")
    ttft = np.where(np.isnan(ttft), rng.choice(seen, ttft.shape[0]), ttft)
    mig = np.where(np.isnan(arr[:, 5]), rng.choice(seen, ttft.shape[0]), arr[:, 5])
    dev = arr[:, 3]
    has_dev = ~np.isnan(dev)
    if has_dev.sum() >= 2:
        line = DeviceTTFTLine.fit(prompt[has_dev], dev[has_dev])
        k, c = line.k, line.c
    else:
        k, c = 1.0 / device.prefill_tps, 1.0 / device.decode_tps
    predicted = np.maximum(1e-6, k * prompt + c)
    dev = np.where(has_dev, dev, predicted)
    return Trace(
        name=path.stem,
        arrival=arr[:, 0],
        prompt_tokens=prompt,
        server_ttft=ttft,
        device_ttft=dev,
        output_tokens=out,
        server_ttft_migration=mig,
        u=rng.random(ttft.shape[0]),
        device_ratio=dev / predicted,
        device_k=k,
        device_c=c,
        description=f"recorded {path} ({len(rows)} requests; device line k={k:.5f} s/token, c={c:.3f} s)",
    )
