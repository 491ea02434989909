"""`tandem bench disco`: replay a request trace through DiSCo's policies and the paper's baselines.

Why a simulator: the paper's claims (§5, Tables 2-3, Fig. 7) are about
distributions over thousands of requests and every budget b ∈ [0, 1]; a live run
cannot sweep that. The simulator runs the *same* policy objects as the gateway
(`policies.dispatch`, `policies.migration`, `policies.estimate`, `policies.cost`);
it only supplies the clock and the endpoints' timings from the trace.

What one request does here (and in the gateway):

1. the dispatch policy turns the prompt length into a plan (device only / cloud
   only / race now / cloud now + device after w);
2. races: the first token wins; the loser is cancelled but its whole prefill is
   booked (providers bill the prompt once accepted; the device has spent the
   energy) — conservative for partial device prefills;
3. DiSCo-D's delayed device start happens only if the cloud has not produced its
   first token by w;
4. with migration on, after every delivered token `should_migrate` is asked
   whether moving to the other endpoint pays (Eq. 5) and whether the client is
   B = r_c·t_m tokens ahead (Eq. 6); if so the source stops, the target prefills
   prompt + delivered tokens (its real TTFT for that length: the device line, or
   a fresh cloud TTFT draw) and continues — less the prompt when the target is a
   device that lost the race: its KV cache still holds the prompt and llama.cpp
   reuses it, as the gateway's device does (the gateway asks the backend, and
   books what it reports). Delayed tokens are counted against the consumption
   clock t_first + i/r_c.

Estimators are primed with a calibration trace (the paper assumes the
distributions known; synthetic runs use an independent draw, recorded traces
the trace itself) and then fed online exactly what the gateway observes:
every prompt length and answer length, the cloud TTFT whenever the cloud was
started (the gateway lets a losing cloud stream reach its first token, which
costs nothing extra, so the sample is not censored), the device TTFT whenever
the device produced a first token, and observed migration times. Policies are
recomputed every `--recompute-every` requests. Requests are independent (no
device queueing): the paper's arrival interval is 30 s, far longer than a request.

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

Recorded traces (`--trace FILE`): JSON Lines written from the live gateway, one
request per line:

    {"arrival": 12.5, "prompt_tokens": 57, "server_ttft": 0.41, "device_ttft": 0.77, "output_tokens": 128}

arrival: seconds (any origin; used for ordering); prompt_tokens, output_tokens:
integers; server_ttft / device_ttft: seconds from the endpoint's start to its
first token, or null when that endpoint did not run to its first token. Null
server TTFTs are drawn (seeded) from the recorded ones — server TTFT does not
depend on prompt length (Table 1); null device TTFTs come from the least-squares
line over the recorded ones (or the device preset when there are none).
Optional "server_ttft_migration": the cloud TTFT to use if this request migrates
to the cloud (else another seeded draw from the recorded TTFTs).

`--timing` measures policy recomputation for 1K/10K/100K samples against a
line-by-line transcription of Alg. 2/3 (sort + Python loop) in the same run,
and the per-request decision time (medians of repeats), for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from policies.cost import (
    PAPER_LAMBDA_DEVICE_CONSTRAINED,
    PAPER_LAMBDA_SERVER_CONSTRAINED,
    QWEN2_5_0_5B,
    CostModel,
    DeviceEnergy,
    Side,
    cloud_prices,
    usd_per_pflop,
)
from policies.dispatch import DEFAULT_ALPHA, DiscoD, DiscoS, DispatchPolicy, StochD, StochS, make_policy
from policies.estimate import DeviceTTFTLine, Estimators
from policies.migration import READING_RATE, buffer_tokens, delayed_tokens, lead, should_migrate

DEFAULT_OUT = Path("var/bench/disco")
BUDGETS = tuple(round(0.1 * i, 1) for i in range(11))
CLOUD = "cloud"


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


@dataclass(frozen=True)
class SimConfig:
    r_c: float = READING_RATE  # client consumption rate, tokens/s
    max_tokens: int = 128  # App. E generation limit
    server_decode_tps: float = 80.0
    device_decode_tps: float = DEVICE_PRESETS["xiaomi14-qwen0.5b"].decode_tps
    alpha: float = DEFAULT_ALPHA
    recompute_every: int = 500
    window: int = 2000


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
    """Read a JSONL trace recorded by the gateway (format in the module docstring)."""
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


def primed_estimators(calibration: Trace, cfg: SimConfig) -> Estimators:
    """Estimators as a gateway would have them after serving the calibration trace."""
    est = Estimators(window=cfg.window)
    est.prompt_lengths.extend(calibration.prompt_tokens)
    est.server(CLOUD).extend(calibration.server_ttft)
    est.output_lengths.extend(calibration.output_tokens)
    for length, t in zip(calibration.prompt_tokens.tolist(), calibration.device_ttft.tolist(), strict=True):
        est.device_ttft.add(length, t)
    return est


@dataclass
class RunResult:
    regime: str
    policy: str
    budget: float
    migration: bool
    mean_ttft: float
    p99_ttft: float
    cost_per_request: float  # USD, Eq. 8
    budget_ratio: float  # realised share of prompt tokens on the constrained endpoint
    migrated: int
    delayed_per_migrated: float
    p99_tbt_migrated: float
    requests: int
    # A lower bound for any migration policy with this dispatch: the prefills the dispatch booked, the prompt
    # prefilled once more on the cheaper decoder where it was not, and every output token decoded there.
    floor_cost_per_request: float = 0.0


def simulate(
    trace: Trace,
    policy: DispatchPolicy,
    *,
    budget: float,
    side: Side,
    costs: CostModel,
    cfg: SimConfig,
    estimators: Estimators,
    migration: bool,
    regime: str = "",
    label: str | None = None,
) -> RunResult:
    """Replay `trace` through `policy` (and the migration controller when `migration`)."""
    est = copy.deepcopy(estimators)
    n = len(trace)
    lengths = trace.prompt_tokens.tolist()
    ts_all, td_all = trace.server_ttft.tolist(), trace.device_ttft.tolist()
    outs, us, ts2_all = trace.output_tokens.tolist(), trace.u.tolist(), trace.server_ttft_migration.tolist()
    prices = {"cloud": costs.server, "device": costs.device}
    rate = {"cloud": cfg.server_decode_tps, "device": cfg.device_decode_tps}
    r_c = cfg.r_c
    server_est = est.server(CLOUD)
    ttfts = np.empty(n)
    cost = floor = 0.0
    cheap = "device" if prices["device"].decode <= prices["cloud"].decode else "cloud"
    constrained_tokens = 0
    migrated = delayed = 0
    gaps: list[np.ndarray] = []
    remaining: list[float] = []
    server_mean = 0.0
    for r in range(n):
        if r % cfg.recompute_every == 0:
            policy.recompute_from(est, CLOUD, budget=budget, alpha=cfg.alpha, side=side)
            if migration:
                remaining = [
                    est.output_lengths.expected_remaining(i, cfg.max_tokens) for i in range(cfg.max_tokens + 1)
                ]
                server_mean = server_est.mean()
        length, ts, td, n_out = lengths[r], ts_all[r], td_all[r], outs[r]
        plan = policy.decide(length, us[r])
        cloud_started = plan.start_cloud
        if plan.start_cloud and plan.start_device:
            wait = plan.device_delay or 0.0
            device_started = ts > wait
            if device_started and wait + td < ts:
                winner, t_first = "device", wait + td
            else:
                winner, t_first = "cloud", ts
        elif plan.start_cloud:
            device_started, winner, t_first = False, "cloud", ts
        else:
            device_started, winner, t_first = True, "device", td
        ttfts[r] = t_first
        tokens = {"cloud": [length if cloud_started else 0, 0], "device": [length if device_started else 0, 0]}
        least = {side_: [prefill or (length if side_ == cheap else 0), n_out if side_ == cheap else 0]
                 for side_, (prefill, _) in tokens.items()}  # fmt: skip
        floor += costs.total(least["cloud"][0], least["cloud"][1], least["device"][0], least["device"][1])
        constrained_tokens += tokens["cloud" if side == "server" else "device"][0]

        # What the gateway learns from this request.
        est.prompt_lengths.add(length)
        est.output_lengths.add(n_out)
        if cloud_started:
            server_est.add(ts)
        if winner == "device":
            est.device_ttft.add(length, td)

        source, target = winner, ("device" if winner == "cloud" else "cloud")
        moved_at = None
        # Fast path: with Δc_decode ≤ 0 should_migrate says no for every token.
        if migration and n_out > 1 and prices[source].decode > prices[target].decode:
            r_src = rate[source]
            # A device that lost the race prefilled the prompt; llama.cpp reuses that KV prefix.
            cached = length if target == "device" and device_started else 0
            for i in range(n_out - 1):
                delivered = i + 1
                now = t_first + i / r_src
                if target == "device":
                    t_m = est.device_ttft.predict(length + delivered - cached)
                else:
                    t_m = est.migration_times.estimate("cloud", prior=server_mean)
                buf = buffer_tokens(r_c, t_m)
                ahead = lead(delivered, now, t_first, r_c)
                if ahead < buf:
                    continue  # start_now needs lead ≥ B; should_migrate would say "filling the buffer"
                d = should_migrate(
                    source=source,
                    target=target,
                    source_decode_price=prices[source].decode,
                    target_decode_price=prices[target].decode,
                    target_prefill_price=prices[target].prefill,
                    prompt_tokens=length,
                    delivered_tokens=delivered,
                    expected_remaining=remaining[delivered],
                    cached_tokens=cached,
                    client_lead=ahead,
                    buffer=buf,
                )
                if d.start_now:
                    moved_at = (delivered, now)
                    break
        if moved_at is None:
            tokens[source][1] += n_out
        else:
            k, now = moved_at
            t_m_true = trace.device_time(r, length + k - cached) if target == "device" else ts2_all[r]
            est.migration_times.add(target, t_m_true)
            tokens[source][1] += k
            tokens[target][0] += length + k - cached
            tokens[target][1] += n_out - k
            times = np.concatenate(
                [
                    t_first + np.arange(k) / rate[source],
                    now + t_m_true + np.arange(n_out - k) / rate[target],
                ]
            )
            migrated += 1
            delayed += delayed_tokens(times, t_first, r_c)
            gaps.append(np.diff(times))
        cost += costs.total(tokens["cloud"][0], tokens["cloud"][1], tokens["device"][0], tokens["device"][1])
    all_gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    return RunResult(
        regime=regime,
        policy=label or policy.name,
        budget=budget,
        migration=migration,
        mean_ttft=float(ttfts.mean()),
        p99_ttft=float(np.percentile(ttfts, 99)),
        cost_per_request=cost / n,
        budget_ratio=constrained_tokens / float(trace.prompt_tokens.sum()),
        migrated=migrated,
        delayed_per_migrated=delayed / migrated if migrated else 0.0,
        p99_tbt_migrated=float(np.percentile(all_gaps, 99)) if all_gaps.size else 0.0,
        requests=n,
        floor_cost_per_request=floor / n,
    )


@dataclass
class Regime:
    name: str
    lam_usd_per_pflop: float
    costs: CostModel
    side: Side
    results: list[RunResult] = field(default_factory=list)


def _policy_factories(side: Side, seed: int) -> list[tuple[str, DispatchPolicy]]:
    import random

    s = side == "server"
    stoch = StochS if s else StochD
    return [
        ("disco-s" if s else "disco-d", make_policy("disco", random.Random(seed))),
        (stoch.name, stoch(random.Random(seed))),
        (f"{stoch.name}+race", stoch(random.Random(seed), race=True)),
    ]


def run_bench(
    trace: Trace,
    calibration: Trace,
    cfg: SimConfig,
    *,
    server: ServerPreset,
    budgets: tuple[float, ...] = BUDGETS,
    regimes: tuple[tuple[str, float], ...] = (
        ("server-constrained", PAPER_LAMBDA_SERVER_CONSTRAINED),
        ("device-constrained", PAPER_LAMBDA_DEVICE_CONSTRAINED),
    ),
    seed: int = 0,
    progress: bool = True,
) -> list[Regime]:
    """Every policy × budget × {without, with} migration, per cost regime."""
    estimators = primed_estimators(calibration, cfg)
    energy = DeviceEnergy.from_arch(QWEN2_5_0_5B)
    out = []
    for name, lam in regimes:
        costs = CostModel(cloud_prices(server.prices), energy, usd_per_pflop(lam))
        side = costs.constrained_side()
        regime = Regime(name, lam, costs, side)
        runs: list[tuple[str, DispatchPolicy, float]] = []
        for b in budgets:
            runs += [(label, pol, b) for label, pol in _policy_factories(side, seed)]
        runs += [("server-only", make_policy("server-only"), 1.0), ("device-only", make_policy("device-only"), 0.0)]
        for label, pol, b in runs:
            for mig in (False, True):
                t0 = time.perf_counter()
                res = simulate(
                    trace, pol, budget=b, side=side, costs=costs, cfg=cfg, estimators=estimators,
                    migration=mig, regime=name, label=label,
                )  # fmt: skip
                regime.results.append(res)
                if progress:
                    print(
                        f"[disco-sim] {name} {label:14s} b={b:.1f} mig={int(mig)} "
                        f"mean={res.mean_ttft:.3f}s p99={res.p99_ttft:.3f}s ratio={res.budget_ratio:.3f} "
                        f"({time.perf_counter() - t0:.1f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
        out.append(regime)
    return out


# --------------------------------------------------------------------------- report


def _find(results: list[RunResult], policy: str, b: float, mig: bool) -> RunResult | None:
    for r in results:
        if r.policy == policy and abs(r.budget - b) < 1e-9 and r.migration == mig:
            return r
    return None


def summarize(regime: Regime, budgets: tuple[float, ...]) -> dict[str, object]:
    """The issue's acceptance numbers for one regime."""
    disco = "disco-s" if regime.side == "server" else "disco-d"
    stoch = "stoch-s" if regime.side == "server" else "stoch-d"
    p99_red, mean_worse, cost_red, cost_red_max, delayed = [], [], {}, {}, []
    for b in budgets:
        d0, s0 = _find(regime.results, disco, b, False), _find(regime.results, stoch, b, False)
        d1 = _find(regime.results, disco, b, True)
        if d0 is None or s0 is None or d1 is None:
            continue
        p99_red.append((b, 1 - d0.p99_ttft / s0.p99_ttft))
        if b >= 0.2 - 1e-9 and d0.mean_ttft >= s0.mean_ttft:
            mean_worse.append(b)
        if b >= 0.5 - 1e-9:
            cost_red[b] = 1 - d1.cost_per_request / d0.cost_per_request
            cost_red_max[b] = 1 - d0.floor_cost_per_request / d0.cost_per_request
        if d1.migrated:
            delayed.append(d1.delayed_per_migrated)
    positive = [x for b, x in p99_red if b > 0]
    return {
        "disco": disco,
        "stoch": stoch,
        "p99_reduction_avg": float(np.mean([x for _, x in p99_red])) if p99_red else math.nan,
        "p99_reduction_avg_b_gt_0": float(np.mean(positive)) if positive else math.nan,
        "mean_not_below_stoch_at": mean_worse,
        "migration_cost_reduction": cost_red,
        "migration_cost_reduction_bound": cost_red_max,
        "max_delayed_per_migrated": max(delayed) if delayed else 0.0,
    }


