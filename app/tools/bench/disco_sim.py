"""`tandem bench disco`: replay a request trace through DiSCo's policies and the paper's baselines.

Why a simulator: the paper's claims (§5, Tables 2-3, Fig. 7) are about
distributions over thousands of requests and every budget b ∈ [0, 1]; a live run
cannot sweep that. The simulator runs the *same* policy objects as the gateway
(`policies.dispatch`, `policies.migration`, `policies.estimate`, `policies.cost`);
it only supplies the clock and the endpoints' timings from the trace.

The pieces: app/tools/bench/disco_trace.py (synthetic and recorded traces), disco_replay.py (what one request
does; every policy x budget x migration), disco_report.py (tables, acceptance numbers, plots, JSON) and
disco_timing.py (`--timing`: policy compute time instead).

Recorded traces (`--trace FILE`): JSON Lines written from the live gateway, one
request per line:

    {"arrival": 12.5, "prompt_tokens": 57, "server_ttft": 0.41, "device_ttft": 0.77, "output_tokens": 128}

arrival: seconds (any origin; used for ordering); prompt_tokens, output_tokens:
integers; server_ttft / device_ttft: seconds from the endpoint's start to its
first token, or null when that endpoint did not run to its first token. Null
server TTFTs are drawn (seeded) from the recorded ones — server TTFT does not
depend on prompt length (Table 1); null device TTFTs come from the least-squares
line over the recorded ones (or the device preset when there are none).
Optional "server_ttft_migration": the cloud TTFT to use if this request migrates
to the cloud (else another seeded draw from the recorded TTFTs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.tools.bench.disco_replay import BUDGETS, SimConfig, run_bench
from app.tools.bench.disco_report import write_report
from app.tools.bench.disco_timing import timing
from app.tools.bench.disco_trace import DEVICE_PRESETS, SERVER_PRESETS, load_trace, synthetic_trace
from policies.cost import PAPER_LAMBDA_DEVICE_CONSTRAINED, PAPER_LAMBDA_SERVER_CONSTRAINED
from policies.dispatch import DEFAULT_ALPHA
from policies.migration import READING_RATE

DEFAULT_OUT = Path("var/bench/disco")


def _parse_budgets(text: str) -> tuple[float, ...]:
    vals = tuple(float(x) for x in text.split(",") if x.strip())
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError("budgets must be comma-separated numbers in [0, 1]")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench disco", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, help="JSONL trace recorded by the gateway (default: synthetic)")
    p.add_argument("-n", "--requests", type=int, default=10_000, help="synthetic trace size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", choices=sorted(SERVER_PRESETS), default="gpt", help="cloud TTFT + price preset")
    p.add_argument("--device", choices=sorted(DEVICE_PRESETS), default="xiaomi14-qwen0.5b")
    p.add_argument("--prompt-median", type=float, default=48.0)
    p.add_argument("--prompt-sigma", type=float, default=0.6)
    p.add_argument("--output-median", type=float, default=150.0)
    p.add_argument("--output-sigma", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--server-tps", type=float, default=80.0, help="cloud decode speed, tokens/s")
    p.add_argument("--rc", type=float, default=READING_RATE, help="client consumption rate r_c, tokens/s")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="DiSCo-D tail ratio α")
    p.add_argument("--budgets", type=_parse_budgets, default=BUDGETS, help="comma-separated b values")
    p.add_argument("--calibration", type=int, default=2000, help="synthetic calibration requests")
    p.add_argument("--recompute-every", type=int, default=500)
    p.add_argument("--lambda-server", type=float, default=PAPER_LAMBDA_SERVER_CONSTRAINED, help="USD/PFLOP")
    p.add_argument("--lambda-device", type=float, default=PAPER_LAMBDA_DEVICE_CONSTRAINED, help="USD/PFLOP")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--timing", action="store_true", help="measure policy compute time instead")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    command = "tandem bench disco " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.timing:
        table = timing(seed=args.seed)
        args.out.mkdir(parents=True, exist_ok=True)
        text = f"# DiSCo policy compute time\n\nCommand: `{command}`\n\n{table}\n"
        (args.out / "timing.md").write_text(text, encoding="utf-8")
        print(text)
        return 0

    server, device = SERVER_PRESETS[args.server], DEVICE_PRESETS[args.device]
    cfg = SimConfig(
        r_c=args.rc,
        max_tokens=args.max_tokens,
        server_decode_tps=args.server_tps,
        device_decode_tps=device.decode_tps,
        alpha=args.alpha,
        recompute_every=args.recompute_every,
    )
    gen = dict(
        server=server,
        device=device,
        prompt_median=args.prompt_median,
        prompt_sigma=args.prompt_sigma,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        max_tokens=args.max_tokens,
    )
    try:
        if args.trace:
            trace = load_trace(args.trace, seed=args.seed, device=device)
            calibration = trace
        else:
            trace = synthetic_trace(args.requests, seed=args.seed, **gen)
            calibration = synthetic_trace(args.calibration, seed=args.seed + 10_000, **gen)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    regimes = run_bench(
        trace,
        calibration,
        cfg,
        server=server,
        budgets=args.budgets,
        regimes=(("server-constrained", args.lambda_server), ("device-constrained", args.lambda_device)),
        seed=args.seed,
        progress=not args.quiet,
    )
    path = write_report(regimes, trace, cfg, args.out, args.budgets, command, plots=not args.no_plots)
    print(path.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
