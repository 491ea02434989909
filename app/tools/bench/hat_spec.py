"""The speculation sections of `tandem bench hat` (issue 14's bench spec (b)-(d)), each planned from a profile.

- widths (b): a live sweep over verification widths — fixed chains and token trees — with ARCA's pick from the
  profile and today's default (the eta chain) side by side: per shape the accept length, median TBT, speedup over
  U-shape, and Ghidorah's decomposition of that speedup, accept length x T(1) / T(w) with T the measured time of one
  round; and whether ARCA's pick is within 5% of the best swept shape's TBT.
- eq7 (c): the Eq. 7 draft-length controller ("eq7", "eq7+eta") against fixed chains of 1..8 drafts and today's
  default ("eta") at several RTTs: median TBT, accepted drafts per round, the ratio to the default.
- defaults (d): Tables 4 and 5 (app/tools/bench/hat_sections.py's own code) with the profile-driven configuration
  ("eq7+eta", the profile, `arca = true`) against U-shape and today's default in the same run; Table 4 repeated
  --defaults-runs times, the speedup's median reported.

The profile is --profile, or `tandem profile` run once at the first of these sections against the bench's own
worker and link (Bench.profile). The pure parts (shapes, ARCA's pick, the decomposition, the tables) are functions
of plain data, unit-tested in tests/unit/test_bench_hat_spec.py.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from app.tools.bench.hat_sections import table4_rows, table5_rows
from app.tools.bench.hat_setup import SD_ONLY, U_SHAPE, Bench, Variant, run_request, started

SD_PC = Variant(True, True, False)  # today's default HAT configuration (chunked prefill, eta chain, no trees)
TOLERANCE = 0.05  # ARCA's live TBT may be this much above the best swept shape's (issue 14)
DEFAULT_NAME = "default (eta chain)"
PROFILED_NAME = "profiled (eq7+eta, ARCA)"


@dataclass
class Shape:
    """One verification shape of the width sweep: how it is named, its variant and its further HATOptions."""

    name: str
    kind: str  # "u-shape" | "chain" | "tree" | "eta" (today's default: the confidence stop, no fixed width)
    width: int  # positions verified per round (the last accepted token + drafts); 0 for "eta"
    variant: Variant
    options: dict[str, Any] = field(default_factory=dict)


def chain_shape(width: int, name: str | None = None) -> Shape:
    """A fixed chain verifying `width` positions: width - 1 drafts every round (eta 0: no confidence stop, so every
    round drafts exactly max_draft). Width 1 verifies no draft: that is U-shape."""
    if width < 1:
        raise ValueError(f"a chain verifies at least 1 position, got {width}")
    if width == 1:
        return Shape(name or "U-shape", "u-shape", 1, U_SHAPE)
    return Shape(name or f"chain w={width}", "chain", width, SD_ONLY, {"eta": 0.0, "max_draft": width - 1})


def tree_shape(width: int, table1: dict[str, Any] | None, name: str | None = None) -> Shape:
    """A token tree of `width` positions: the profile's tree for that width (its path counts), else the shape
    policies/trees.py builds from its prior. The draft cap must reach the tree's depth, or rounds fall back to
    chains (clients/hat/rounds.py, DecodeRounds._tree_for)."""
    paths = ((table1 or {}).get("trees") or {}).get(str(width))
    if paths:
        tree = tuple(tuple(int(r) for r in p) for p in paths)
        depth = max(len(p) for p in tree)
        options = {"tree_paths": tree, "max_draft": max(8, depth)}
        source = "profile"
    else:
        options, source = {"tree_width": width}, "prior"
    return Shape(name or f"tree w={width} ({source})", "tree", width, SD_ONLY, options)


def arca_shape(profile: Any) -> Shape:
    """ARCA's pick from a profile (clients.hat.profile.HATProfile.arca_choice), run as a user gets it: the profile
    and `arca = true` with every other setting at its default (the device half applies the choice itself: a chain's
    width caps the draft, the eta rule acting within it; a tree is verified)."""
    choice = profile.arca_choice()
    if choice is None:
        raise SystemExit(f"profile {profile.path} has no Table I (acceptance.table1): rerun tandem profile")
    variant = U_SHAPE if choice.width == 1 else SD_ONLY
    return Shape(choice.name, choice.kind, choice.width, variant, {"profile": profile.path, "arca": True})


def swept_shapes(chains: list[int], trees: list[int], table1: dict[str, Any] | None) -> list[Shape]:
    """U-shape first (the baseline, also the chain of width 1), the chains, the trees, then today's default."""
    shapes = [chain_shape(1)]
    shapes += [chain_shape(w) for w in chains if w > 1]
    shapes += [tree_shape(w, table1) for w in trees]
    shapes.append(Shape(DEFAULT_NAME, "eta", 0, SD_ONLY))
    return shapes


