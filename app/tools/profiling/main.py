"""`tandem profile`: measure this device half and a HAT worker, replay acceptance offline, write a JSON profile.

    tandem profile                                  # the default model, a worker started on loopback
    tandem profile --worker-url ws://host:8100      # a running `tandem worker`
    tandem profile --quick --model smollm2-135m-instruct --out var/profile/smol.json   # a tiny grid (tests)

What it writes (schema "tandem-hat-profile", version 1; read back by clients/hat/profile.py):
- model, gguf, m, hidden_size, num_layers, adapter, draft_vocab, hosts (device and worker), created (UTC), grid;
- device: draft_step_ms[r] (one batched draft step for r rows), head_ms[r] (the LM head over r rows);
- worker: middle_ms[context][w] (the middle layers' compute for w positions), compute_device;
- link: rtt_ms, up_bytes_per_s, down_bytes_per_s (null = too fast to measure), token_bytes;
- acceptance (replay.py), calibrated on held-out chat prompts and transferred to held-out code-reading
  prompts: alpha (chain / eta / confident, what the draft-length controller starts from), the eta rule's replayed
  accept length, rank_cdf (per depth d, P(rank of the LLM's token <= k | the previous d-1 drafts right), for
  chains and trees), path_counts (how often each rank path is on the true path: exact node probabilities for
  building trees), and table1: accept length by width for chains and best trees (Ghidorah's Table I analogue)
  with each width's modelled round time from the measured parts and ARCA's choice.

Where the device half (HATOptions.profile / `[clouds.x] profile`) and the worker (`[worker] profile`) use it: see
clients/hat/profile.py. Greedy calibration answers are generated here with the fp32 model (the arithmetic the
replay uses), or read from a `tandem train-adapter` corpus (--corpus: its held-out records).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from app.tools.profiling import replay as rp
from clients.hat.profile import SCHEMA, VERSION
from policies import trees

WIDTHS = (1, 2, 4, 8, 16, 32)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="bundled model name or GGUF path")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--adapter", default="", help="adapter file (default: the shipped one for this model, if any)")
    p.add_argument("--draft-vocab", default="", help='reduced draft vocabulary JSON, "full" = none (default: shipped)')
    p.add_argument("--worker-url", default="", help="a running worker (default: start one on loopback)")
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--worker-core", type=int, default=1, help="pin the started worker to this core (-1: no pinning)")
    p.add_argument("--worker-device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--link", default="", help='emulate a link, e.g. "latency=10ms,up=7.5MB/s,down=12.5MB/s"')
    p.add_argument("--threads", type=int, default=1, help="torch threads of the device half")
    p.add_argument("--out", default="", help="profile JSON (default var/profile/<model>-m<m>.json); a .md beside it")
    p.add_argument("--quick", action="store_true", help="a tiny grid and two short calibration answers (tests)")
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32], help="device rows per draft step")
    p.add_argument("--widths", type=int, nargs="*", default=list(WIDTHS), help="positions per worker pass")
    p.add_argument("--contexts", type=int, nargs="*", default=[128, 512, 2048], help="worker context lengths")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chat-prompts", type=int, default=16, help="held-out chat prompts for calibration")
    p.add_argument("--code-prompts", type=int, default=8, help="held-out code-reading prompts (transfer)")
    p.add_argument("--code-max-tokens", type=int, default=2048, help="longest code-reading prompt (tokens)")
    p.add_argument("--answer-tokens", type=int, default=96, help="greedy answer length per calibration prompt")
    p.add_argument("--corpus", default="", help="use a train-adapter corpus.jsonl's held-out answers instead")
    p.add_argument("--depth", type=int, default=12, help="deepest tree level in the path counts")
    p.add_argument("--top-k", type=int, default=8, help="ranks per level kept in path counts")
    p.add_argument("--eta", type=float, default=0.6)
    p.add_argument("--max-draft", type=int, default=8)
    return p


def _quick(args: argparse.Namespace) -> None:
    args.rows, args.widths, args.contexts, args.repeats = [1, 2, 4], [1, 2, 4], [32], 2
    args.chat_prompts, args.code_prompts, args.answer_tokens, args.depth, args.top_k = 2, 1, 12, 4, 4
    args.code_max_tokens = 256


# --- calibration texts --------------------------------------------------------------------------------


def _generate(model: Any, prompt_ids: list[int], n: int, eos: set[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=sorted(eos) or None,
            pad_token_id=sorted(eos)[0] if eos else 0,
        )
    return out[0, len(prompt_ids) :].tolist()


def calibration_texts(args: argparse.Namespace, model: Any, tok: Any, eos: set[int]) -> dict[str, list[tuple]]:
    """{"chat": [(prompt ids, answer ids)], "code": [...]}: held-out prompts only (never trained on)."""
    from app.tools.training.code_prompts import build_code_prompts, is_code_index
    from app.tools.training.corpus import DEFAULT_PROMPTS, chat_ids, is_held_out, load_prompts, read_corpus

    if args.corpus:
        records = [e for e in read_corpus(args.corpus).values() if e.held_out and e.temperature == 0.0]
        if not records:
            raise SystemExit(f"{args.corpus}: no held-out greedy answers")
        chat = [(e.prompt_ids, e.response_ids) for e in records if not is_code_index(e.index)]
        code = [(e.prompt_ids, e.response_ids) for e in records if is_code_index(e.index)]
        return {"chat": chat[: args.chat_prompts], "code": code[: args.code_prompts]}
    chat_prompts = [p for i, p in enumerate(load_prompts(DEFAULT_PROMPTS)) if is_held_out(i)][: args.chat_prompts]
    code_all = (
        build_code_prompts(tok, 8 * args.code_prompts, max_tokens=args.code_max_tokens) if args.code_prompts else []
    )
    code_prompts = [p for j, p in enumerate(code_all) if is_held_out(j)][: args.code_prompts]
    out: dict[str, list[tuple]] = {}
    for name, prompts in (("chat", chat_prompts), ("code", code_prompts)):
        texts = []
        for prompt in prompts:
            ids = chat_ids(tok, prompt)
            texts.append((ids, _generate(model, ids, args.answer_tokens, eos)))
        out[name] = texts
    return out


# --- the round-time model of a width, from the measured parts ------------------------------------------


def interp(table: dict[str, float] | dict[int, float], x: float) -> float:
    """Piecewise-linear through the measured points, the end segments extended (never below 0); one point:
    proportional to x."""
    pts = sorted((int(k), float(v)) for k, v in table.items())
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0]
    i = next((i for i in range(1, len(pts)) if x <= pts[i][0]), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def round_ms(profile: dict[str, Any], tree: trees.DraftTree, accept: float, context: int) -> dict[str, float]:
    """Modelled time of one round verifying `tree` (its nodes + the root): draft steps depth by depth (each depth
    one batched step over its nodes, the last depth fed for its shallow states), upload, the worker's middle for
    the positions at the nearest measured context, download, the head over the rows the lazy check needs (the
    accepted path + 1), and the link's latency."""
    dev, link = profile["device"], profile["link"]
    ctxs = sorted(int(c) for c in profile["worker"]["middle_ms"])
    ctx = min(ctxs, key=lambda c: abs(c - context))
    width = tree.width
    a = link["token_bytes"]
    up = 0.0 if not link["up_bytes_per_s"] else 1e3 * width * a / link["up_bytes_per_s"]
    down = 0.0 if not link["down_bytes_per_s"] else 1e3 * width * a / link["down_bytes_per_s"]
    parts = {
        "draft": sum(interp(dev["draft_step_ms"], len(level)) for level in tree.levels()),
        "upload": up,
        "worker": interp(profile["worker"]["middle_ms"][str(ctx)], width),
        "download": down,
        "head": interp(dev["head_ms"], max(1.0, accept)),
        "rtt": link["rtt_ms"],
    }
    parts["total"] = sum(parts.values())
    return {k: round(v, 3) for k, v in parts.items()}


