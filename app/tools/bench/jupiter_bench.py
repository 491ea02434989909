"""`tandem bench jupiter`: prefill and decode on the staged worker (app/worker/pipeline.py) against one process.

Configurations, all on the real engine (app/worker/engine.py) in this process (stage 0) and, for the staged ones,
one real stage process (gloo over loopback):

    (i)   one process, one thread
    (ii)  one process, two threads
    (iii) two stages, one thread each, the prefill frame run as sent (sequence_partition "off")
    (iv)  two stages, the frame re-split into equal sub-sequences (the count with the least modelled makespan)
    (v)   two stages, the frame re-split by Jupiter's sequence partition DP over the stages' profiled τ_s
    (vi)  two stages, the frame re-split by the paper's own rule (min-max sub-sequences per count, the count by its
          Eq. 4; sequence_partition "paper"): the baseline (v) is measured against

Prefill: one session sends a whole prompt of N positions as one PREFILL_CHUNK frame; the time is submit → the
DEEP_STATE reply (the worker's part of TTFT), median of `--reps` after one untimed warm-up. Decode: `--devices`
sessions each with a `--context`-position prefix send 3-position verification rounds back to back and keep one
position (one accepted token per round) for `--decode-seconds`; throughput is accepted tokens per second over all
sessions. The hidden states are random: the worker's cost does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from app.tools.bench.output import publish

DEFAULT_OUT = Path("var/bench/jupiter/report.md")
CONFIGS = ("i", "ii", "iii", "iv", "v", "vi")
LABELS = {
    "i": "(i) one process, 1 thread",
    "ii": "(ii) one process, 2 threads",
    "iii": "(iii) 2 stages, no sequence partition",
    "iv": "(iv) 2 stages, equal sub-sequences",
    "v": "(v) 2 stages, DP sub-sequences",
    "vi": "(vi) 2 stages, the paper's rule",
}


def _open(engine: Any, m: int) -> Any:
    from clients.hat import wire

    params = {"hidden_size": engine.hidden_size, "num_layers": engine.num_layers, "m": m, "dtype": "float32"}
    session, _ = engine.open(wire.encode_text(wire.Kind.OPEN, bytes(16), 0, json.dumps(params)))
    return session


def _reply(fut: Any) -> Any:
    from clients.hat import wire

    frames = [wire.decode_frame(b) for b in fut.result(timeout=1800)]
    for f in frames:
        if f.kind == wire.Kind.ERROR:
            raise RuntimeError(f.text())
    return frames


def prefill_time(engine: Any, m: int, x: Any) -> float:
    from clients.hat import wire

    session = _open(engine, m)
    t0 = time.perf_counter()
    _reply(engine.submit(session, wire.encode_tensor(wire.Kind.PREFILL_CHUNK, session.id, 1, x, arg=0)))
    elapsed = time.perf_counter() - t0
    engine.close(session)
    return elapsed


def decode_throughput(engine: Any, m: int, devices: int, context: int, seconds: float) -> float:
    import torch

    from clients.hat import wire

    hidden = engine.hidden_size
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randn(context, hidden, generator=gen)
    rounds_x = torch.randn(3, hidden, generator=gen)
    start = threading.Barrier(devices + 1)
    stop = threading.Event()
    counts = [0] * devices

    def device(i: int) -> None:
        s = _open(engine, m)
        _reply(engine.submit(s, wire.encode_tensor(wire.Kind.PREFILL_CHUNK, s.id, 1, prefix, arg=0)))
        seq, pos = 2, context
        start.wait()
        while not stop.is_set():
            _reply(engine.submit(s, wire.encode_tensor(wire.Kind.DRAFT, s.id, seq, rounds_x, arg=pos)))
            _reply(engine.submit(s, wire.encode_control(wire.Kind.ROLLBACK, s.id, seq + 1, arg=pos + 1)))
            seq, pos = seq + 2, pos + 1
            counts[i] += 1
        engine.close(s)

    threads = [threading.Thread(target=device, args=(i,), daemon=True) for i in range(devices)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    done = sum(counts)
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(120)
    return done / elapsed


class Configs:
    """The single-process engine and the staged one, both up, switched per measurement (threads, partition mode)
    so that every configuration is measured in turn, rep after rep: load from other work on the machine then falls
    on all of them alike."""

    def __init__(self, single: Any, staged: Any) -> None:
        self.single, self.staged = single, staged

    def use(self, name: str) -> Any:
        import torch

        if name in ("i", "ii"):
            torch.set_num_threads(1 if name == "i" else 2)
            return self.single
        torch.set_num_threads(1)  # stage 0 is this process
        self.staged.pipeline.planner.mode = {"iii": "off", "iv": "equal", "v": "dp", "vi": "paper"}[name]
        return self.staged


def measure(configs: Configs, args: argparse.Namespace, prompts: dict[int, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {name: {"prefill": {n: [] for n in prompts}, "decode_tps": None} for name in CONFIGS}
    for name in CONFIGS:  # warm-up, and (staged) the first plan of each length
        for x in prompts.values():
            prefill_time(configs.use(name), args.m, x)
    busy: dict[str, dict[int, list[list[float]]]] = {name: {n: [] for n in prompts} for name in CONFIGS}
    for rep in range(args.reps):
        for n, x in prompts.items():
            for name in CONFIGS:
                engine = configs.use(name)
                before = list(engine.stats.stage_seconds)
                t = prefill_time(engine, args.m, x)
                after = list(engine.stats.stage_seconds)
                if after:
                    busy[name][n].append([a - b for a, b in zip(after, before or [0.0] * len(after), strict=True)])
                results[name]["prefill"][n].append(t)
                print(f"rep {rep} prefill {n} {LABELS[name]}: {t:.2f} s", file=sys.stderr, flush=True)
    for name, r in results.items():
        r["prefill"] = {
            n: {
                "median": statistics.median(ts),
                "all": ts,
                # each stage's compute seconds for the prompt (median over reps): what the stages cost each other
                "stage_busy": [statistics.median(col) for col in zip(*busy[name][n], strict=True)] or None,
            }
            for n, ts in r["prefill"].items()
        }
    for name in ("i", "ii", "v"):
        engine = configs.use(name)
        results[name]["decode_tps"] = decode_throughput(engine, args.m, args.devices, args.context, args.decode_seconds)
        print(f"decode {LABELS[name]}: {results[name]['decode_tps']:.1f} tokens/s", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench jupiter", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--lengths", default="1024,2048", help="prompt lengths, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--context", type=int, default=128, help="decode: each device's prefix")
    p.add_argument("--decode-seconds", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="SmolLM2, prompts of 64 and 128, one rep, short decode")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.lengths, args.reps, args.decode_seconds = "smollm2-135m-instruct", "64,128", 1, 0.5
        args.context = 16
    lengths = [int(v) for v in args.lengths.split(",")]

    import torch

    from app.worker.engine import Engine
    from app.worker.server import Worker
    from app.worker.settings import WorkerSettings
    from clients.hat.split import split_model
    from clients.hf_model import load_hf_model
    from deploy.models import model_path

    torch.set_num_threads(1)
    model, _ = load_hf_model(model_path(args.model))
    hidden = int(model.config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randn(n, hidden, generator=gen) for n in lengths}

    middle = split_model(model, args.m).middle
    single = Engine(middle, WorkerSettings(model=args.model, m=args.m), model_name=args.model)
    single.start()
    settings = WorkerSettings(
        model=args.model, m=args.m, stages=2, stage_threads=[1, 1], sequence_partition="off",
        stage_probe_rounds=1 if args.quick else 3,  # --quick checks the run, not the balance of the split
    )  # fmt: skip
    try:
        staged = Worker(settings, model)._build()
    except BaseException:
        single.stop()
        raise
    pipeline = staged.pipeline
    try:
        results = measure(Configs(single, staged), args, prompts)
        plans: dict[str, dict[int, list[int]]] = {}
        for name, mode in (("iv", "equal"), ("v", "dp"), ("vi", "paper")):
            pipeline.planner.mode = mode
            plans[name] = {n: pipeline.planner.lengths(n, 0) for n in lengths}
    finally:
        staged.stop()
        single.stop()
    costs = [vars(c) for c in pipeline.planner.costs]

    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    report = render(args, lengths, results, plans, list(pipeline.bounds), costs, cmd)
    publish(report, args.out)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "model": args.model,
                "lengths": lengths,
                "results": results,
                "plans": plans,
                "stage_layers": list(pipeline.bounds),
                "costs": costs,
            },
            indent=1,
        )
    )
    return 0


def render(args, lengths, results, plans, bounds, costs, cmd) -> str:
    base = {n: results["iii"]["prefill"][n]["median"] for n in lengths}
    lines = [
        "# Jupiter: the staged worker's prefill and decode",
        "",
        f"Command: `tandem bench jupiter {cmd}`",
        "",
        f"{args.model}, middle layers m = {args.m}..; stage layers {bounds}; one prompt frame of N positions, "
        f"median of {args.reps} (configurations interleaved) after a warm-up; decode: {args.devices} devices, "
        "3-position rounds, 1 kept.",
        "",
        "| configuration | " + " | ".join(f"prefill {n} | vs (iii)" for n in lengths) + " | decode, tokens/s |",
        "|---|" + "---|---|" * len(lengths) + "---|",
    ]
    for name in CONFIGS:
        r = results[name]
        cells = []
        for n in lengths:
            t = r["prefill"][n]["median"]
            cells += [f"{t:.2f} s", f"{t / base[n]:.2f}×"]
        tps = f"{r['decode_tps']:.1f}" if r["decode_tps"] is not None else "—"
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + f" | {tps} |")
    lines += [
        "",
        "Compute seconds per stage for one prompt (median), staged configurations: the pipeline hides one stage "
        "behind the other only when the stages get a core each.",
        "",
    ]
    for name in ("iii", "iv", "v", "vi"):
        for n in lengths:
            b = results[name]["prefill"][n]["stage_busy"]
            if b:
                lines.append(
                    f"- {LABELS[name]}, N = {n}: " + ", ".join(f"stage {s} {v:.2f} s" for s, v in enumerate(b))
                )
    lines += ["", "Sub-sequences stage 0 cut a whole-prompt frame into:"]
    for name in ("iv", "v", "vi"):
        for n in lengths:
            lines.append(f"- {LABELS[name]}, N = {n}: {plans[name][n]}")
    lines += ["", "Profiled τ_s(x | y) = a + b·x + c·x·y + d·x² per stage (s): " + "; ".join(
        f"stage {s}: a={c['a']:.3g} b={c['b']:.3g} c={c['c']:.3g} d={c['d']:.3g}" for s, c in enumerate(costs)
    )]  # fmt: skip
    if len(lengths) >= 2:
        first, second = lengths[0], lengths[1]
        v1 = results["v"]["prefill"][first]["median"] / base[first]
        v_vs_paper = [results["v"]["prefill"][n]["median"] / results["vi"]["prefill"][n]["median"] for n in lengths]
        v_vs_iv = results["v"]["prefill"][second]["median"] / results["iv"]["prefill"][second]["median"]
        lines += [
            "",
            f"Targets: (v) ≤ 0.65× (iii) at {first}: {v1:.2f}× ({'met' if v1 <= 0.65 else 'missed'}); "
            f"(v) ≤ (iv) at {second}: {v_vs_iv:.2f}× ({'met' if v_vs_iv <= 1.0 else 'missed'}). "
            "(v) against the paper's rule (vi): "
            + ", ".join(f"{r:.2f}× at {n}" for n, r in zip(lengths, v_vs_paper, strict=True))
            + ".",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
