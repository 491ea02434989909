"""The report of `tandem bench disco`: per-regime tables, the acceptance numbers, plots and raw JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from app.tools import pyplot
from app.tools.bench.disco_replay import Regime, RunResult, SimConfig
from app.tools.bench.disco_trace import Trace


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
    plt = pyplot()
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