def decomposition(accept_length: float, round_ms_1: float, round_ms_w: float) -> dict[str, float]:
    """Ghidorah's speedup = accept length x T(1) / T(w): what a width buys in tokens per round, times what its
    round costs against a one-position round."""
    cost_ratio = round_ms_1 / round_ms_w
    return {"accept_length": accept_length, "step_ratio": cost_ratio, "speedup": accept_length * cost_ratio}


def within(tbt_ms: float, best_ms: float, tolerance: float = TOLERANCE) -> bool:
    """Is a TBT within `tolerance` (relative) of the best one?"""
    return tbt_ms <= best_ms * (1.0 + tolerance)


def summarize_widths(rows: list[dict[str, Any]], modelled: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Speedup over U-shape (rows[0]) and the decomposition per row; the best swept shape (U-shape, chains, trees)
    and whether ARCA's row (the one marked "arca") is within TOLERANCE of its TBT. `modelled`: the profile's Table I
    rows by width (their calibrated decomposition, for the shapes the profile modelled)."""
    base = rows[0]
    for r in rows:
        r["speedup"] = base["tbt_ms_median"] / r["tbt_ms_median"]
        r["decomposition"] = decomposition(r["accept_length"], base["ms_per_round"], r["ms_per_round"])
        table = modelled.get(r["width"], {}).get(r["kind"]) if r["kind"] in ("chain", "tree") else None
        r["modelled_speedup"] = None if table is None else table.get("ghidorah_speedup")
    swept = [r for r in rows if r["kind"] in ("u-shape", "chain", "tree") and not r.get("arca")]
    best = min(swept, key=lambda r: r["tbt_ms_median"])
    arca = next(r for r in rows if r.get("arca"))
    return {
        "rows": rows,
        "best_swept": best["name"],
        "arca": arca["name"],
        "arca_over_best": arca["tbt_ms_median"] / best["tbt_ms_median"],
        "arca_within_5pct": within(arca["tbt_ms_median"], best["tbt_ms_median"]),
    }


def report_widths(d: dict[str, Any]) -> list[str]:
    lines = ["", f"Verification widths, live (SD alone; {d['prompts']} held-out chat prompts x {d['tokens']} tokens; "
             "ARCA's pick from the profile): accept length, TBT median, speedup over U-shape, and Ghidorah's "
             "decomposition accept x T(1)/T(w) from the measured round times (the profile's modelled one beside it)",
             "", "| shape | accept length | TBT median ms | speedup | ms per round | T(1)/T(w) | accept x T(1)/T(w) | "
             "modelled | tree rounds |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in d["rows"]:
        dec, mod = r["decomposition"], r["modelled_speedup"]
        lines.append(f"| {r['name']} | {r['accept_length']:.2f} | {r['tbt_ms_median']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['ms_per_round']:.1f} | {dec['step_ratio']:.2f} | {dec['speedup']:.2f}x | "
                     f"{'-' if mod is None else f'{mod:.2f}x'} | {r['tree_rounds']}/{r['rounds']} |")  # fmt: skip
    verdict = "within" if d["arca_within_5pct"] else "NOT within"
    lines += ["", f"ARCA's pick ({d['arca']}) is {verdict} 5% of the best swept shape ({d['best_swept']}): "
              f"TBT {d['arca_over_best']:.3f}x the best's"]  # fmt: skip
    return lines


EQ7_MODES = ("eq7", "eq7+eta")


def eq7_configs(lengths: list[int]) -> list[tuple[str, dict[str, Any]]]:
    """(name, HATOptions) of the draft-length rules compared: today's default first, Eq. 7's two, fixed chains."""
    fixed = [(f"fixed {n}", {"eta": 0.0, "max_draft": n}) for n in lengths]
    return [("eta (default)", {}), *((m, {"draft_length": m}) for m in EQ7_MODES), *fixed]


def summarize_eq7(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each RTT row's cells get their TBT ratio to the default rule's; the row names its fastest rule."""
    for row in rows:
        base = row["cells"]["eta (default)"]["tbt_ms_median"]
        for cell in row["cells"].values():
            cell["ratio_to_default"] = cell["tbt_ms_median"] / base
        row["fastest"] = min(row["cells"], key=lambda n: row["cells"][n]["tbt_ms_median"])
    return rows


def report_eq7(d: dict[str, Any]) -> list[str]:
    names = list(d["rows"][0]["cells"])
    lines = ["", f"Draft length: Eq. 7 against fixed chains and today's default (SD+PC; {d['prompts']} held-out chat "
             f"prompts x {d['tokens']} tokens after a warm-up; profile: {d['profile']}): TBT median ms / accepted "
             "drafts per round / ratio to the default", "",
             "| RTT ms | " + " | ".join(names) + " | fastest |", "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for row in d["rows"]:
        cells = [f"{c['tbt_ms_median']:.1f} / {c['accepted_per_round']:.2f} / {c['ratio_to_default']:.2f}x"
                 for c in row["cells"].values()]  # fmt: skip
        lines.append(f"| {row['rtt_ms']:g} | " + " | ".join(cells) + f" | {row['fastest']} |")
    return lines


def summarize_defaults(table4_runs: list[dict[str, Any]], table5: list[dict[str, Any]]) -> dict[str, Any]:
    """Table 4's speedups over U-shape per run and their medians; Table 5's TBT and TTFT ratios per length."""
    names = [n for n in table4_runs[0] if isinstance(table4_runs[0][n], dict)]
    speedups = {n: [run[U_SHAPE.name]["tbt_ms_median"] / run[n]["tbt_ms_median"] for run in table4_runs] for n in names}
    t4 = {
        n: {
            "speedup_per_run": speedups[n],
            "speedup_median": statistics.median(speedups[n]),
            "accept_length": statistics.median(run[n]["accept_length"] for run in table4_runs),
            "tbt_ms_median": statistics.median(run[n]["tbt_ms_median"] for run in table4_runs),
            "tree_rounds": sum(run[n]["stats"]["tree_rounds"] for run in table4_runs),
            "rounds": sum(run[n]["stats"]["rounds"] for run in table4_runs),
            "mean_draft_cap": statistics.median(run[n]["stats"]["mean_draft_cap"] for run in table4_runs),
        }
        for n in names
    }
    t5 = []
    for length in sorted({r["prompt_tokens"] for r in table5}):
        cells = {r["variant"]: r for r in table5 if r["prompt_tokens"] == length}
        base = cells[U_SHAPE.name]
        t5.append({
            "prompt_tokens": length,
            **{n: {"ttft_ms": r["ttft_ms"], "tbt_ms": r["tbt_ms"], "accept_length": r["accept_length"],
                   "ttft_ratio": r["ttft_ms"] / base["ttft_ms"], "tbt_ratio": r["tbt_ms"] / base["tbt_ms"],
                   "same_as_u_shape": not r.get("differs_from_u_shape", False)} for n, r in cells.items()},
        })  # fmt: skip
    return {"table4": t4, "table5": t5}


def report_defaults(d: dict[str, Any]) -> list[str]:
    t4, t5 = d["table4"], d["table5"]
    names = list(t4)
    runs = len(next(iter(t4.values()))["speedup_per_run"])
    lines = ["", f"Defaults: Table 4 ({d['prompts']} held-out prompts x {d['tokens']} tokens, SD alone, {runs} runs; "
             "medians) with the profile-driven configuration", "",
             "| configuration | accept length | TBT median ms | speedup (median) | speedup per run | tree rounds | "
             "mean draft cap |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in names:
        c = t4[n]
        per = ", ".join(f"{s:.2f}x" for s in c["speedup_per_run"])
        lines.append(f"| {n} | {c['accept_length']:.2f} | {c['tbt_ms_median']:.1f} | {c['speedup_median']:.2f}x | "
                     f"{per} | {c['tree_rounds']}/{c['rounds']} | {c['mean_draft_cap']:.2f} |")  # fmt: skip
    t5_names = [n for n in t5[0] if n != "prompt_tokens"] if t5 else []
    prompts = d["table5_rows"][0]["prompts"] if d.get("table5_rows") else 0
    lines += ["", f"Defaults: Table 5 (SD+PC, medians over {prompts} code-reading prompts a length; TTFT ms / TBT ms "
              "(TBT ratio to U-shape) / accept length)", "",
              "| prompt | " + " | ".join(t5_names) + " |", "|---" * (len(t5_names) + 1) + "|"]  # fmt: skip
    for row in t5:
        cells = [f"{row[n]['ttft_ms']:.0f} / {row[n]['tbt_ms']:.1f} ({row[n]['tbt_ratio']:.2f}x) / "
                 f"{row[n]['accept_length']:.2f}" for n in t5_names]  # fmt: skip
        lines.append(f"| {row['prompt_tokens']} | " + " | ".join(cells) + " |")
    return lines


# --- the sections ---------------------------------------------------------------------------------------


async def _measure(bench: Bench, variant: Variant, options: dict[str, Any], prompts: list[list[int]], tokens: int,
                   warmup_tokens: int = 4, link: Any = None) -> dict[str, Any]:  # fmt: skip
    """One device half on every prompt after a warm-up request: median TBT, accept length, the round clock."""
    from clients.hat.options import HATStats

    b = await started(bench, variant, link=link, **options)
    try:
        await run_request(b, prompts[0], warmup_tokens)
        b.stats = HATStats()
        runs = [await run_request(b, ids, tokens) for ids in prompts]
        s = b.stats.summary()
    finally:
        await b.close()
    rounds = max(b.stats.rounds, 1)
    return {
        "tbt_ms_median": statistics.median(r["tbt_ms"] for r in runs if r["tokens"] > 1),
        "accept_length": s["accept_length"] if variant.sd else 1.0,
        "accepted_per_round": b.stats.accepted / rounds,
        "drafted_per_round": s["drafted_per_round"],
        "ms_per_round": s["ms_per_round"],
        "mean_draft_cap": s["mean_draft_cap"],
        "rounds": b.stats.rounds,
        "tree_rounds": b.stats.tree_rounds,
        "longest_draft": b.stats.longest_draft,
        "shape": b.shape,
        "ids": [r["ids"] for r in runs],
    }


async def widths(bench: Bench) -> dict[str, Any]:
    """(b): U-shape, fixed chains, token trees, today's default and ARCA's pick, one after another on the held-out
    chat prompts (Table 4's), each after a warm-up request."""
    from clients.hat.profile import load_profile

    a = bench.args
    profile = load_profile(await bench.profile())
    table1 = (profile.raw.get("acceptance") or {}).get("table1")
    arca = arca_shape(profile)
    shapes = [*swept_shapes(a.width_chains, a.width_trees, table1), arca]
    prompts = bench.held_out_prompts(a.table4_prompts)
    rows = []
    for shape in shapes:
        r = await _measure(bench, shape.variant, shape.options, prompts, a.table4_tokens)
        r.update(name=shape.name, kind=shape.kind, width=shape.width, arca=shape is arca,
                 options={k: str(v) for k, v in shape.options.items()})  # fmt: skip
        rows.append(r)
        print(f"  widths {shape.name:28s} accept {r['accept_length']:.2f}  TBT {r['tbt_ms_median']:6.1f} ms  "
              f"round {r['ms_per_round']:6.1f} ms  tree rounds {r['tree_rounds']}/{r['rounds']}  ran {r['shape']}",
              file=sys.stderr)  # fmt: skip
    base_ids = rows[0].pop("ids")
    for r in rows[1:]:
        r["same_as_u_shape"] = r.pop("ids") == base_ids
    modelled = {int(row["width"]): row for row in (table1 or {}).get("rows", [])}
    out = summarize_widths(rows, modelled)
    out.update(prompts=len(prompts), tokens=a.table4_tokens, profile=str(profile.path))
    return out


async def eq7(bench: Bench) -> dict[str, Any]:
    """(c): every draft-length rule at every --eq7-rtt-ms, SD with chunked prefill (today's default variant), the
    profile's measured parts as the controller's start; one short warm-up request per cell (so the estimators have
    seen this prompt set), then each prompt once."""
    from clients.hat.link import LinkProfile

    a, base = bench.args, bench.link
    profile = await bench.profile()
    prompts = bench.held_out_prompts(a.eq7_prompts)
    rows = []
    for rtt in a.eq7_rtt_ms:
        link = LinkProfile(latency=rtt / 2e3, up_bandwidth=base.up_bandwidth, down_bandwidth=base.down_bandwidth)
        row: dict[str, Any] = {"rtt_ms": rtt, "cells": {}}
        for name, options in eq7_configs(a.eq7_lengths):
            r = await _measure(bench, SD_PC, {**options, "profile": profile}, prompts, a.eq7_tokens, 8, link)
            row["cells"][name] = r
            print(
                f"  eq7 rtt {rtt:5.0f} ms {name:14s} TBT {r['tbt_ms_median']:6.1f} ms  accepted/round "
                f"{r['accepted_per_round']:.2f}  drafted/round {r['drafted_per_round']:.2f}",
                file=sys.stderr,
            )
        ids = {n: c.pop("ids") for n, c in row["cells"].items()}
        for n, c in row["cells"].items():  # greedy: the same tokens under every rule (up to fp near-ties)
            c["same_as_default"] = ids[n] == ids["eta (default)"]
        rows.append(row)
    return {"rows": summarize_eq7(rows), "prompts": len(prompts), "tokens": a.eq7_tokens, "profile": str(profile)}


async def defaults(bench: Bench) -> dict[str, Any]:
    """(d): Tables 4 and 5 with U-shape, today's default and the profile-driven configuration (`draft_length =
    "eq7+eta"`, the profile, `arca = true`: what a user sets), through Tables 4 and 5's own code."""
    a = bench.args
    profiled = {"draft_length": "eq7+eta", "profile": await bench.profile(), "arca": True}
    t4_configs = [(U_SHAPE.name, U_SHAPE, {}), (DEFAULT_NAME, SD_ONLY, {}), (PROFILED_NAME, SD_ONLY, profiled)]
    runs = [await table4_rows(bench, t4_configs) for _ in range(a.defaults_runs)]
    t5 = await table5_rows(bench, [(U_SHAPE.name, U_SHAPE, {}), (DEFAULT_NAME, SD_PC, {}),
                                   (PROFILED_NAME, SD_PC, profiled)])  # fmt: skip
    for r in t5:
        r.pop("ids", None)
    out = summarize_defaults(runs, t5)
    out.update(prompts=runs[0]["prompts"], tokens=a.table4_tokens, table4_runs=runs, table5_rows=t5)
    return out
