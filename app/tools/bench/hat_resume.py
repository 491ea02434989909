"""`tandem bench hat-resume`: how long a HAT session takes to resume on another worker when its worker dies,
against the context it must rebuild there.

Two real `tandem worker` processes on loopback (app/embedded.py's EmbeddedWorker, as the gateway starts them) and
one device half in this process over both (`worker_urls`, clients/hat/pool.py). For each context length, a greedy
answer to a prompt of that many tokens; once `--kill-after` tokens are delivered, the worker serving the session is
killed (SIGKILL: a crash, not a drain) and the clock runs until the next token arrives: the dead link noticed, an
OPEN on the other worker, the delivered context (prompt + tokens so far) prefilled there again from the token ids
the device holds, and the round that yields the token. Beside it, the answer's own first token (the same prefill
on a fresh session) and its median step before the kill. The killed worker is started again before the next run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import sys
import time
from typing import Any

from app.tools.bench.output import publish

TEXT = "The workers in a pool share the sessions of many devices, and any of them may fail at any time. "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench hat-resume", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024], help="prompt lengths (tokens)")
    p.add_argument("--reps", type=int, default=3, help="runs per context length")
    p.add_argument("--kill-after", type=int, default=4, help="tokens delivered before the worker is killed")
    p.add_argument("--chunk-size", type=int, default=64, help="the device half's prefill chunk size")
    p.add_argument("--out", default="var/bench/hat_resume.md")
    return p


async def one_run(backend: Any, workers: list[Any], ids: list[int], kill_after: int) -> dict[str, float]:
    from clients.base import GenerationRequest

    request = GenerationRequest(prompt_text="", prompt_ids=tuple(ids), max_tokens=kill_after + 2, temperature=0.0)
    stamps: list[float] = []
    killed_at = resumed = 0.0
    started = time.perf_counter()
    async for _ in backend.stream(request):
        stamps.append(time.perf_counter())
        if len(stamps) == kill_after:
            [serving] = [w for w in backend.pool.workers if w.sessions]
            [victim] = [w for w in workers if w.url == serving.url]
            os.killpg(victim.process.pid, signal.SIGKILL)
            killed_at = time.perf_counter()
        elif len(stamps) == kill_after + 1:
            resumed = time.perf_counter() - killed_at
    steps = [b - a for a, b in itertools.pairwise(stamps[:kill_after])]
    step = statistics.median(steps) if steps else float("nan")
    return {"resume_s": resumed, "step_s": step, "ttft_s": stamps[0] - started}


async def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    from app.config import EmbeddedWorkerSettings
    from app.embedded import EmbeddedWorker
    from clients.hat.device import HATBackend
    from clients.hat.options import HATOptions
    from clients.hf_model import load_hf_model
    from deploy.models import resolve_model

    model, tok = load_hf_model(resolve_model(args.model))
    settings = EmbeddedWorkerSettings(num_threads=1)
    workers = [EmbeddedWorker(settings, args.model, args.m, None) for _ in range(2)]
    for w in workers:
        w.start()
    await asyncio.gather(*(w.wait_ready() for w in workers))
    base = tok.encode(TEXT * (1 + max(args.contexts) // 16), add_special_tokens=False)
    rows: list[dict[str, Any]] = []
    try:
        for length in args.contexts:
            runs = []
            for _ in range(args.reps):
                options = HATOptions(worker_urls=tuple(w.url for w in workers), chunk_size=args.chunk_size)
                backend = HATBackend(options, model_id=args.model, model=model, tokenizer=tok)
                await backend.start()
                try:
                    runs.append(await one_run(backend, workers, base[:length], args.kill_after))
                finally:
                    await backend.close()
                for i, w in enumerate(workers):  # the killed one back, as a supervisor would restart it
                    if w.process is not None and w.process.poll() is not None:
                        workers[i] = EmbeddedWorker(settings, args.model, args.m, None)
                        workers[i].start()
                        await workers[i].wait_ready()
            rows.append(
                {
                    "context": length,
                    "resume_ms": [round(r["resume_s"] * 1e3, 1) for r in runs],
                    "step_ms": statistics.median(r["step_s"] for r in runs) * 1e3,
                    "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.stop()
    return rows, f"{args.model}, m = {args.m}, one torch thread per worker"


def report(
    rows: list[dict[str, Any]], setup: str, args: argparse.Namespace, load: tuple[float, ...], started: str
) -> str:
    cmd = f"tandem bench hat-resume --contexts {' '.join(map(str, args.contexts))} --reps {args.reps}"
    lines = [
        f"    {cmd}",
        "",
        f"{started}, {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} at the start; {setup}; killed after {args.kill_after} delivered tokens.",
        "",
        "| context (tokens) | resume, median (ms) | runs (ms) | the answer's first token (ms) "
        "| step before the kill (ms) | resume / first token |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        median = statistics.median(r["resume_ms"])
        runs = ", ".join(f"{x:.0f}" for x in r["resume_ms"])
        lines.append(
            f"| {r['context']} | **{median:.0f}** | {runs} | {r['ttft_ms']:.0f} | {r['step_ms']:.0f} "
            f"| {median / r['ttft_ms']:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    rows, setup = asyncio.run(measure(args))
    publish(report(rows, setup, args, load, started), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
