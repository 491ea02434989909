"""`tandem bench worker-compute`: the HAT worker's middle layers timed on a compute device (a CUDA GPU or this CPU)
with the model's real architecture and random weights, and what Tables 4 and 5 become with that worker.

Why random weights: a pass's time does not depend on the weights' values, and a GPU machine lent for a few minutes,
with no network and a small carry, cannot hold the bundled weights; the architecture (a config.json) is all it needs.
The passes are the worker's own (clients/hat/ragged.RaggedMiddle over split_model's middle stack, padded as the engine
pads), checked against the model's own layers first (app/worker/calibration.check_ragged_forward: the CUDA path of the
engine's self-check), so the numbers are the engine's compute and nothing else (no wire, no queueing).

Measured (`measure`):
- rows: one session's pass of r rows after c cached positions (median of --repeats), for U-shape decode (r = 1),
  verification rounds (r = 2..8) and prefill frames (r = 64..1024);
- tau: the prefill cost τ(x | y) points and their tied fit (policies.sequence_partition.fit_chunk_cost), as the
  worker profiles it at start-up, on a wider grid;
- batched: S sessions' 4-row rounds in one pass at --batch-context (continuous batching);
- with --device-half (on the CPU the device half runs on): the same τ profile of the input submodel (the first m
  layers), which Table 5's chunked prefill pipelines against the upload and the worker.

`--project DEVICE_JSON WORKER_JSON --hat HAT_JSON`: Tables 4 and 5 with the worker's compute swapped. HAT_JSON is the
`tandem bench hat --out` run to project (required: the accept length and the device's costs come from that run, never
from an older one). TBT: each method's measured rounds (HAT_JSON's table4 stats: ms per round, drafted per round,
accept length, and the rounds' profile: input layers, drafts, head, link, worker) with the worker's share of those very
rounds replaced by WORKER_JSON's pass for the round's rows; the device's and the link's shares stay as measured, and
are printed beside it (the bottleneck with the other worker). TTFT: the device ->
link -> worker flow-shop (policies.sequence_partition.compare_device_prefill) for one frame, HAT's Eq. 3 chunks and the
planned chunks, with the device's τ and each worker's τ, plus the reply's tail (download one token, LM head one row)
from HAT_JSON. The same model on the CPU worker is printed beside the measured Table 5, so the model's error is in view.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from app.tools.bench.output import cpu_name, write_json

Points = list[tuple[int, int, float]]
PARTS = ("input", "drafts", "head", "link", "worker", "other")  # a round's profile (clients/hat/options.round_profile)


def random_model(config_path: Path, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """The causal LM `config_path` describes, initialised at random, built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_path.read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def bundled_config(model: str) -> Path:
    """The config.json of a bundled model's Hugging Face conversion (converted on first use, as the worker does)."""
    from clients.hf_model import convert_gguf, converted_dir
    from deploy.models import resolve_model

    gguf = resolve_model(model)
    folder = converted_dir(gguf)
    if not (folder / "config.json").exists():
        convert_gguf(gguf, folder)
    return folder / "config.json"


