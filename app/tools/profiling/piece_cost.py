"""`python -m app.tools.profiling.piece_cost`: what a lone piece of x rows after y cached positions costs the worker's
ragged forward (RaggedMiddle, one session, one torch thread by default), and how well the prefill cost τ(x | y) =
a + b·x + c·x·y + d·x² that the fair share prices pieces with (app/worker/prefill_cost.py's fit) describes it.

Why: a long-context piece once cost far more than τ said (the KV cache grown by torch.cat and the grouped K/V expanded
on every pass: per-pass costs in the context alone, which τ has no term for). This prints each grid point's best of
`--reps` passes against τ fitted on the points of at least 16 rows (as the worker fits), and with `--profile` the
ops a pass spends its time in at the largest context.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.tools.profiling.piece_cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[4, 16, 48, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 1000, 2000, 4000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="torch.profiler's op table for 16 rows at the last context")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from app.tools.bench.worker_compute import StackBench
    from app.worker.prefill_cost import fit_stage_costs
    from clients.hat.split import split_model
    from clients.hf_model import load_hf_model
    from deploy.models import model_path

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_hf_model(model_path(args.model))
    bench = StackBench(split_model(model, args.m).middle.stack, int(model.config.hidden_size), 4, seed=0)
    with torch.inference_mode():
        points = bench.tau_points(args.rows, args.contexts, args.reps)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            cache = bench.session(args.contexts[-1])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                bench.piece(cache, 16, args.reps)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    fit = fit_stage_costs([(x, y, [t]) for x, y, t in points if x >= 16], 1)
    tau = fit[0] if fit else None
    print(f"{args.model}, m = {args.m}, {args.threads} thread(s); best of {args.reps} passes")
    if tau is not None:
        print(f"τ: a = {tau.a * 1e3:.1f} ms, b = {tau.b * 1e3:.3f} ms/row, c = {tau.c * 1e6:.3f} µs/row/position, "
              f"d = {tau.d * 1e6:.2f} µs/row²")  # fmt: skip
    print("| rows x | context y | measured (ms) | τ(x | y) (ms) | τ / measured |\n|---|---|---|---|---|")
    for x, y, t in points:
        fitted = f"{tau(x, y) * 1e3:.1f} | {tau(x, y) / t:.2f}" if tau is not None else "— | —"
        print(f"| {x} | {y} | {t * 1e3:.1f} | {fitted} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
