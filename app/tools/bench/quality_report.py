"""`tandem bench quality`'s report: the table of summaries, the models' time, the frontier plot, and DiSCo's
Appendix D (pass@1 against the forced migration's cut point, with the bound check) and its plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from app.tools import pyplot
from app.tools.bench.quality_configs import BOUND, EXPLORATION, ORACLE
from app.tools.bench.quality_scores import ENDPOINTS, Scored


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(summaries: list[dict]) -> list[str]:
    """One row per summary: what it is and its standing in the report (a result, a bound, a reference, an
    exploration), pass@1, the paired differences, the bill and the unified cost with their ratios to cloud-only's,
    and what a coin-flip router paying the same bill scores in expectation."""
    lines = [
        "| configuration | standing | pass@1 % [Wilson 95 %] | vs cloud: Δ points [paired bootstrap 95 %], McNemar p | "
        "vs device: Δ points [95 %] | cloud bill µUSD/answer (× cloud-only's) | unified cost µUSD/answer (×) | "
        "median TTFT s | cloud token share | answers migrated (reasons) | a coin-flip router at the same bill: "
        "expected pass@1 % (problems) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        low, high = s["wilson_95"]
        paired = []
        for ref in ENDPOINTS:
            p = s["paired"].get(ref)
            if p is None:
                paired.append("—")
                continue
            b_low, b_high = p["bootstrap_95"]
            text = f"{100 * p['difference']:+.1f} [{100 * b_low:+.1f}, {100 * b_high:+.1f}]"
            paired.append(text + (f", p = {p['mcnemar_p']:.3g}" if ref == "cloud" else ""))
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["migrations_by_reason"].items()))
        ttft = "—" if s["ttft_s_median"] is None else f"{s['ttft_s_median']:.2f}"
        expected = s.get("random_at_same_bill")
        coin = "—" if expected is None else f"{_pct(expected)} ({expected * s['problems']:.1f}/{s['problems']})"
        name = s.get("description", s["config"])
        name = name if name == s["config"] else f"{name} (`{s['config']}`)"
        lines.append(
            f"| {name} | {s.get('standing', '—')} | {_pct(s['pass_at_1'])} ({s['passed']}/{s['problems']}) "
            f"[{_pct(low)}, {_pct(high)}] | {paired[1]} | {paired[0]} | "
            f"{_cost(s['cloud_cost_usd_per_answer'], s.get('bill_ratio'))} | "
            f"{_cost(s['unified_cost_usd_per_answer'], s.get('unified_ratio'))} | {ttft} | "
            f"{s['cloud_token_share']:.2f} | {s['answers_migrated']}{f' ({reasons})' if reasons else ''} | {coin} |"
        )
    return lines


def _cost(usd: float, ratio: float | None) -> str:
    return f"{1e6 * usd:.1f}" + ("" if ratio is None else f" ({ratio:.2f}×)")


def model_time(summaries: list[dict]) -> str:
    """How long the models took over each asked configuration's answers (as measured when they were asked, maybe
    in an earlier run: the cache keeps it); a random or the oracle router's answers are the endpoints' own and took
    none."""
    parts = [
        f"{s['config']} {s['answer_seconds_total']:.0f} s ({s['answer_seconds_total'] / s['problems']:.1f} s an answer"
        + (f", {s['decode_tokens_per_s_median']:.1f} tokens/s" if s["decode_tokens_per_s_median"] else "")
        + ")"
        for s in summaries
        if s["problems"] and not s["config"].startswith("random") and s["config"] != ORACLE
    ]
    return "Model time, as the answers were asked: " + "; ".join(parts) + "."


def _short(name: str) -> str:
    """A row's name on the plot: `policy:quality+quality_threshold=0.8` as `quality τ=0.8`."""
    if not name.startswith("policy:"):
        return name
    name = name.removeprefix("policy:").replace("+quality_threshold=", " τ=").replace("+stream=false", " unstreamed")
    return name.replace("+", " ")


def plot_label(s: dict) -> str:
    """A row's label on the plot: its short name, with its standing where it is not a result."""
    label = _short(s["config"])
    if s.get("standing") == EXPLORATION:
        return f"{label} ({EXPLORATION})"
    if s.get("standing") == BOUND:
        return f"{label} (bound)"
    return label