class Timer:
    """Wall time of a callable on `device`, its queued kernels included (CUDA runs them asynchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class StackBench:
    """Times a RaggedMiddle over one stack of layers (the worker's middle, or the device's input layers)."""

    def __init__(self, stack: Any, hidden: int, min_rows: int, seed: int) -> None:
        from clients.hat.ragged import RaggedMiddle

        self.stack = stack
        self.ragged = RaggedMiddle(stack, min_rows, batch_invariant=True)
        self.hidden = hidden
        self.timer = Timer(self.ragged.device)
        self.gen = torch.Generator().manual_seed(seed)

    def states(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.hidden, generator=self.gen).to(self.ragged.device, self.ragged.dtype)

    def session(self, context: int, fill: int = 512) -> Any:
        cache = self.stack.new_cache()
        for start in range(0, context, fill):
            self.ragged.forward([(self.states(min(fill, context - start)), cache)])
        return cache

    def piece(self, cache: Any, rows: int, repeats: int) -> list[float]:
        """Seconds of `repeats` passes of `rows` new rows after the cache's positions (cropped back after each)."""
        keep = len(cache)
        x = self.states(rows)
        out = []
        for _ in range(repeats):
            out.append(self.timer(lambda: self.ragged.forward([(x, cache)])))
            cache.crop(keep)
        return out

    def tau_points(self, xs: Sequence[int], ys: Sequence[int], repeats: int) -> Points:
        """τ(x | y) profile points, each the least of `repeats` (other work only ever adds time)."""
        points = []
        for y in ys:
            cache = self.session(y)
            for x in xs:
                points.append((x, y, min(self.piece(cache, x, repeats))))
        return points

    def batched(self, sessions: int, rows: int, context: int, repeats: int) -> list[float]:
        caches = [self.session(context) for _ in range(sessions)]
        xs = [self.states(rows) for _ in range(sessions)]
        out = []
        for _ in range(repeats):
            out.append(self.timer(lambda: self.ragged.forward(list(zip(xs, caches, strict=True)))))
            for cache in caches:
                cache.crop(context)
        return out


def _fit(points: Points) -> dict[str, float]:
    from policies.sequence_partition import fit_chunk_cost

    cost = fit_chunk_cost(points, tied=True)
    return {"a": cost.a, "b": cost.b, "c": cost.c, "d": cost.d}


