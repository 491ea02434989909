"""`tandem bench fair-share`: what one session flooding a HAT worker costs another session's rounds.

A real `tandem worker` process on loopback (app/embedded.py's EmbeddedWorker), two raw sessions over the WebSocket
protocol. The measured session runs verification rounds of `--draft` rows (DRAFT, its VERIFY_RESULT, a ROLLBACK so
its context stays put) and times each: first alone (its usual round), then for as long as the other session's
`--flood` drafts of 1 MiB each, sent at once (the issue's case: forty), are at the worker. The worker runs once with
`batching = "greedy"` (whole frames in every pass: the behaviour before fair share, which planned batching also had
for drafts) and once with `"planned"`, the default, whose deficit round robin (policies/fair_share.py) runs the
flood in pieces priced in time (rows and the context they attend over), and holds a pass of only the flood's pieces
while the measured session's next round is due. The flood's frames past the session's backlog or context limits
are refused, as they would be.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from app.tools.bench.output import publish


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench fair-share", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--flood", type=int, default=40, help="1 MiB drafts the flooding session sends at once")
    p.add_argument("--draft", type=int, default=4, help="rows of the measured session's drafts")
    p.add_argument("--rounds", type=int, default=12, help="rounds measured alone")
    p.add_argument("--modes", nargs="+", default=["greedy", "planned"], choices=["greedy", "planned"])
    p.add_argument("--out", default="var/bench/fair_share.md")
    return p


async def _open(url: str, info: dict[str, Any]) -> tuple[Any, bytes]:
    from websockets.asyncio.client import connect

    from clients.hat import wire

    ws = await connect(url + "/v1/hidden/ws", max_size=None, compression=None)
    params = {k: info[k] for k in ("hidden_size", "num_layers", "m", "dtype")}
    await ws.send(wire.encode_text(wire.Kind.OPEN, bytes(16), 0, json.dumps(params)))
    return ws, wire.decode_frame(await ws.recv()).session


async def _rounds(ws: Any, sid: bytes, seq: int, hidden: int, rows: int, count: int) -> tuple[list[float], int]:
    """`count` verification rounds at position 0 (a ROLLBACK after each): their seconds, and the next seq."""
    import torch

    from clients.hat import wire

    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        await ws.send(wire.encode_tensor(wire.Kind.DRAFT, sid, seq, torch.randn(rows, hidden), arg=0))
        while wire.decode_frame(await ws.recv()).kind == wire.Kind.STATUS:
            pass
        times.append(time.perf_counter() - t0)
        await ws.send(wire.encode_control(wire.Kind.ROLLBACK, sid, seq + 1, arg=0))
        seq += 2
    return times, seq


async def _one_mode(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import torch

    from clients.hat import wire

    async with httpx.AsyncClient(timeout=10) as http:
        info = (await http.get(url.replace("ws://", "http://") + "/health/ready")).json()
    hidden = info["hidden_size"]
    (victim, vsid), (flooder, fsid) = [await _open(url, info) for _ in range(2)]
    await _rounds(victim, vsid, 1, hidden, args.draft, 3)  # warm-up
    alone, seq = await _rounds(victim, vsid, 7, hidden, args.draft, args.rounds)
    rows = (1 << 20) // (hidden * 4)
    frames = [
        wire.encode_tensor(wire.Kind.DRAFT, fsid, 1 + i, torch.randn(rows, hidden), arg=rows * i)
        for i in range(args.flood)
    ]
    for frame in frames:
        await flooder.send(frame)
    replies = asyncio.create_task(_replies(flooder, len(frames)))
    flooded: list[float] = []
    while not replies.done() and len(flooded) < 500:  # rounds for as long as the flood is at the worker
        times, seq = await _rounds(victim, vsid, seq, hidden, args.draft, 1)
        flooded += times
    ran = sum(r.kind == wire.Kind.VERIFY_RESULT for r in await replies)
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(url.replace("ws://", "http://") + "/metrics")).text
    budget = next(line.split()[-1] for line in metrics.splitlines() if line.startswith("tandem_worker_subchunk_budget"))
    quantum = next(line.split()[-1] for line in metrics.splitlines() if line.startswith("tandem_worker_fair_quantum"))
    for ws in (victim, flooder):
        await ws.close()
    return {
        "alone_ms": statistics.median(alone) * 1e3,
        "flood_ms": statistics.median(flooded) * 1e3,
        "flood_mean_ms": statistics.fmean(flooded) * 1e3,
        "flood_max_ms": max(flooded) * 1e3,
        "flood_rounds": len(flooded),
        "ran": ran,
        "rows": rows,
        "quantum": float(budget),
        "quantum_ms": float(quantum) * 1e3,
    }


async def _replies(ws: Any, count: int) -> list[Any]:
    from clients.hat import wire

    return [wire.decode_frame(await ws.recv()) for _ in range(count)]


async def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from app.config import EmbeddedWorkerSettings
    from app.embedded import EmbeddedWorker

    results = {}
    for batching in args.modes:
        os.environ["TANDEM_WORKER__BATCHING"] = batching  # the worker's environment is this process's
        worker = EmbeddedWorker(EmbeddedWorkerSettings(num_threads=1), args.model, args.m, None)
        worker.start()
        try:
            await worker.wait_ready()
            results[batching] = await _one_mode(worker.url, args)
        finally:
            worker.stop()
            del os.environ["TANDEM_WORKER__BATCHING"]
        print(batching, results[batching], file=sys.stderr, flush=True)
    return results


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, load: tuple[float, ...], started: str) -> str:
    any_ = next(iter(results.values()))
    lines = [
        f"    tandem bench fair-share --flood {args.flood} --rounds {args.rounds}",
        "",
        f"{started}, {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} at the start; {args.model}, m = {args.m}, one torch thread; the flood: {args.flood} drafts of "
        f"{any_['rows']} rows (1 MiB) at once; the measured session: rounds of {args.draft} rows.",
        "",
        "| worker batching | round alone, median (ms) | rounds during the flood | median (ms) | mean (ms) | max (ms) "
        "| median / alone | max / alone | flood frames run | sub-chunk budget (rows) | fair quantum (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['alone_ms']:.0f} | {r['flood_rounds']} | {r['flood_ms']:.0f} | {r['flood_mean_ms']:.0f} "
            f"| {r['flood_max_ms']:.0f} | **{r['flood_ms'] / r['alone_ms']:.1f}×** "
            f"| **{r['flood_max_ms'] / r['alone_ms']:.1f}×** | {r['ran']} of {args.flood} | {r['quantum']:.0f} "
            f"| {r['quantum_ms']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    results = asyncio.run(measure(args))
    publish(report(results, args, load, started), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
