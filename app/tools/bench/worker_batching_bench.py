"""`tandem bench worker-batching`: decode rounds during long prefills on the real worker engine, planned vs greedy.

Load: `--decoders` sessions each sending 3-position verification rounds back to back (no device time between
rounds), and one session that prefills a `--prompt`-token prompt as `--chunk`-token PREFILL_CHUNK frames sent at
once (the device's pipelined upload), waits for the last DEEP_STATE (its TTFT at the worker), closes and starts
again, `--prompts` times. The hidden states are random (the worker's cost does not depend on their values); the
engine is the real one (app/worker/engine.py) on the real middle layers, in this process, no network.

Reported per batching mode: decode round time (submit → reply, what the device sees as its time between tokens at
the worker) while a prefill is in flight, median and p90, and the prefiller's TTFT, median.

`--decode-only SECONDS`: no prefiller; the decoders alone for that long after the warm-up, and the rounds they
complete per second (pure-decode throughput: the planner must not cost it against greedy packing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from app.tools.bench.output import publish
from app.worker.settings import EngineLimits

DEFAULT_OUT = Path("var/bench/worker-batching/report.md")


def run_mode(middle, batching: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from app.worker.engine import Engine
    from clients.hat import wire

    engine = Engine(
        middle,
        EngineLimits(
            max_sessions=8,
            batching=batching,
            subchunk_overhead=args.overhead,
            max_defer=args.max_defer,
            fair_slowdown=args.fair_slowdown or None,
        ),
        model_name=args.model,
    )
    engine.start()
    hidden = engine.hidden_size
    params = {"hidden_size": hidden, "num_layers": engine.num_layers, "m": args.m, "dtype": "float32"}

    def open_session():
        s, _ = engine.open(wire.encode_text(wire.Kind.OPEN, bytes(16), 0, json.dumps(params)))
        return s

    gen = torch.Generator().manual_seed(0)
    rounds_x = torch.randn(3, hidden, generator=gen)
    prompt_x = torch.randn(args.prompt, hidden, generator=gen)
    prefilling = threading.Event()
    done = threading.Event()
    rounds: list[float] = []
    completed = [0]  # rounds answered after the warm-up (decode-only throughput)
    counting, count_lock = threading.Event(), threading.Lock()

    def decoder() -> None:
        s = open_session()
        seq, pos = 1, 0
        engine.submit(s, wire.encode_tensor(wire.Kind.PREFILL_CHUNK, s.id, seq, rounds_x, arg=0)).result(600)
        seq, pos = 2, 3
        while not done.is_set():
            t0 = time.perf_counter()
            during = prefilling.is_set()
            engine.submit(s, wire.encode_tensor(wire.Kind.DRAFT, s.id, seq, rounds_x, arg=pos)).result(600)
            if during and prefilling.is_set():
                rounds.append(time.perf_counter() - t0)
            if counting.is_set():
                with count_lock:
                    completed[0] += 1
            seq += 1
            # keep 1 of the 3 positions (one accepted token per round), as a device would after rejecting drafts
            engine.submit(s, wire.encode_control(wire.Kind.ROLLBACK, s.id, seq, arg=pos + 1)).result(600)
            seq, pos = seq + 1, pos + 1
        engine.close(s)

    threads = [threading.Thread(target=decoder, daemon=True) for _ in range(args.decoders)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    if args.decode_only:
        counting.set()
        time.sleep(args.decode_only)
        counting.clear()
    ttfts = []
    for _ in range(0 if args.decode_only else args.prompts):
        s = open_session()
        prefilling.set()
        t0 = time.perf_counter()
        futs = []
        for seq, start in enumerate(range(0, args.prompt, args.chunk), start=1):
            chunk = prompt_x[start : start + args.chunk]
            futs.append(engine.submit(s, wire.encode_tensor(wire.Kind.PREFILL_CHUNK, s.id, seq, chunk, arg=start)))
        futs[-1].result(600)
        ttfts.append(time.perf_counter() - t0)
        prefilling.clear()
        engine.close(s)
        time.sleep(args.gap)
    done.set()
    for t in threads:
        t.join(60)
    st = engine.stats
    engine.stop()
    rounds.sort()
    return {
        "rounds": len(rounds),
        "tbt_p50": statistics.median(rounds) if rounds else float("nan"),
        "tbt_p90": rounds[int(0.9 * (len(rounds) - 1))] if rounds else float("nan"),
        "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"),
        "rounds_per_s": completed[0] / args.decode_only if args.decode_only else float("nan"),
        "split": st.split_frames,
        "subchunks": st.subchunk_passes,
        "budget": st.subchunk_budget,
        "deferred": st.deferred_frames,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench worker-batching", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument(
        "--config",
        default=None,
        help="random weights of this config.json's architecture instead of the "
        "model's own (a GPU machine without the weights: a pass's time does not depend on them)",
    )
    p.add_argument("--device", default="cpu", help="where the middle layers compute: cpu, cuda or auto")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256, help="the device's PREFILL_CHUNK size")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--gap", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    knobs = EngineLimits.model_fields
    p.add_argument(
        "--overhead",
        type=float,
        default=knobs["subchunk_overhead"].default,
        help="planned: the worker's subchunk_overhead ε",
    )
    p.add_argument("--max-defer", type=int, default=knobs["max_defer"].default, help="planned: the worker's max_defer")
    p.add_argument("--fair-slowdown", type=float, default=knobs["fair_slowdown"].default,
                   help="planned: the worker's fair_slowdown (0: off)")  # fmt: skip
    p.add_argument("--decode-only", type=float, default=0.0, help="seconds of decoders alone (throughput); 0 = off")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    import torch

    from app.worker.compute import compute_device
    from clients.hat.split import split_model

    torch.set_num_threads(args.threads)
    device = compute_device(args.device)
    if args.config:
        from app.tools.bench.worker_compute import random_model

        model = random_model(Path(args.config), torch.float32, device)
    else:
        from clients.hf_model import load_hf_model
        from deploy.models import model_path

        model, _ = load_hf_model(model_path(args.model))
    middle = split_model(model, args.m).middle.to(device)
    label = f"{args.config} (random weights) on {device}" if args.config else args.model
    res = {mode: run_mode(middle, mode, args) for mode in ("greedy", "planned")}
    g, pl = res["greedy"], res["planned"]
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    if args.decode_only:
        lines = [
            "# Worker batching: pure-decode throughput, planned vs greedy",
            "",
            f"Command: `tandem bench worker-batching {cmd}`",
            "",
            f"{label} middle layers on {args.threads} thread(s); {args.decoders} decoding sessions (3-position "
            f"rounds, back to back), {args.decode_only:g} s per mode after a {args.warmup:g} s warm-up.",
            "",
            "| measurement | greedy | planned | planned / greedy | target |",
            "|---|---|---|---|---|",
            f"| rounds per second (all sessions) | {g['rounds_per_s']:.2f} | {pl['rounds_per_s']:.2f} | "
            f"{pl['rounds_per_s'] / g['rounds_per_s']:.3f}× | 0.95-1.05× |",
        ]
        publish("\n".join(lines), args.out)
        return 0
    lines = [
        "# Worker batching: decode rounds during long prefills, planned vs greedy",
        "",
        f"Command: `tandem bench worker-batching {cmd}`",
        "",
        f"{label} middle layers on {args.threads} thread(s); {args.decoders} decoding sessions (3-position "
        f"rounds), one session prefilling {args.prompt}-token prompts in {args.chunk}-token frames, "
        f"{args.prompts} prompts per mode.",
        "",
        "| measurement | greedy | planned | planned / greedy | target |",
        "|---|---|---|---|---|",
        f"| decode round during prefill, p50 | {g['tbt_p50'] * 1e3:.0f} ms | {pl['tbt_p50'] * 1e3:.0f} ms | "
        f"{pl['tbt_p50'] / g['tbt_p50']:.2f}× | ≤ 0.5× |",
        f"| decode round during prefill, p90 | {g['tbt_p90'] * 1e3:.0f} ms | {pl['tbt_p90'] * 1e3:.0f} ms | "
        f"{pl['tbt_p90'] / g['tbt_p90']:.2f}× | |",
        f"| prefiller TTFT, p50 | {g['ttft_p50']:.2f} s | {pl['ttft_p50']:.2f} s | "
        f"{pl['ttft_p50'] / g['ttft_p50']:.2f}× | ≤ 1.3× |",
        f"| rounds measured | {g['rounds']} | {pl['rounds']} | | |",
        "",
        f"Planned (subchunk_overhead {args.overhead}, max_defer {args.max_defer}, fair_slowdown "
        f"{args.fair_slowdown or 'off'}): "
        f"sub-chunk budget from g {pl['budget']} tokens, "
        f"{pl['split']} frames split into "
        f"{pl['subchunks']} sub-chunks, {pl['deferred']} deferrals.",
    ]
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