def table1(
    profile: dict[str, Any],
    calib: list[rp.RankedText],
    transfer: list[rp.RankedText],
    widths: Sequence[int],
    depth: int,
    top_k: int,
    context: int,
) -> dict[str, Any]:
    """Accept length by width for chains and trees: calibrated (expected from the calibration set's path
    counts), replayed exactly on the calibration set and on the transfer set; modelled round time and tokens/s;
    ARCA's width (argmax of calibrated accept length / round time, ties to the smaller); Ghidorah's decomposition
    speedup(w) = accept(w) * T(1) / T(w). Trees: Ghidorah's steps 4 and 5 — the best tree for the path probabilities,
    then refined by the calibration set's exact replay."""
    answers = [t.answer() for t in calib]
    probabilities = trees.path_probabilities(answers, max(depth, max(widths) - 1), top_k)  # deep enough for chains
    shapes: dict[int, trees.DraftTree] = {}
    rows = []
    for w in widths:
        row: dict[str, Any] = {"width": w}
        shapes[w] = trees.refine_tree(trees.best_tree(w, probabilities), answers)
        for shape in ("chain", "tree"):
            tree = trees.chain(w - 1) if shape == "chain" else shapes[w]
            est = trees.expected_tokens(tree, probabilities)
            t = round_ms(profile, tree, est, context)
            row[shape] = {
                "nodes_per_depth": [len(level) for level in tree.levels()[1:]],
                "accept_calibrated": round(est, 4),
                "accept_replay_calibration": rp.replay(calib, tree).summary()["accept_length"],
                "accept_replay_transfer": rp.replay(transfer, tree).summary()["accept_length"] if transfer else None,
                "round_ms": t,
                "tokens_per_s": round(1e3 * est / t["total"], 3),
            }
        rows.append(row)
    base = {s: rows[0][s]["round_ms"]["total"] for s in ("chain", "tree")}
    choice = {}
    for shape in ("chain", "tree"):
        best = max(rows, key=lambda r: (r[shape]["tokens_per_s"], -r["width"]))
        choice[shape] = best["width"]
        for r in rows:
            r[shape]["ghidorah_speedup"] = round(
                r[shape]["accept_calibrated"] * base[shape] / r[shape]["round_ms"]["total"], 3
            )
    paths = {str(w): sorted(tree.path(i) for i in range(1, tree.width)) for w, tree in shapes.items()}
    return {"context": context, "rows": rows, "arca_width": choice, "trees": paths}