def plot_frontier(summaries: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, label in (
        (axes[0], "cloud_cost_usd_per_answer", "cloud bill per answer (µUSD)"),
        (axes[1], "unified_cost_usd_per_answer", "unified cost per answer (µUSD, device energy at λ)"),
    ):
        for s in summaries:
            x, y = 1e6 * s[key], 100 * s["pass_at_1"]
            low, high = (100 * v for v in s["wilson_95"])
            marker = {"device": "s", "cloud": "D", ORACLE: "*"}.get(
                s["config"], "o" if s["config"].startswith("disco") else "^"
            )
            explored = s.get("standing") == EXPLORATION  # hollow and grey: not a result
            style = {"mfc": "none", "color": "grey"} if explored else {}
            ax.errorbar(x, y, yerr=[[y - low], [high - y]], fmt=marker, capsize=3, **style)
            ax.annotate(plot_label(s), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ends = {s["config"]: s for s in summaries if s["config"] in ENDPOINTS}
        if len(ends) == 2:  # a random router, in expectation: the straight line between the endpoints
            line = [ends["device"], ends["cloud"]]
            ax.plot([1e6 * e[key] for e in line], [100 * e["pass_at_1"] for e in line], "--", color="grey", lw=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("HumanEval pass@1 (%) [Wilson 95 %]")
    title = "tandem bench quality: pass@1 against cost"
    if any(s.get("standing") == EXPLORATION for s in summaries):
        title += f" (hollow grey: {EXPLORATION}, not results)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def appendix_d(rows: dict[str, list[Scored]], cuts: tuple[int, ...]) -> tuple[list[str], dict]:
    """Pass@1 against the cut point k, both directions, beside both endpoints alone on the same problems; the bound
    check (min ≤ migrated ≤ max) per row, and the problems where a migrated answer leaves the endpoints' own range
    (passes where both fail, or fails where both pass)."""
    device, cloud = rows["device"], rows["cloud"]
    n = len(device)
    d_pass, c_pass = sum(r.passed for r in device), sum(r.passed for r in cloud)
    lo, hi = min(d_pass, c_pass), max(d_pass, c_pass)
    lines = [
        f"Endpoints alone on the same {n} problems: device {d_pass}/{n} ({_pct(d_pass / n)} %), cloud {c_pass}/{n} "
        f"({_pct(c_pass / n)} %).",
        "",
        "| k | direction | pass@1 % | answers moved at k | bound min ≤ x ≤ max | above both (problems) | below both "
        "(problems) | model s/answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks, data = [], {"device": d_pass, "cloud": c_pass, "problems": n, "rows": []}
    for k in cuts:
        for source in ENDPOINTS:
            name = f"{source}>{'cloud' if source == 'device' else 'device'}@{k}"
            moved = rows[name]
            passed = sum(r.passed for r in moved)
            above = [
                m.task_id
                for m, d, c in zip(moved, device, cloud, strict=True)
                if m.passed and not (d.passed or c.passed)
            ]
            below = [
                m.task_id
                for m, d, c in zip(moved, device, cloud, strict=True)
                if not m.passed and d.passed and c.passed
            ]
            migrated = sum(bool(r.migrations) for r in moved)
            holds = lo <= passed <= hi
            lines.append(
                f"| {k} | {name.split('@')[0].replace('>', ' → ')} | {_pct(passed / n)} ({passed}/{n}) | "
                f"{migrated}/{n} | {'holds' if holds else 'OUTSIDE'} | {len(above)}{_ids(above)} | "
                f"{len(below)}{_ids(below)} | {statistics.fmean(r.seconds for r in moved):.1f} |"
            )
            checks.append(f"bound check {name}: {lo} <= {passed} <= {hi}: {'holds' if holds else 'does not hold'}")
            data["rows"].append(
                {"config": name, "k": k, "passed": passed, "migrated": migrated, "bound_holds": holds,
                 "above_both": above, "below_both": below}
            )  # fmt: skip
    return [*lines, "", *checks], data


def _ids(task_ids: list[str]) -> str:
    return f" ({', '.join(t.split('/')[1] for t in task_ids)})" if task_ids else ""


def plot_appendix_d(data: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = data["problems"]
    for source, marker in (("device", "o"), ("cloud", "s")):
        points = [(r["k"], 100 * r["passed"] / n) for r in data["rows"] if r["config"].startswith(source + ">")]
        ax.plot(*zip(*points, strict=True), marker=marker, label=f"{source} first, moved at k")
    for endpoint, style in (("device", ":"), ("cloud", "--")):
        ax.axhline(100 * data[endpoint] / n, linestyle=style, color="grey", label=f"{endpoint} alone")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (answer tokens before the forced migration)")
    ax.set_ylabel("HumanEval pass@1 (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
