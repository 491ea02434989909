"""`tandem bench hat-streams`: K concurrent HAT streams through one gateway-side backend, drafting solo vs batched.

Set-up as `tandem bench hat`: a real worker subprocess (pinned to core 1, one thread) hosts the middle layers; this
process is the device half (core 0, one thread) with the shipped adapter and draft vocabulary (where the model has
them); every frame crosses the link emulator. For each K in --streams, K held-out chat prompts are decoded at once
(greedy, --tokens each) through ONE HATBackend, in each drafting mode:

- solo: `drafting = "solo"`, each stream's own model calls one at a time (the backend before the station);
- one group: the drafting station (clients/hat/station.py) with every stream in one group (lockstep);
- exact: the station's default, the grouping with the least steady round period on its fitted T(b, F)
  (policies/stream_groups.py), pipelined;
- exact, 4-row steps: the same with `draft_step_rows = "chunked"` (each draft step's rows through fixed 4-row chunks
  instead of each stream's row on its own: one chunk's cost for up to four streams);
- Alg. 1: groups from SD-edge's Alg. 1 on the same fits (the paper's step-barrier model: the baseline);
- 2 groups: the station with two fixed groups, pipelined: group 2 drafted while group 1 is at the worker.

Each (K, mode) cell: a fresh backend, one unmeasured warm-up run of the K streams (the station fits its stage times),
then --reps measured runs, modes interleaved per repetition (their order rotated each repetition, so a drift in the
shared machine's load hits every mode). Aggregate tokens/s = all streams' tokens / wall time (session set-up and
prefill included); the device's busy time per token = seconds its model thread spent in calls / tokens. Greedy:
every mode must produce the same tokens (the station's modes exactly; `solo` may differ from them only at float
near-ties), reported per cell.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from app.tools.bench.hat_setup import add_bench_options
from app.tools.bench.output import publish

# mode -> (HATOptions.drafting, the station's grouping, HATOptions.draft_step_rows)
MODES: dict[str, tuple[str, str | int | None, str]] = {
    "solo": ("solo", None, "each"),
    "one group": ("batched", "one", "each"),
    "exact": ("batched", "exact", "each"),
    "exact, 4-row steps": ("batched", "exact", "chunked"),
    "Alg. 1": ("batched", "alg1", "each"),
    "2 groups": ("batched", 2, "each"),
}
DEFAULT_OUT = Path("var/bench/hat-streams/report.md")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench hat-streams", description=__doc__.split("\n\n")[0])
    add_bench_options(p)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per stream")
    p.add_argument("--reps", type=int, default=2, help="measured runs per cell (median reported)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per stream of each cell's warm-up run")
    p.add_argument("--quick", action="store_true", help="a smoke run: K = 1 and 2, 4 tokens, one rep, no warm-up")
    p.add_argument("--json", default=None, help="also write the raw results as JSON here")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def backend_for(bench: Any, mode: str) -> Any:
    from clients.hat.device import HATBackend
    from clients.hat.options import HATOptions

    options = HATOptions(
        worker_url=bench.url,
        m=bench.args.m,
        link=bench.link,
        drafting=MODES[mode][0],
        draft_step_rows=MODES[mode][2],
        round_timeout=600.0,
        num_threads=None,  # the process's own (amain pins it to one core, or leaves torch's default)
    )
    return HATBackend(
        options,
        model_id=bench.args.model,
        adapter_path=bench.adapter,
        draft_vocab_path=bench.draft_vocab,
        model=bench.model,
        tokenizer=bench.tok,
    )


def set_grouping(backend: Any, mode: str) -> None:
    if backend.station is not None:
        backend.station.grouping = MODES[mode][1]


async def run_streams(backend: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    from clients.base import GenerationRequest

    async def one(ids: list[int]) -> list[int]:
        req = GenerationRequest(prompt_text="", prompt_ids=tuple(ids), max_tokens=tokens, temperature=0.0)
        return [ev.token_id async for ev in backend.stream(req) if ev.token_id is not None]

    rounds, produced = backend.stats.rounds, backend.stats.round_tokens
    busy0 = backend.thread.busy_seconds  # the device's busy time: solo model calls or the station's batched units
    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    total = sum(len(o) for o in outputs)
    r = backend.stats.rounds - rounds
    return {
        "tok_s": total / wall,
        "device_ms_per_token": 1e3 * (backend.thread.busy_seconds - busy0) / max(total, 1),
        "wall_s": wall,
        "tokens": total,
        "accept_length": (backend.stats.round_tokens - produced) / r if r else float("nan"),
        "outputs": outputs,
    }


async def measure(bench: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    held = bench.held_out_prompts(max(args.streams))
    rows = []
    for k in args.streams:
        prompts = held[:k]
        modes = [m for m in MODES if not (m == "2 groups" and k < 2)]
        backends = {}
        for mode in modes:
            b = backend_for(bench, mode)
            await b.start()
            set_grouping(b, mode)
            if args.warmup_tokens:  # unmeasured: caches, and the station's T(b, F) fits for Alg. 1
                await run_streams(b, prompts, args.warmup_tokens)
            backends[mode] = b
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for rep in range(args.reps):
            for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:  # rotated: drift hits every mode
                runs[mode].append(await run_streams(backends[mode], prompts, args.tokens))
                print(f"K={k} {mode}: {runs[mode][-1]['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
        station = backends["Alg. 1"].station
        alg1_groups = station.stats.widest_plan if station is not None else []
        exact = backends["exact"].station
        exact_groups = exact.stats.widest_plan if exact is not None else []
        fits = station.fits() if station is not None else None
        for b in backends.values():
            await b.close()
        ref = runs["one group"][0]["outputs"]
        row: dict[str, Any] = {"streams": k, "alg1_groups": alg1_groups, "exact_groups": exact_groups}
        row["alg1_fits"] = None if fits is None else [[f.c1, f.c2] for f in fits]
        for mode in modes:
            row[mode] = {
                "tok_s": statistics.median(r["tok_s"] for r in runs[mode]),
                "tok_s_runs": [round(r["tok_s"], 3) for r in runs[mode]],
                "accept_length": statistics.median(r["accept_length"] for r in runs[mode]),
                "device_ms_per_token": statistics.median(r["device_ms_per_token"] for r in runs[mode]),
                "same_tokens": all(r["outputs"] == ref for r in runs[mode]),
            }
        rows.append(row)
    return rows


def report(rows: list[dict[str, Any]], setup: dict[str, Any], cmd: str) -> str:
    lines = [
        "# HAT: K concurrent streams through one gateway-side backend, drafting solo vs batched",
        "",
        f"Command: `tandem bench hat-streams {cmd}`",
        "",
        f"setup: {json.dumps(setup)}",
        "",
        "Aggregate tokens/s (median of the runs; ratio to solo), accept length L, the device's busy time per token (its"
        " model thread), same tokens as `one group`:",
        "",
        "| K | " + " | ".join(MODES) + " | exact's groups | Alg. 1's groups |",
        "|---" * (len(MODES) + 3) + "|",
    ]
    for r in rows:
        solo = r["solo"]["tok_s"]
        cells = []
        for mode in MODES:
            c = r.get(mode)
            if c is None:
                cells.append("–")
                continue
            same = "" if c["same_tokens"] else " (tokens differ)"
            cells.append(
                f"{c['tok_s']:.2f} ({c['tok_s'] / solo:.2f}×), L {c['accept_length']:.2f}, "
                f"{c['device_ms_per_token']:.0f} ms{same}"
            )
        lines.append(f"| {r['streams']} | " + " | ".join(cells) + f" | {r.get('exact_groups')} | {r['alg1_groups']} |")
    last = rows[-1]
    one, alg1, exact = last["one group"]["tok_s"], last["Alg. 1"]["tok_s"], last["exact"]["tok_s"]
    lines += [
        "",
        f"K = {last['streams']}: batched (best of the station's modes) / solo = "
        f"{max(last[m]['tok_s'] for m in MODES if m in last and m != 'solo') / last['solo']['tok_s']:.2f}× "
        f"(target ≥ 1.5×); exact / one group = {exact / one:.2f}×; Alg. 1 / one group = {alg1 / one:.2f}×"
        + (f"; 2 groups / one group = {last['2 groups']['tok_s'] / one:.2f}×" if "2 groups" in last else "")
        + " (target ≥ 1.1×).",
        f"Alg. 1's fitted (device, verify) stage T(b, F) = c1·F·b + c2 at the largest K: {last['alg1_fits']}.",
    ]
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from app.tools.bench.hat_setup import Bench
    from app.tools.bench.output import cpu_name

    bench = Bench(args)
    await bench.start_worker()  # before pinning ourselves: the worker is pinned on its own
    if args.device_core >= 0:
        os.sched_setaffinity(0, {args.device_core})
        torch.set_num_threads(1)
    try:
        setup = {
            "model": args.model, "link": args.link, "tokens_per_stream": args.tokens, "reps": args.reps,
            "device_core": args.device_core, "worker_core": args.worker_core, "device_threads": torch.get_num_threads(),
            "worker_device": args.worker_device, "adapter": bench.adapter is not None, "cpu": cpu_name(),
        }  # fmt: skip
        rows = await measure(bench, args)
    finally:
        bench.stop_worker()
    return rows, setup


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        args.streams, args.tokens, args.reps, args.warmup_tokens = [1, 2], 4, 1, 0
    rows, setup = asyncio.run(amain(args))
    publish(report(rows, setup, " ".join(argv)), args.out)
    if args.json:
        for r in rows:
            for mode in MODES:
                if mode in r:
                    r[mode].pop("outputs", None)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
