"""`tandem bench quality`'s scores: each cached answer run against its problem's tests in the sandbox, and each
configuration's summary (pass@1 with its interval, paired differences, cost from the ledger, tokens per endpoint,
migrations); the random router read off the endpoints' own rows."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from app.tools.bench import humaneval
from app.tools.bench.humaneval import Problem
from app.tools.bench.quality_stats import discordant, mcnemar_exact, paired_bootstrap, wilson
from app.tools.bench.sandbox import Limits
from app.tools.bench.sandbox import run as run_sandboxed

ENDPOINTS = ("device", "cloud")


@dataclass(frozen=True)
class Scored:
    task_id: str
    passed: bool
    verdict: str
    cost_cloud: float
    cost_device: float
    ttft_s: float | None
    seconds: float
    decode: dict  # answer tokens per endpoint role
    prefill: dict  # prompt tokens computed per endpoint role
    migrations: list  # (at_token, from, to, reason) of each completed migration
    finish_reason: str | None
    routed_to: str | None = None  # a random router's choice


def score(record: dict, problem: Problem, limits: Limits) -> Scored:
    code = humaneval.extract_code(record["answer"])
    outcome = run_sandboxed(humaneval.program(problem, code), limits) if code else None
    trace = record["trace"]
    decode, prefill = Counter(), Counter()
    for e in trace["endpoints"]:
        decode[e["endpoint"]] += e["decode_tokens"]
        prefill[e["endpoint"]] += e["prefill_tokens"]
    migrations = [(m["at_token"], m["from"], m["to"], m["reason"]) for m in trace["migrations"] if "error" not in m]
    return Scored(
        task_id=record["task_id"],
        passed=bool(outcome and outcome.passed),
        verdict=outcome.verdict if outcome else "no code",
        cost_cloud=record["cost_usd"]["cloud"],
        cost_device=record["cost_usd"]["device"],
        ttft_s=record["ttft_s"],
        seconds=record["seconds"],
        decode=dict(decode),
        prefill=dict(prefill),
        migrations=migrations,
        finish_reason=record["finish_reason"],
    )


def random_router(share: float, device: list[Scored], cloud: list[Scored], seed: int) -> list[Scored]:
    """Each problem sent to the cloud with probability `share` (seeded by seed and share), else to the device: the
    chosen endpoint's own row."""
    rng = random.Random(f"{seed}:{share:.6f}")
    rows = []
    for d, c in zip(device, cloud, strict=True):
        chosen = c if rng.random() < share else d
        rows.append(replace(chosen, routed_to="cloud" if chosen is c else "device"))
    return rows


def oracle_router(device: list[Scored], cloud: list[Scored]) -> list[Scored]:
    """The best any router between the two endpoints could do: each problem goes to the cloud only where the cloud's
    answer passes and the device's does not (a problem passes if either endpoint's answer does), so its bill is the
    cloud's on the problems only the cloud solves."""
    rows = []
    for d, c in zip(device, cloud, strict=True):
        chosen = c if c.passed and not d.passed else d
        rows.append(replace(chosen, routed_to="cloud" if chosen is c else "device"))
    return rows


def cloud_share(rows: Iterable[Scored]) -> float:
    rows = list(rows)
    cloud = sum(r.decode.get("cloud", 0) for r in rows)
    total = sum(sum(r.decode.values()) for r in rows)
    return cloud / total if total else 0.0


def summary(name: str, rows: list[Scored], references: dict[str, list[Scored]], seed: int) -> dict:
    n = len(rows)
    passed = sum(r.passed for r in rows)
    low, high = wilson(passed, n)
    ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
    reasons = Counter(m[3] for r in rows for m in r.migrations)
    out = {
        "config": name,
        "problems": n,
        "passed": passed,
        "pass_at_1": passed / n if n else 0.0,
        "wilson_95": [low, high],
        "cloud_cost_usd_per_answer": statistics.fmean(r.cost_cloud for r in rows) if n else 0.0,
        "unified_cost_usd_per_answer": statistics.fmean(r.cost_cloud + r.cost_device for r in rows) if n else 0.0,
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "decode_tokens": {role: sum(r.decode.get(role, 0) for r in rows) for role in ENDPOINTS},
        "prefill_tokens": {role: sum(r.prefill.get(role, 0) for r in rows) for role in ENDPOINTS},
        "cloud_token_share": cloud_share(rows),
        "answers_migrated": sum(bool(r.migrations) for r in rows),
        "migrations_by_reason": dict(reasons),
        "answer_seconds_total": sum(r.seconds for r in rows),
        "decode_tokens_per_s_median": _median_rate(rows),
        "finish_reasons": dict(Counter(r.finish_reason for r in rows)),
        "verdicts": dict(Counter(r.verdict for r in rows)),
        "paired": {},
    }
    for ref_name, ref in references.items():
        if ref is rows or [r.task_id for r in ref] != [r.task_id for r in rows]:
            continue
        mine, theirs = [r.passed for r in rows], [r.passed for r in ref]
        only_mine, only_theirs = discordant(mine, theirs)
        out["paired"][ref_name] = {
            "difference": (sum(mine) - sum(theirs)) / n if n else 0.0,
            "bootstrap_95": list(paired_bootstrap(mine, theirs, seed=seed)),
            "only_this": only_mine,
            "only_reference": only_theirs,
            "mcnemar_p": mcnemar_exact(only_mine, only_theirs),
        }
    return out


def _median_rate(rows: list[Scored]) -> float | None:
    """The median answer's decode rate as the client saw it: its tokens after the first over the time after it."""
    rates = [
        (sum(r.decode.values()) - 1) / (r.seconds - r.ttft_s)
        for r in rows
        if r.ttft_s is not None and r.seconds > r.ttft_s and sum(r.decode.values()) > 1
    ]
    return statistics.median(rates) if rates else None


def against_cloud(row: dict, cloud: dict) -> None:
    """The row's bill and unified cost as multiples of cloud-only's (None where cloud-only's is nothing)."""
    for key, ratio in (("cloud_cost_usd_per_answer", "bill_ratio"), ("unified_cost_usd_per_answer", "unified_ratio")):
        row[ratio] = row[key] / cloud[key] if cloud[key] > 0 else None


def random_at_same_bill(row: dict, device: dict, cloud: dict) -> float | None:
    """The pass@1 a random router scores, in expectation, for the row's cloud bill: it sends each request to the
    cloud with probability s = the row's bill / cloud-only's, so it scores the device's pass@1 plus s times the
    cloud's lead on the same problems (None when the cloud costs nothing)."""
    full = cloud["cloud_cost_usd_per_answer"]
    if full <= 0:
        return None
    share = min(1.0, row["cloud_cost_usd_per_answer"] / full)
    return device["pass_at_1"] + share * (cloud["pass_at_1"] - device["pass_at_1"])
