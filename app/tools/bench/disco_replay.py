"""The simulation of `tandem bench disco`: one trace replayed through a dispatch policy, with or without migration.

The simulator runs the *same* policy objects as the gateway (`policies.dispatch`, `policies.migration`,
`policies.estimate`, `policies.cost`); it only supplies the clock and the endpoints' timings from the trace.

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
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from app.tools.bench.disco_trace import DEVICE_PRESETS, ServerPreset, Trace
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
from policies.dispatch import DEFAULT_ALPHA, DispatchPolicy, StochD, StochS, make_policy
from policies.estimate import Estimators
from policies.migration import READING_RATE, buffer_tokens, delayed_tokens, lead, should_migrate

BUDGETS = tuple(round(0.1 * i, 1) for i in range(11))
CLOUD = "cloud"


@dataclass(frozen=True)
class SimConfig:
    r_c: float = READING_RATE  # client consumption rate, tokens/s
    max_tokens: int = 128  # App. E generation limit
    server_decode_tps: float = 80.0
    device_decode_tps: float = DEVICE_PRESETS["xiaomi14-qwen0.5b"].decode_tps
    alpha: float = DEFAULT_ALPHA
    recompute_every: int = 500
    window: int = 2000


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