def acceptance(args: argparse.Namespace, texts: dict[str, list[rp.RankedText]], profile: dict[str, Any]) -> dict:
    chat, code = texts["chat"], texts["code"]
    counts, starts = trees.path_counts([t.answer() for t in chat], args.depth, args.top_k)
    eta = rp.replay_eta(chat, args.eta, args.max_draft)
    out: dict[str, Any] = {
        "calibration": {
            "set": "held-out chat prompts",
            "texts": len(chat),
            "answer_tokens": sum(t.end - t.prompt_len + 1 for t in chat),
        },
        "transfer": {
            "set": "held-out code-reading prompts",
            "texts": len(code),
            "answer_tokens": sum(t.end - t.prompt_len + 1 for t in code),
        },
        "eta": args.eta,
        "max_draft": args.max_draft,
        "alpha": eta["alpha"],
        "eta_rule": {"calibration": eta, "transfer": rp.replay_eta(code, args.eta, args.max_draft) if code else None},
        "chains": {
            str(l_): {
                "calibration": rp.replay(chat, trees.chain(l_)).summary()["accept_length"],
                "transfer": rp.replay(code, trees.chain(l_)).summary()["accept_length"] if code else None,
            }
            for l_ in range(0, args.max_draft + 1)
        },
        "rank_cdf": {"calibration": rp.rank_cdf(chat, args.depth, args.top_k)},
        "path_counts": {
            "depth": args.depth,
            "top_k": args.top_k,
            "starts": starts,
            "paths": [[list(p), c] for p, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= 2],
        },
    }
    if code:
        out["rank_cdf"]["transfer"] = rp.rank_cdf(code, args.depth, args.top_k)
    context = sorted(int(c) for c in profile["worker"]["middle_ms"])[len(profile["worker"]["middle_ms"]) // 2]
    out["table1"] = table1(profile, chat, code, args.widths, args.depth, args.top_k, context)
    return out


# --- the run --------------------------------------------------------------------------------------------------


async def _measure(args: argparse.Namespace, backend: Any, model_name: str) -> tuple[dict, dict, dict]:
    from app.tools.profiling.measure import WorkerProbe, device_times, worker_times
    from clients.hat.link import LinkProfile

    device = await backend.thread.run(device_times, backend.half, args.rows, min(args.contexts), args.repeats)
    worker = None
    url = args.worker_url
    if not url:
        from app.config import EmbeddedWorkerSettings
        from app.embedded import EmbeddedWorker

        cpus = [args.worker_core] if args.worker_core >= 0 else None
        settings = EmbeddedWorkerSettings(num_threads=args.worker_threads, cpus=cpus, device=args.worker_device)
        worker = EmbeddedWorker(settings, args.model, args.m, None)
        worker.start()
        await worker.wait_ready()
        url = worker.url
    try:
        link = LinkProfile.parse(args.link) if args.link else None
        need = max(args.contexts) + max([*args.widths, *_link_positions(args)])
        ids = torch.randint(0, min(backend.vocab_size, 32000), (1, need), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            states = backend.half.input(ids, None, positions=0)[0]
        probe = WorkerProbe(url, backend.hidden_size, backend.num_layers, args.m, model_name, link)
        async with probe:
            measured = await worker_times(
                probe, states, args.widths, args.contexts, _link_positions(args), args.repeats
            )
            info = probe.info
    finally:
        if worker is not None:
            worker.stop()
    hosts = {"url": url, "started_here": worker is not None, "compute_device": info.get("compute_device")}
    return device, measured, hosts


def _link_positions(args: argparse.Namespace) -> list[int]:
    return [1, 16] if args.quick else [1, 64, 256]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from clients.hat.adapter import draft_files
    from clients.hat.device import HATBackend
    from clients.hat.options import HATOptions
    from clients.hat.split import split_model
    from clients.hf_model import load_hf_model
    from deploy.models import MODELS, resolve_model, sha256_of

    torch.set_num_threads(max(1, args.threads))
    gguf = resolve_model(args.model)
    model, tok = load_hf_model(gguf)
    model.eval()
    adapter_path, vocab_path = draft_files(args.model, args.m, args.adapter, args.draft_vocab)
    # The device half's own parts, timed in this process; it never connects (the probe talks to the worker).
    options = HATOptions(worker_url="ws://127.0.0.1:1", m=args.m, num_threads=max(1, args.threads))
    backend = HATBackend(
        options,
        model_id=args.model,
        adapter_path=adapter_path,
        draft_vocab_path=vocab_path,
        model=model,
        tokenizer=tok,
    )
    t0 = time.monotonic()

    async def measure() -> tuple[dict, dict, dict]:
        await backend.start()
        try:
            return await _measure(args, backend, args.model)
        finally:
            await backend.close()

    device, measured, worker_host = asyncio.run(measure())
    measure_s = time.monotonic() - t0
    profile: dict[str, Any] = {
        "schema": SCHEMA,
        "version": VERSION,
        "model": args.model,
        "gguf": gguf.name,
        "gguf_sha256": MODELS[args.model].sha256 if args.model in MODELS else None,
        "m": args.m,
        "hidden_size": backend.hidden_size,
        "num_layers": backend.num_layers,
        "adapter": {"file": adapter_path.name, "sha256": sha256_of(adapter_path)} if adapter_path else None,
        "draft_vocab": {"file": vocab_path.name, "tokens": int(backend.half.draft_ids.numel())} if vocab_path else None,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "hosts": {
            "device": {
                "host": platform.node(),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "torch": torch.__version__,
            },
            "worker": worker_host,
        },
        "grid": {
            "rows": args.rows,
            "widths": args.widths,
            "contexts": args.contexts,
            "repeats": args.repeats,
            "link": args.link or None,
            "quick": args.quick,
        },
        "device": device,
        "worker": {"middle_ms": measured["middle_ms"], "compute_device": worker_host["compute_device"]},
        "link": measured["link"],
    }
    t1 = time.monotonic()
    eos = set(backend.eos_ids)
    texts = calibration_texts(args, model, tok, eos)
    split = split_model(model, args.m)
    half = backend.half

    def draft_head(feats: torch.Tensor) -> torch.Tensor:
        return half.draft_logits(feats, 0)

    ranked = {
        name: [
            rp.rank_text(split, half.adapter, p + a, len(p), draft_head, capped=not a or a[-1] not in eos)
            for p, a in pairs
        ]
        for name, pairs in texts.items()
    }
    profile["acceptance"] = acceptance(args, ranked, profile)
    profile["seconds"] = {"measure": round(measure_s, 1), "replay": round(time.monotonic() - t1, 1)}
    return profile


def report(profile: dict[str, Any]) -> str:
    """The profile as Markdown: component times, the link, acceptance, and the Table I analogue."""
    dev, link, acc = profile["device"], profile["link"], profile["acceptance"]
    lines = [
        f"# HAT profile: {profile['model']} (m = {profile['m']}), {profile['created']}",
        "",
        f"device: {json.dumps(profile['hosts']['device'])}; worker: {json.dumps(profile['hosts']['worker'])}",
        "",
        "| rows r | draft step ms | LM head ms |",
        "|---|---|---|",
        *(f"| {r} | {dev['draft_step_ms'][r]:.2f} | {dev['head_ms'][r]:.2f} |" for r in dev["draft_step_ms"]),
        "",
        "| context | " + " | ".join(f"w={w}" for w in next(iter(profile["worker"]["middle_ms"].values()))) + " |",
        "|---" * (1 + len(next(iter(profile["worker"]["middle_ms"].values())))) + "|",
        *(
            f"| {c} | " + " | ".join(f"{v:.2f}" for v in per.values()) + " |"
            for c, per in profile["worker"]["middle_ms"].items()
        ),
        "",
        f"link: rtt {link['rtt_ms']:.2f} ms, up {link['up_bytes_per_s'] or 'unmeasurable'} B/s, "
        f"down {link['down_bytes_per_s'] or 'unmeasurable'} B/s ({link['samples']} samples, "
        f"median residual {link['residual_ms_median']:.2f} ms)",
        "",
        f"acceptance ({acc['calibration']['texts']} {acc['calibration']['set']}, "
        f"{acc['calibration']['answer_tokens']} answer tokens; transfer: {acc['transfer']['texts']} "
        f"{acc['transfer']['set']}, {acc['transfer']['answer_tokens']} tokens): alpha {json.dumps(acc['alpha'])}; "
        f"eta rule accept length {acc['eta_rule']['calibration']['accept_length']:.3f}"
        + (f" (transfer {acc['eta_rule']['transfer']['accept_length']:.3f})" if acc["eta_rule"]["transfer"] else ""),
        "",
    ]
    t = acc["table1"]
    lines += [
        f"Table I analogue (context {t['context']}; accept length: calibrated / replayed on chat / on code; "
        "round ms and tokens/s modelled from the measured parts):",
        "",
        "| width | chain accept | chain round ms | chain tok/s | tree accept | tree nodes per depth | tree round ms "
        "| tree tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in t["rows"]:
        c, tr = r["chain"], r["tree"]

        def acc3(x: dict[str, Any]) -> str:
            code = x["accept_replay_transfer"]
            return f"{x['accept_calibrated']:.2f} / {x['accept_replay_calibration']:.2f} / " + (
                "-" if code is None else f"{code:.2f}"
            )

        lines.append(
            f"| {r['width']} | {acc3(c)} | {c['round_ms']['total']:.1f} | {c['tokens_per_s']:.1f} | {acc3(tr)} | "
            f"{tr['nodes_per_depth']} | {tr['round_ms']['total']:.1f} | {tr['tokens_per_s']:.1f} |"
        )
    lines += ["", f"ARCA's width (max calibrated tokens/s): {json.dumps(t['arca_width'])}"]
    return "\n".join(lines) + "\n"


def default_out(model: str, m: int, prefix: str = "") -> Path:
    """var/profile/<prefix><model>-m<m>.json: a bundled model's whole name (its dots are no suffix), a GGUF's stem."""
    name = Path(model).name
    return Path("var/profile") / f"{prefix}{name.removesuffix('.gguf')}-m{m}.json"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.quick:
        _quick(args)
    if any(x < 1 for x in [*args.rows, *args.widths, *args.contexts]) or args.repeats < 1:
        raise SystemExit("rows, widths, contexts and repeats must be >= 1")
    out = Path(args.out or default_out(args.model, args.m))
    profile = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    os.replace(tmp, out)
    text = report(profile)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"profile: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