def _fmt_table(regime: Regime, budgets: tuple[float, ...]) -> list[str]:
    lines = [
        "| b | policy | mean TTFT (s) | P99 TTFT (s) | budget ratio | cost w/o mig (µ$/req) | cost w/ mig (µ$/req) "
        "| cost cut | migrated | delayed tok / migrated | P99 TBT migrated (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = sorted({r.policy for r in regime.results if r.policy not in ("server-only", "device-only")})
    labels.sort(key=lambda x: (not x.startswith("disco"), x))

    def row(b_text: str, p0: RunResult, p1: RunResult) -> str:
        cut = 1 - p1.cost_per_request / p0.cost_per_request if p0.cost_per_request else 0.0
        return (
            f"| {b_text} | {p0.policy} | {p0.mean_ttft:.3f} | {p0.p99_ttft:.3f} | {p0.budget_ratio:.3f} "
            f"| {p0.cost_per_request * 1e6:.2f} | {p1.cost_per_request * 1e6:.2f} | {cut:.1%} "
            f"| {p1.migrated / p1.requests:.1%} | {p1.delayed_per_migrated:.2f} | {p1.p99_tbt_migrated:.3f} |"
        )

    for b in budgets:
        for label in labels:
            p0, p1 = _find(regime.results, label, b, False), _find(regime.results, label, b, True)
            if p0 and p1:
                lines.append(row(f"{b:.1f}", p0, p1))
    for label, b in (("server-only", 1.0), ("device-only", 0.0)):
        p0, p1 = _find(regime.results, label, b, False), _find(regime.results, label, b, True)
        if p0 and p1:
            lines.append(row("—", p0, p1))
    return lines


def write_report(
    regimes: list[Regime], trace: Trace, cfg: SimConfig, out_dir: Path, budgets: tuple[float, ...], command: str,
    plots: bool = True,
) -> Path:  # fmt: skip
    """Markdown tables + acceptance summary + PNG plots + raw JSON into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = [
        "# DiSCo trace simulation",
        "",
        f"Command: `{command}`",
        "",
        f"Trace: {trace.description}.",
        f"Consumption rate r_c = {cfg.r_c} tok/s; cloud decode {cfg.server_decode_tps:g} tok/s; "
        f"device decode {cfg.device_decode_tps:g} tok/s; α = {cfg.alpha}; policies recomputed every "
        f"{cfg.recompute_every} requests; max answer {cfg.max_tokens} tokens.",
        "Budget ratio = share of prompt tokens dispatched to the constrained endpoint (race losers included). "
        "Cost = Eq. 8 per request (cloud Table 8 prices + λ·FLOPs of Qwen2.5-0.5B on the device), "
        "including migration prefills. TTFT is the same with and without migration.",
        "",
    ]
    summaries = {}
    for regime in regimes:
        s = summarize(regime, budgets)
        summaries[regime.name] = s
        dp = regime.costs.device.scaled(1e6)
        sp = regime.costs.server.scaled(1e6)
        md += [
            f"## {regime.name} (λ = {regime.lam_usd_per_pflop:g} USD/PFLOP → constrained side: {regime.side})",
            "",
            f"Prices per 1M tokens: cloud prefill {sp.prefill:.3f} / decode {sp.decode:.3f} USD; "
            f"device prefill {dp.prefill:.3f} / decode {dp.decode:.3f} USD.",
            "",
            *_fmt_table(regime, budgets),
            "",
            f"Acceptance ({s['disco']} vs {s['stoch']}):",
            "",
            f"- P99 TTFT reduction vs {s['stoch']}, averaged over b = 0..1: {s['p99_reduction_avg']:.1%} "
            f"(b > 0 only: {s['p99_reduction_avg_b_gt_0']:.1%}; at b = 0 both are the same policy). Target ≥ 25%.",
            "- Mean TTFT below stoch at every b ≥ 0.2: "
            + ("yes" if not s["mean_not_below_stoch_at"] else f"NO at b = {s['mean_not_below_stoch_at']}"),
            "- Migration cost cut vs no migration at b ≥ 0.5: "
            + ", ".join(
                f"b={b:.1f}: {v:.1%} (bound {s['migration_cost_reduction_bound'][b]:.1%})"
                for b, v in s["migration_cost_reduction"].items()
            )
            + ". Target ≥ 50%.",
            f"- Max delayed tokens per migrated request over b: {s['max_delayed_per_migrated']:.2f}. Target ≤ 8.",
            "",
        ]
        if plots:
            _plot(regime, budgets, out_dir / f"disco_{regime.name}.png")
            md += [f"![{regime.name}](disco_{regime.name}.png)", ""]
    path = out_dir / "results.md"
    path.write_text("\n".join(md), encoding="utf-8")
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "trace": trace.description,
                "config": asdict(cfg),
                "summaries": {
                    k: {
                        **v,
                        "migration_cost_reduction": {str(b): x for b, x in v["migration_cost_reduction"].items()},
                        "migration_cost_reduction_bound": {
                            str(b): x for b, x in v["migration_cost_reduction_bound"].items()
                        },
                    }
                    for k, v in summaries.items()
                },
                "results": [asdict(r) for rg in regimes for r in rg.results],
            },
            indent=1,
        ),
        encoding="utf-8",
    )  # fmt: skip
    return path


def _plot(regime: Regime, budgets: tuple[float, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r.policy for r in regime.results if r.policy not in ("server-only", "device-only")})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, label in enumerate(labels):
        color = f"C{i}"
        pts = [_find(regime.results, label, b, False) for b in budgets]
        xs = [p.budget for p in pts if p]
        axes[0].plot(xs, [p.mean_ttft for p in pts if p], marker="o", color=color, label=label)
        axes[1].plot(xs, [p.p99_ttft for p in pts if p], marker="o", color=color, label=label)
        costs = [p.cost_per_request * 1e6 for p in pts if p]
        axes[2].plot(xs, costs, marker="o", color=color, label=f"{label} w/o mig")
        pts1 = [_find(regime.results, label, b, True) for b in budgets]
        costs1 = [p.cost_per_request * 1e6 for p in pts1 if p]
        axes[2].plot(xs, costs1, marker="x", ls="--", color=color, label=f"{label} w/ mig")
    for ref in ("server-only", "device-only"):
        r0 = next((r for r in regime.results if r.policy == ref and not r.migration), None)
        if r0:
            axes[0].axhline(r0.mean_ttft, ls=":", color="gray")
            axes[1].axhline(r0.p99_ttft, ls=":", color="gray")
            axes[0].annotate(ref, (0.0, r0.mean_ttft), fontsize=7, color="gray")
            axes[1].annotate(ref, (0.0, r0.p99_ttft), fontsize=7, color="gray")
    for ax, title in zip(axes, ("mean TTFT (s)", "P99 TTFT (s)", "cost (µ$ / request)"), strict=True):
        ax.set_title(f"{regime.name}: {title}", fontsize=9)
        ax.set_xlabel(f"budget ratio b ({regime.side} share)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- timing


def literal_alg3(lengths: np.ndarray, budget: float) -> tuple[dict[int, tuple[int, int]], float]:
    """Alg. 3 as printed (the timing baseline and a cross-check, not used to decide anything):
    p(l) by sorting (np.unique), l_th by a running sum over the sorted support, then the
    map P[l] = (I_d, I_s) over the support. Returns (P, l_th)."""
    vals, cnt = np.unique(lengths, return_counts=True)
    tokens = (vals * cnt).tolist()
    target = (1.0 - budget) * float(sum(tokens))
    acc, l_th = 0.0, math.inf
    for v, t in zip(vals.tolist(), tokens, strict=True):
        if acc + t >= target * (1 - 1e-12):
            l_th = v
            break
        acc += t
    return {v: ((1, 0) if v < l_th else (1, 1)) for v in vals.tolist()}, l_th


def literal_alg2(lengths: np.ndarray, ttft: np.ndarray, budget: float, alpha: float) -> dict[int, float]:
    """Alg. 2 as printed (timing baseline and cross-check): F from a fully sorted sample,
    p(l) by np.unique, a Python loop over the sorted support filling W[l]."""
    s = np.sort(ttft)
    n = s.shape[0]

    def finv(p: float) -> float:
        return float(s[min(n - 1, max(0, math.ceil(p * n - 1e-9) - 1))])

    m = min(alpha, budget)
    w_tail = finv(1.0 - m) if m > 0 else math.inf
    vals, cnt = np.unique(lengths, return_counts=True)
    w = dict.fromkeys(vals.tolist(), w_tail)
    if budget <= alpha:
        return w
    q_tail = (n - int(np.searchsorted(s, w_tail, side="right"))) / n
    total = float((vals * cnt).sum())
    avail = budget - q_tail
    for v, c in zip(vals.tolist(), cnt.tolist(), strict=True):
        cost = v * c / total * (1.0 - q_tail)
        if avail * (1 + 1e-12) >= cost:
            w[v] = 0.0
            avail -= cost
        else:
            p_start = min(1.0, q_tail + avail * total / (v * c))
            w[v] = min(0.0 if p_start >= 1.0 else finv(1.0 - p_start), w_tail)
            break
    return w


def timing(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), seed: int = 0) -> str:
    """Policy recompute time per sample count (ours vs the literal pseudocode in the same run)
    and per-request decide time, medians of repeats, as a markdown table."""
    import random

    rng = np.random.default_rng(seed)
    server = SERVER_PRESETS["gpt"]
    lines = [
        "| policy | samples | recompute median (ms) | literal Alg. 2/3 median (ms) | speed-up | decide median (µs) |",
        "|---|---|---|---|---|---|",
    ]

    def median_ms(fn, repeats: int) -> float:
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(0.05 + 0.9 * (i % 10) / 9)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    for n in sizes:
        lengths = np.maximum(1, np.rint(rng.lognormal(math.log(48), 0.6, n))).astype(np.int64)
        ttft = rng.lognormal(math.log(server.median), server.sigma, n)
        probe = lengths[:1000].tolist()
        repeats = 50 if n <= 10_000 else 15
        for cls in (DiscoS, DiscoD):
            pol = cls(random.Random(seed))

            def ours_fn(b: float, p: DispatchPolicy = pol, x: np.ndarray = lengths, t: np.ndarray = ttft) -> None:
                p.recompute(prompt_lengths=x, server_ttft=t, budget=b)

            def base_fn(b: float, lit: bool = cls is DiscoS, x: np.ndarray = lengths, t: np.ndarray = ttft) -> None:
                if lit:
                    literal_alg3(x, b)
                else:
                    literal_alg2(x, t, b, DEFAULT_ALPHA)

            ours, base = median_ms(ours_fn, repeats), median_ms(base_fn, repeats)
            pol.recompute(prompt_lengths=lengths, server_ttft=ttft, budget=0.5)
            per = []
            calls = 20_000
            for _ in range(7):
                t0 = time.perf_counter()
                for j in range(calls):
                    pol.decide(probe[j % 1000], 0.5)
                per.append((time.perf_counter() - t0) / calls)
            lines.append(
                f"| {cls.name} | {n:,} | {ours:.3f} | {base:.3f} | {base / ours:.1f}× | {np.median(per) * 1e6:.2f} |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _parse_budgets(text: str) -> tuple[float, ...]:
    vals = tuple(float(x) for x in text.split(",") if x.strip())
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError("budgets must be comma-separated numbers in [0, 1]")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench disco", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, help="JSONL trace recorded by the gateway (default: synthetic)")
    p.add_argument("-n", "--requests", type=int, default=10_000, help="synthetic trace size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", choices=sorted(SERVER_PRESETS), default="gpt", help="cloud TTFT + price preset")
    p.add_argument("--device", choices=sorted(DEVICE_PRESETS), default="xiaomi14-qwen0.5b")
    p.add_argument("--prompt-median", type=float, default=48.0)
    p.add_argument("--prompt-sigma", type=float, default=0.6)
    p.add_argument("--output-median", type=float, default=150.0)
    p.add_argument("--output-sigma", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--server-tps", type=float, default=80.0, help="cloud decode speed, tokens/s")
    p.add_argument("--rc", type=float, default=READING_RATE, help="client consumption rate r_c, tokens/s")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="DiSCo-D tail ratio α")
    p.add_argument("--budgets", type=_parse_budgets, default=BUDGETS, help="comma-separated b values")
    p.add_argument("--calibration", type=int, default=2000, help="synthetic calibration requests")
    p.add_argument("--recompute-every", type=int, default=500)
    p.add_argument("--lambda-server", type=float, default=PAPER_LAMBDA_SERVER_CONSTRAINED, help="USD/PFLOP")
    p.add_argument("--lambda-device", type=float, default=PAPER_LAMBDA_DEVICE_CONSTRAINED, help="USD/PFLOP")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--timing", action="store_true", help="measure policy compute time instead")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    command = "tandem bench disco " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.timing:
        table = timing(seed=args.seed)
        args.out.mkdir(parents=True, exist_ok=True)
        text = f"# DiSCo policy compute time\n\nCommand: `{command}`\n\n{table}\n"
        (args.out / "timing.md").write_text(text, encoding="utf-8")
        print(text)
        return 0

    server, device = SERVER_PRESETS[args.server], DEVICE_PRESETS[args.device]
    cfg = SimConfig(
        r_c=args.rc,
        max_tokens=args.max_tokens,
        server_decode_tps=args.server_tps,
        device_decode_tps=device.decode_tps,
        alpha=args.alpha,
        recompute_every=args.recompute_every,
    )
    gen = dict(
        server=server,
        device=device,
        prompt_median=args.prompt_median,
        prompt_sigma=args.prompt_sigma,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        max_tokens=args.max_tokens,
    )
    try:
        if args.trace:
            trace = load_trace(args.trace, seed=args.seed, device=device)
            calibration = trace
        else:
            trace = synthetic_trace(args.requests, seed=args.seed, **gen)
            calibration = synthetic_trace(args.calibration, seed=args.seed + 10_000, **gen)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    regimes = run_bench(
        trace,
        calibration,
        cfg,
        server=server,
        budgets=args.budgets,
        regimes=(("server-constrained", args.lambda_server), ("device-constrained", args.lambda_device)),
        seed=args.seed,
        progress=not args.quiet,
    )
    path = write_report(regimes, trace, cfg, args.out, args.budgets, command, plots=not args.no_plots)
    print(path.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
