"""`tandem bench hat`: HAT end to end — Table 5 ablation, Table 4, component times, link sweep, and
the worker's throughput with and without continuous batching.

Set-up (one run): a real worker (`tandem worker`, a subprocess) hosts the middle layers; this process is the
device half (clients.hat.device.HATBackend with the shipped adapter and reduced draft vocabulary). By default
the worker is pinned to core 1 and the device half to core 0, one torch thread each, so the two halves never
compete for a core. Every device <-> worker frame goes through the link emulator (clients/hat/link.py;
default 20 ms RTT, 7.5 MB/s up, 12.5 MB/s down: the middle of HAT's target 5-10 / 10-15 MB/s ranges).

With `--worker-device auto` (the default) the worker computes on a CUDA GPU when torch sees one, which is the
paper's regime (a cloud much faster than the device); the device half stays on the CPU. `--worker-url` points
the device half at a worker started elsewhere (e.g. on a GPU machine) instead.

Sections (`--sections`, all by default):
- table5: for each prompt length, the six SD / PC / PD combinations of the paper's Table 5 on --table5-prompts
  code-reading prompts (6 a length: 24 over the default four lengths), one greedy request per prompt and
  combination, interleaved: the medians over the prompts of TTFT (request to first token, session set-up included)
  and TBT (mean time per token after the first).
- table4: accept length (tokens per verification round) and decode speedup (U-shape TBT / HAT TBT) on the first
  --table4-prompts (24) held-out prompts of deploy/adapter_prompts.txt, SD alone, as in the paper's Table 4 (the
  first 8 alone were an easy sample: accept 2.15 where the first 16 gave 1.90); with --table4-ahead also SD drafting
  ahead inside the wait (proactive and parallel drafting), with --table4-no-lookup also SD without its lookup branch
  (lookup_tokens = 0); every configuration's requests interleaved prompt by prompt. Under it, each
  method's rounds' profile (input layers, drafts, head, link, worker: where a round's time went, and the
  bottleneck), which `bench worker-compute --project --hat` takes from the --out JSON.
- components: the device's input submodel, draft step (reduced and full vocabulary), LM head; the worker's
  middle compute per token count (timed as loopback round trips on a raw session, minus the loopback's own
  round trip); the link model's upload / download time for the same payloads.
- sweep: TBT of U-shape / SD / SD+PD over RTT, and TTFT without / with chunking over upload bandwidth: where
  each strategy starts to win.
- draft_length: TBT of SD+PC with each draft-length rule (eta / eq7 / eq7+eta) at each of --draft-length-rtt-ms,
  one warm-up and one measured request per cell.
- chunks: TTFT of the Table 5 prompts as one frame, as Eq. 3's equal chunks and as Jupiter's DP chunks over the
  device -> link -> worker pipeline (HATOptions.chunking = "dp").
- trees: chains vs token trees of --tree-widths positions (SD alone), accept length and median TBT on the held-out
  chat prompts and on code-reading prompts of --tree-code-lengths tokens, with U-shape in the same run.
- widths, eq7, defaults (issue 14's bench spec (b)-(d); app/tools/bench/hat_spec.py, run only when named): a live sweep
  over verification widths with ARCA's pick and Ghidorah's decomposition; the Eq. 7 controller against fixed draft
  lengths at several RTTs; Tables 4 and 5 with the profile-driven configuration. They plan from --profile, or from
  a `tandem profile` run at their start against this bench's worker and link.
- throughput: 1, 4 and 8 devices (raw protocol clients replaying real shallow states, so the devices' own
  compute does not bound the measurement) decoding concurrently (continuous batching) vs one at a time.

Greedy decoding throughout (HAT's output is then exactly the U-shape's, so the configurations produce the same
text and differ only in time). Results: printed tables (Markdown) and --out JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

import torch

from app.tools.bench.hat_sections import (
    DRAFT_LENGTH_MODES,
    TABLE4_EXTRAS,
    chunks,
    components,
    draft_length,
    sweep,
    table4,
    table5,
    throughput,
    trees,
)
from app.tools.bench.hat_setup import TABLE5, U_SHAPE, Bench, RawDevice, add_bench_options
from app.tools.bench.hat_spec import defaults, eq7, report_defaults, report_eq7, report_widths, widths
from app.tools.bench.output import cpu_name, write_json
from clients.hat.options import PROFILE_PARTS


def _differing(row: dict[str, Any]) -> str:
    """A Table 4 row's prompts whose tokens differ from U-shape's ("—" for runs from before the count)."""
    return str(row["prompts_differing"]) if "prompts_differing" in row else "—"


def report(results: dict[str, Any]) -> str:
    lines = []
    setup = results["setup"]
    lines.append(f"setup: {json.dumps(setup)}")
    if "table5" in results:
        rows = results["table5"]
        lines += ["", f"Table 5 (medians over {rows[0]['prompts']} code-reading prompts a length, one greedy request "
                  "each; TTFT ms / TBT ms; ratio to U-shape at that length)", "",
                  "| prompt | " + " | ".join(v.name for v in TABLE5) + " |",
                  "|---" * (len(TABLE5) + 1) + "|"]  # fmt: skip
        for length in sorted({r["prompt_tokens"] for r in rows}):
            cells = {r["variant"]: r for r in rows if r["prompt_tokens"] == length}
            base = cells[U_SHAPE.name]
            out = []
            for v in TABLE5:
                r = cells[v.name]
                out.append(f"{r['ttft_ms']:.0f} / {r['tbt_ms']:.1f} ({r['ttft_ms'] / base['ttft_ms']:.2f}x / "
                           f"{r['tbt_ms'] / base['tbt_ms']:.2f}x)")  # fmt: skip
            lines.append(f"| {length} | " + " | ".join(out) + " |")
        lines.append("")
        lines.append("accept length (tokens per round) with SD: " + ", ".join(
            f"{r['prompt_tokens']}:{r['accept_length']:.2f}" for r in rows if r["variant"] == "SD"))  # fmt: skip
    if "table4" in results:
        t = results["table4"]
        lines += ["", f"Table 4 ({t['prompts']} held-out prompts, SD alone)", "",
                  "| method | accept length | TBT median ms | speedup | prompts whose tokens differ from U-shape's |",
                  "|---|---|---|---|---|",
                  f"| U-shape | 1.00 | {t['U-shape']['tbt_ms_median']:.1f} | 1.00x | — |",
                  f"| HAT (SD) | {t['SD']['accept_length']:.2f} | {t['SD']['tbt_ms_median']:.1f} | "
                  f"{t['decode_speedup']:.2f}x | {_differing(t['SD'])} |"]  # fmt: skip
        for e in TABLE4_EXTRAS.values():
            if e.key in t:
                p = t[e.key]
                lines.append(f"| {e.label} | {p['accept_length']:.2f} | {p['tbt_ms_median']:.1f} | "
                             f"{p['speedup']:.2f}x | {_differing(p)} |")  # fmt: skip
        lines += report_profile(t)
    if "components" in results:
        c = results["components"]
        lines += ["", "Components (ms, medians)", ""]
        lines += [f"- device {k}: {v:.2f}" for k, v in c["device_ms"].items()]
        lines += [f"- worker {k}: {v:.2f}" for k, v in c["worker_ms"].items()]
        for k, v in c["link_ms"].items():
            lines.append(f"- link {k}: upload {v['upload']:.2f}, download {v['download']:.2f}")
    if "sweep" in results:
        s = results["sweep"]
        lines += ["", "Sweep: TBT (ms) over RTT, 128-token prompt", "", "| RTT ms | U-shape | SD | SD+PD |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['rtt_ms']:g} | {r['U-shape']:.1f} | {r['SD']:.1f} | {r['SD+PD']:.1f} |" for r in s["rtt"]]
        lines += ["", "Sweep: TTFT (ms) over upload bandwidth", "", "| up MB/s | no chunking | chunking (PC) | ratio |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['up_MBps']:g} | {r['U-shape']:.0f} | {r['PC']:.0f} | {r['PC'] / r['U-shape']:.2f}x |"
                  for r in s["up_bandwidth"]]  # fmt: skip
    if "draft_length" in results:
        d = results["draft_length"]
        lines += ["", f"Draft length rule (SD+PC, {d['prompt_tokens']}-token prompt, {d['decode_tokens']} tokens): "
                  "TBT ms / accept length / drafts per round", "",
                  "| RTT ms | " + " | ".join(DRAFT_LENGTH_MODES) + " |",
                  "|---" * (len(DRAFT_LENGTH_MODES) + 1) + "|"]  # fmt: skip
        for r in d["rows"]:
            cells = [f"{r[m]['tbt_ms']:.1f} / {r[m]['accept_length']:.2f} / {r[m]['drafted_per_round']:.2f}"
                     for m in DRAFT_LENGTH_MODES]  # fmt: skip
            lines.append(f"| {r['rtt_ms']:g} | " + " | ".join(cells) + " |")
    if "chunks" in results:
        lines += ["", "Prefill chunks: TTFT ms (ratio to one frame); chunk lengths", "",
                  "| prompt | one frame | Eq. 3 | DP | DP chunks |", "|---|---|---|---|---|"]  # fmt: skip
        for r in results["chunks"]["rows"]:
            one = r["one frame"]
            lines.append(f"| {r['prompt_tokens']} | {one:.0f} | {r['Eq. 3']:.0f} ({r['Eq. 3'] / one:.2f}x) | "
                         f"{r['DP']:.0f} ({r['DP'] / one:.2f}x) | {r['DP chunks']} |")  # fmt: skip
    if "trees" in results:
        t = results["trees"]
        lines += ["", f"Chains vs token trees (SD alone; {t['chat_prompts']} held-out chat prompts, code prompts of "
                  f"{t['code_lengths']} tokens): accept length / TBT median ms / speedup over U-shape", "",
                  "| shape | chat | code | same tokens as U-shape |", "|---|---|---|---|"]  # fmt: skip
        for r in t["rows"]:
            cells = [f"{r[k]['accept_length']:.2f} / {r[k]['tbt_ms_median']:.1f} / {r[k]['speedup']:.2f}x"
                     for k in ("chat", "code")]  # fmt: skip
            same = all(r[k]["same_as_u_shape"] for k in ("chat", "code"))
            lines.append(f"| {r['shape']} | {cells[0]} | {cells[1]} | {'yes' if same else 'near-tie flips'} |")
    if "widths" in results:
        lines += report_widths(results["widths"])
    if "eq7" in results:
        lines += report_eq7(results["eq7"])
    if "defaults" in results:
        lines += report_defaults(results["defaults"])
    if "throughput" in results:
        lines += ["", "Worker throughput (decode tokens/s)", "", "| devices | batched | one at a time | ratio |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['devices']} | {r['batched_tok_s']:.1f} | {r['one_at_a_time_tok_s']:.1f} | {r['ratio']:.2f}x |"
                  for r in results["throughput"]["rows"]]  # fmt: skip
    return "\n".join(lines)


def report_profile(table: dict[str, Any]) -> list[str]:
    """The device half's profile of each method's rounds (HATStats.summary's profile_ms_per_round): where a round's
    time went, so the bottleneck shows in every run."""
    rows = [(m, r["stats"]["profile_ms_per_round"]) for m, r in table.items() if isinstance(r, dict) and "stats" in r]
    lines = ["", "Rounds' profile (ms per round; link modelled from the emulated link, worker = wait − link; ahead: "
             "drafting inside the wait)", "",
             "| method | " + " | ".join(PROFILE_PARTS) + " | round | ahead | bottleneck |",
             "|---|" + "---|" * (len(PROFILE_PARTS) + 3)]  # fmt: skip
    for method, p in rows:
        total = sum(p[k] for k in PROFILE_PARTS)
        lines.append(f"| {method} | " + " | ".join(f"{p[k]:.1f}" for k in PROFILE_PARTS) +
                     f" | {total:.1f} | {p['ahead']:.1f} | {p['bottleneck']} |")  # fmt: skip
    return lines


SECTIONS = {
    "components": components,
    "table5": table5,
    "table4": table4,
    "sweep": sweep,
    "draft_length": draft_length,
    "chunks": chunks,
    "trees": trees,
    "widths": widths,
    "eq7": eq7,
    "defaults": defaults,
    "throughput": throughput,
}
SPEC_SECTIONS = ("widths", "eq7", "defaults")  # run only when named: they need a profile and take long


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench hat", description=__doc__.split("\n\n")[0])
    add_bench_options(p)
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS),
                   default=[s for s in SECTIONS if s not in SPEC_SECTIONS], help="default: all but " +
                   ", ".join(SPEC_SECTIONS))  # fmt: skip
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--table5-prompts", type=int, default=6,
                   help="code-reading prompts per length (the default's 4 lengths: 24 prompts)")  # fmt: skip
    p.add_argument("--table4-prompts", type=int, default=24, help="held-out chat prompts (Table 4, widths)")
    p.add_argument("--table4-tokens", type=int, default=64)
    p.add_argument("--table4-ahead", action="store_true", help="Table 4: also SD drafting ahead (proactive + parallel)")
    p.add_argument("--table4-no-lookup", action="store_true", help="Table 4: also SD without the lookup branch")
    p.add_argument(
        "--worker-counts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 1024],
        help="components: positions per frame at which the worker's middle is timed",
    )  # fmt: skip
    p.add_argument("--sweep-rtt-ms", type=float, nargs="+", default=[0, 20, 50, 100, 200])
    p.add_argument("--sweep-up-mbps", type=float, nargs="+", default=[1, 2.5, 5, 10, 40])
    p.add_argument("--sweep-prompt", type=int, default=1024)
    p.add_argument("--sweep-tokens", type=int, default=32)
    p.add_argument("--draft-length-rtt-ms", type=float, nargs="+", default=[0, 20])
    p.add_argument("--draft-length-tokens", type=int, default=32)
    p.add_argument("--tree-widths", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--tree-code-lengths", type=int, nargs="+", default=[512])
    p.add_argument("--profile", default=None, help="the profile widths / eq7 / defaults plan with (default: run "
                   "`tandem profile` against this bench's worker and link first)")  # fmt: skip
    p.add_argument("--profile-quick", action="store_true", help="that profile run with --quick (a tiny grid)")
    p.add_argument("--profile-args", default="", help="more `tandem profile` options for that run, one string")
    p.add_argument("--width-chains", type=int, nargs="+", default=[1, 2, 4, 8], help="chain widths (1 = U-shape)")
    p.add_argument("--width-trees", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--eq7-rtt-ms", type=float, nargs="+", default=[0, 20, 200])
    p.add_argument("--eq7-lengths", type=int, nargs="+", default=list(range(1, 9)), help="fixed draft lengths")
    p.add_argument("--eq7-prompts", type=int, default=3)
    p.add_argument("--eq7-tokens", type=int, default=32)
    p.add_argument("--defaults-runs", type=int, default=3, help="Table 4 runs in the defaults section")
    p.add_argument("--throughput-devices", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--throughput-tokens", type=int, default=24)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    await bench.start_worker()  # before pinning ourselves: the worker is pinned on its own
    if args.device_core >= 0:
        os.sched_setaffinity(0, {args.device_core})
        torch.set_num_threads(1)  # one core: more threads would only contend
    try:
        from clients.hat.link import LinkProfile

        async with RawDevice(bench.url, bench) as probe:
            info = probe.info
        bench.results["setup"] = {
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": args.model, "m": args.m, "link": args.link,
            "link_parsed": LinkProfile.parse(args.link).__dict__,
            "worker_compute_device": info.get("compute_device"), "worker_core": args.worker_core,
            "device_core": args.device_core, "device_threads": torch.get_num_threads(),
            "adapter": str(bench.adapter), "draft_vocab": str(bench.draft_vocab),
            "cpu": cpu_name(),
        }  # fmt: skip
        for section in SECTIONS:
            if section in args.sections:
                t0 = time.perf_counter()
                print(f"[{section}]", file=sys.stderr, flush=True)
                bench.results[section] = await SECTIONS[section](bench)
                bench.results.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t0, 1)
    finally:
        bench.stop_worker()
    return bench.results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = asyncio.run(amain(args))
    for row in results.get("table5", []):
        row.pop("ids", None)
    print(report(results))
    write_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