def _ms(seconds: Sequence[float]) -> float:
    return round(1000 * statistics.median(seconds), 3)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from app.worker.calibration import check_ragged_forward
    from app.worker.compute import MIN_ROWS, compute_device
    from clients.hat.split import split_model
    from policies.drafting import DelayPredictor

    device = compute_device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    config = Path(args.config) if args.config else bundled_config(args.model)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = random_model(config, dtype, device)
    split = split_model(model, args.m)
    hidden = split.hidden_size
    results: dict[str, Any] = {
        "setup": {
            "config": str(config), "model_type": model.config.model_type, "m": args.m,
            "middle_layers": split.num_layers - args.m, "hidden_size": hidden, "dtype": args.dtype,
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
    }  # fmt: skip
    middle = StackBench(split.middle.stack, hidden, MIN_ROWS, seed=1)
    with torch.inference_mode():
        results["self_check_relative_difference"] = check_ragged_forward(
            split.middle, middle.ragged, DelayPredictor(), hidden
        )
        for _ in range(3):  # warm-up: the first passes of each shape pay for kernel selection and allocation
            middle.piece(middle.session(64), 4, 1)
        rows: dict[str, dict[str, float]] = {}
        for context in args.contexts:
            cache = middle.session(context)
            rows[str(context)] = {str(r): _ms(middle.piece(cache, r, args.repeats)) for r in args.rows}
            print(f"[rows] context {context}: {rows[str(context)]}", file=sys.stderr, flush=True)
        results["middle_ms"] = rows
        points = middle.tau_points(args.tau_x, args.tau_y, args.repeats)
        results["middle_tau"] = {"points": points, "fit": _fit(points)}
        results["batched"] = []
        for sessions in args.sessions:
            seconds = middle.batched(sessions, 4, args.batch_context, args.repeats)
            results["batched"].append(
                {"sessions": sessions, "rows": 4, "context": args.batch_context, "pass_ms": _ms(seconds),
                 "ms_per_session": round(_ms(seconds) / sessions, 3)}
            )  # fmt: skip
            print(f"[batched] {results['batched'][-1]}", file=sys.stderr, flush=True)
        if args.device_half:
            inputs = StackBench(split.input.stack, hidden, MIN_ROWS, seed=2)
            inputs.piece(inputs.session(64), 4, 1)
            points = inputs.tau_points(args.tau_x, args.tau_y, args.repeats)
            results["input_tau"] = {"points": points, "fit": _fit(points)}
    return results


# --- the projection -------------------------------------------------------------------------------------------------


def _cost(fit: dict[str, float]) -> Any:
    from policies.sequence_partition import ChunkCost

    return ChunkCost(fit["a"], fit["b"], fit["c"], fit["d"])


def rows_ms(run: dict[str, Any], rows: float, context: int) -> float:
    """A pass of `rows` rows (fractional: interpolated) at the measured context nearest `context`."""
    table = run["middle_ms"]
    near = min(table, key=lambda c: abs(int(c) - context))
    grid = sorted((int(r), ms) for r, ms in table[near].items())
    for (r0, t0), (r1, t1) in itertools.pairwise(grid):
        if r0 <= rows <= r1:
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
    raise ValueError(f"{rows} rows is outside the measured rows {[r for r, _ in grid]}")


def table4_rounds(hat: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(method, its table4 row) of a `bench hat` run, each with the rounds' profile (HATStats.summary): refused for a
    run from before the profile, whose device costs this projection cannot separate from its worker's."""
    rows = [(m, row) for m, row in hat.get("table4", {}).items() if isinstance(row, dict) and "stats" in row]
    if not rows:
        raise ValueError("the hat run has no table4: run `tandem bench hat --sections table4 --out FILE` and pass it")
    for method, row in rows:
        if "profile_ms_per_round" not in row["stats"]:
            raise ValueError(f"the hat run's {method} has no rounds' profile: rerun `tandem bench hat --out FILE`")
    return rows


def project_tbt(hat: dict[str, Any], other: dict[str, Any], context: int) -> list[dict]:
    """Table 4's methods with the worker swapped: each method's rounds as `hat`'s run measured them — accept length,
    ms per round and its profile — with the worker's share of the round (the wait minus the link's) out and
    `other`'s pass for the round's rows at `context` in. The device's and the link's shares stay as measured.

    Drafting done ahead inside the wait (the profile's `ahead`) fits only as long as the wait lasts: whatever of it
    would outlast the other worker's shorter wait (link + its pass) is charged to the round in full, as drafts (the
    device's one core has to do it somewhere; in the product the reply cuts it short and the hits it would have made
    are drafted after the reply instead)."""
    out = []
    for method, row in table4_rounds(hat):
        stats = row["stats"]
        profile = stats["profile_ms_per_round"]
        rows = 1 + stats["drafted_per_round"]
        worker = rows_ms(other, rows, context)
        unfit = max(0.0, profile.get("ahead", 0.0) - (profile["link"] + worker))
        swapped = stats["ms_per_round"] - profile["worker"] + worker + unfit
        parts = {k: round(profile[k], 1) for k in ("input", "drafts", "head", "link", "other")}
        parts["drafts"] = round(profile["drafts"] + unfit, 1)
        parts["worker"] = round(worker, 1)
        out.append({
            "method": method, "rows_per_round": round(rows, 2), "accept_length": round(stats["accept_length"], 3),
            "measured_tbt_ms": round(row["tbt_ms_median"], 1),
            "model_tbt_ms_cpu_worker": round(stats["ms_per_round"] / stats["accept_length"], 1),
            "model_tbt_ms_other_worker": round(swapped / stats["accept_length"], 1),
            "measured_profile_ms_per_round": {k: v if isinstance(v, str) else round(v, 1) for k, v in profile.items()},
            "other_profile_ms_per_round": parts,
            "ahead_unfit_ms_per_round": round(unfit, 1),
            "other_bottleneck": max(parts, key=lambda k: parts[k]),
        })  # fmt: skip
    return out


def project_ttft(
    hat: dict[str, Any], device: dict[str, Any], workers: dict[str, dict[str, Any]], lengths: Sequence[int]
) -> list[dict]:
    """TTFT of one frame, Eq. 3's chunks and the planned chunks, per worker, from the flow-shop model."""
    from policies.sequence_partition import compare_device_prefill

    link = hat["setup"]["link_parsed"]
    comp = hat["components"]
    # The first token's head: a greedy pick reads only the argmax, so the argmax head the run's device half verified
    # with (int8 where exact, clients/hat/quant.py); a run from before it was measured has only the fp32 head's time.
    head = comp["device_ms"].get("lm_head_argmax_1_rows", comp["device_ms"]["lm_head_1_rows"])
    tail = (comp["link_ms"]["1_tokens"]["download"] + head) / 1000
    out = []
    for name, run in workers.items():
        for n in lengths:
            cmp = compare_device_prefill(
                n, _cost(device["input_tau"]["fit"]), _cost(run["middle_tau"]["fit"]),
                token_bytes=comp["token_bytes"], beta_up=link["up_bandwidth"], latency=link["latency"],
            )  # fmt: skip
            one = cmp.one_frame_makespan + tail
            out.append({
                "worker": name, "prompt": n, "one_frame_ms": round(1000 * one, 1),
                "eq3_ms": round(1000 * (cmp.eq3_makespan + tail), 1),
                "planned_ms": round(1000 * (cmp.planned_makespan + tail), 1),
                "eq3_ratio": round((cmp.eq3_makespan + tail) / one, 3),
                "planned_ratio": round((cmp.planned_makespan + tail) / one, 3), "eq3_chunks": len(cmp.eq3),
            })  # fmt: skip
    return out


def project(args: argparse.Namespace) -> dict[str, Any]:
    device, worker = (json.loads(Path(p).read_text()) for p in args.project)
    if not args.hat:
        raise SystemExit("--project needs --hat: the `tandem bench hat --out` run whose rounds to project")
    hat = json.loads(Path(args.hat).read_text())
    if "input_tau" not in device:
        raise SystemExit(f"{args.project[0]} has no input_tau: measure it with --device-half on the device's CPU")
    try:
        tbt = project_tbt(hat, worker, args.tbt_context)
    except ValueError as e:
        raise SystemExit(f"{args.hat}: {e}") from None
    measured: dict[str, float] = {}  # prompt length -> measured PC TTFT / U-shape TTFT
    if args.table5:
        ttft = {
            (r["prompt_tokens"], r["variant"]): r["ttft_ms"]
            for r in json.loads(Path(args.table5).read_text())["table5"]
        }
        for (n, variant), ms in ttft.items():
            if variant == "PC" and (n, "U-shape") in ttft:
                measured[str(n)] = round(ms / ttft[n, "U-shape"], 3)
    return {
        "hat_run": {"file": str(args.hat), **{k: hat["setup"].get(k) for k in ("created", "cpu", "link")}},
        "tbt": tbt,
        # TTFT's tail (the download, one head row) comes from the run's component times: a Table 4 run alone
        # (`--sections table4`) projects TBT only
        "ttft": project_ttft(hat, device, {"cpu": device, "other": worker}, args.lengths)
        if "components" in hat
        else [],
        "measured_table5": measured,
        "workers": {"cpu": device["setup"], "other": worker["setup"]},
    }


# --- report -----------------------------------------------------------------------------------------------------------


def report_measure(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        f"middle {s['middle_layers']} layers of {s['model_type']} (hidden {s['hidden_size']}), random weights, "
        f"{s['dtype']} on {s['device']} ({s['device_name']}, {s['threads']} threads), torch {s['torch']}; "
        f"self-check relative difference {results['self_check_relative_difference']:.1e}",
        "",
        "| context | " + " | ".join(f"{r} rows" for r in next(iter(results["middle_ms"].values()))) + " |",
        "|---|" + "---|" * len(next(iter(results["middle_ms"].values()))),
    ]
    for context, row in results["middle_ms"].items():
        lines.append(f"| {context} | " + " | ".join(f"{ms:.2f}" for ms in row.values()) + " |")
    fit = results["middle_tau"]["fit"]
    lines += ["", f"τ(x | y) fit (s): a={fit['a']:.3g} b={fit['b']:.3g} c={fit['c']:.3g} d={fit['d']:.3g}", ""]
    lines += ["| sessions × 4 rows | context | pass ms | ms per session |", "|---|---|---|---|"]
    for b in results["batched"]:
        lines.append(f"| {b['sessions']} | {b['context']} | {b['pass_ms']:.2f} | {b['ms_per_session']:.2f} |")
    if "input_tau" in results:
        fit = results["input_tau"]["fit"]
        lines += ["", f"input layers τ fit (s): a={fit['a']:.3g} b={fit['b']:.3g} c={fit['c']:.3g} d={fit['d']:.3g}"]
    return "\n".join(lines)


def report_project(p: dict[str, Any]) -> str:
    run = p["hat_run"]
    lines = [
        f"worker 'cpu': {p['workers']['cpu']['device_name']}; 'other': {p['workers']['other']['device_name']}",
        f"rounds from {run['file']} (created {run.get('created') or 'unknown'}, link {run.get('link')})",
        "",
        "| method | rows/round | accept | measured TBT | model, CPU worker | model, other worker | speedup (other) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {r["method"]: r for r in p["tbt"]}.get("U-shape")
    for r in p["tbt"]:
        speed = base["model_tbt_ms_other_worker"] / r["model_tbt_ms_other_worker"] if base else float("nan")
        lines.append(
            f"| {r['method']} | {r['rows_per_round']} | {r['accept_length']} | {r['measured_tbt_ms']} | "
            f"{r['model_tbt_ms_cpu_worker']} | {r['model_tbt_ms_other_worker']} | {speed:.2f}× |"
        )
    lines += ["", "The rounds' profile, ms per round: as measured (CPU worker) → with the other worker", "",
              "| method | " + " | ".join(PARTS) + " | bottleneck |", "|---|" + "---|" * (len(PARTS) + 1)]  # fmt: skip
    for r in p["tbt"]:
        measured, other = r["measured_profile_ms_per_round"], r["other_profile_ms_per_round"]
        cells = [f"{measured[k]} → {other[k]}" for k in PARTS]
        lines.append(
            f"| {r['method']} | " + " | ".join(cells) + f" | {measured['bottleneck']} → {r['other_bottleneck']} |"
        )
    unfit = [f"{r['method']} {r['ahead_unfit_ms_per_round']} ms" for r in p["tbt"] if r["ahead_unfit_ms_per_round"]]
    if unfit:
        lines += ["", "drafting ahead that outlasts the other worker's wait, charged to drafts: " + ", ".join(unfit)]
    if not p["ttft"]:
        return "\n".join([*lines, "", "(no TTFT projection: the hat run has no components section)"])
    lines += ["", "| worker | prompt | one frame ms | Eq. 3 chunks ms (ratio) | planned ms (ratio) | measured PC / U |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in p["ttft"]:
        m = p["measured_table5"].get(str(r["prompt"])) if r["worker"] == "cpu" else None
        seen = f"{m:.2f}×" if m else "—"
        lines.append(
            f"| {r['worker']} | {r['prompt']} | {r['one_frame_ms']} | {r['eq3_ms']} ({r['eq3_ratio']:.2f}×) | "
            f"{r['planned_ms']} ({r['planned_ratio']:.2f}×) | {seen} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench worker-compute", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="bundled model whose config to use")
    p.add_argument("--config", default=None, help="a config.json instead (e.g. carried to a GPU machine)")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto (CUDA if torch sees it), cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (the bench's worker has one)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 64, 256, 1024])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 2048])
    p.add_argument("--tau-x", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--tau-y", type=int, nargs="+", default=[0, 512, 1536])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--batch-context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device-half", action="store_true", help="also profile the input layers' τ (the device half)")
    p.add_argument("--project", nargs=2, metavar=("DEVICE_JSON", "WORKER_JSON"), default=None)
    p.add_argument("--hat", default=None, help="--project: the `bench hat --out` run to project (table4 with the "
                   "rounds' profile, components); required")  # fmt: skip
    p.add_argument("--table5", default=None, help="--project: a `bench hat` run whose Table 5 to set beside")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--tbt-context", type=int, default=128, help="--project: the context Table 4's rounds run at")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = project(args) if args.project else measure(args)
    print(report_project(results) if args.project else report_measure(results))
    write_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
