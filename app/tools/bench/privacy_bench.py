"""`tandem bench privacy`: what a HAT worker can recover from the hidden states it receives.

HAT never sends token ids or text, but the worker gets the input submodel's output (embedding + the device's first
m layers) for every prompt and draft position. A worker operator has the (public) model, so it can run the first
m layers itself on any public text and fit an inverse. This bench runs the attacks such an operator can run on
exactly what the worker receives — the real split model's input submodel (clients/hat/split.py), cast to the wire
dtype and, with noise, noised by clients/hat/noise.py — and scores top-1 token recovery on held-out text:

- nearest: the nearest row of the input embedding matrix (cosine), no training;
- linear: ridge regression hidden -> input embedding (standardised features), then the nearest row (cosine);
- inverter: a small learned inverter — the ridge probe plus an MLP correction over the states of positions t-1,
  t, t+1, trained for a few seconds of CPU with a sampled softmax over cosine similarity to embeddings (the
  target, its nearest embedding rows as hard negatives, random tokens); decoded by the nearest row of the whole
  vocabulary.

Fitting text (read at run time, nothing shipped): Python standard-library source files (code) plus docstrings of
other standard-library files and the installed packages' licence texts (prose). Held out, pinned (shipped in
deploy/privacy_held_out.json.gz, sha256-checked): this repository's Python code and its README / ARCHITECTURE prose
as they were at commit 717abd1, whose run published the figures — different files and a different source of
prose, which the attacks never fit on, and which editing the repository does not move. All
predictions range over the whole vocabulary.

Next to the rates, what each m costs the device: the input submodel's time per decoded token (one thread, a
256-token KV cache, as the gateway's device half runs it), and the accept length of the shipped adapter for that
m (clients/hat/adapters/; "no adapter" otherwise).

Noise (HATOptions.noise, the measured defence): at the default m, the same attacks on noised states for a few
noise levels — the attacker fits on clean and on equally noised states and the stronger is reported — and, with a
real worker (`tandem worker` on loopback, pinned to its own core, link emulated as in `tandem bench hat`), the
accept length, TBT and greedy agreement with the noiseless output over a few held-out chat prompts.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.tools import REPO_ROOT, pinned_json, pyplot
from app.tools.bench.hat_setup import DEFAULT_LINK
from app.tools.bench.inversion import (
    LinearProbe,
    embedding_neighbours,
    nearest_rows,
    recovery_rate,
    train_inverter,
)
from app.tools.bench.output import cpu_name, publish

# --- text -------------------------------------------------------------------------------------------


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
    return sorted(
        p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts) and p.stat().st_size > 2000
    )


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                docs.append(doc)
    return "\n\n".join(docs)


def _licence_texts() -> list[str]:
    out = []
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for p in sorted(Path(site).glob("*.dist-info/**/LICEN[CS]E*")):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                if p.is_file():
                    out.append(p.read_text())
    return out


def fit_texts() -> dict[str, list[str]]:
    """Public text of other kinds than the held-out text: stdlib code (even files) and prose (odd files' docstrings,
    installed packages' licences)."""
    files = _stdlib_files()
    code = [p.read_text(errors="replace") for p in files[::2]]
    prose = [d for d in (_docstrings(p) for p in files[1::2]) if d]
    licences = _licence_texts()
    mixed: list[str] = []
    for i in range(max(len(prose), len(licences))):  # interleave the two prose sources
        mixed += [lst[i] for lst in (prose, licences) if i < len(lst)]
    return {"code": code, "prose": mixed}


# The held-out text, pinned: this repository's Python code (its first files in path order, ~130 KB) and its README /
# ARCHITECTURE at the commit whose run published the figures in BENCHMARKS.md, shipped gzipped in deploy/ and
# checked against this hash, so the published rates do not move when the docs or the code are edited.
HELD_OUT = REPO_ROOT / "deploy" / "privacy_held_out.json.gz"
HELD_OUT_SHA256 = "b66a143d8116dc57e4e5ec0b84e768bdd0142ce34180814d692d99403ff792a0"


def held_out_texts(path: Path = HELD_OUT) -> dict[str, list[str]]:
    """The pinned held-out text (HELD_OUT): code files and prose files, each in its original order."""
    pinned = pinned_json(path, HELD_OUT_SHA256)
    return {kind: [text for _, text in pinned[kind]] for kind in ("code", "prose")}


def sequences(tok: Any, texts: list[str], tokens: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len] token ids: consecutive windows of the texts, spread over the texts, ~`tokens` in all."""
    need = max(1, tokens // seq_len)
    per_text: list[list[list[int]]] = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        per_text.append([ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)])
        if sum(map(len, per_text)) >= 4 * need:
            break
    out: list[list[int]] = []
    depth = 0
    while len(out) < need and any(depth < len(w) for w in per_text):  # round robin: a window from each text in turn
        out += [w[depth] for w in per_text if depth < len(w)]
        depth += 1
    if not out:
        raise SystemExit(f"no {seq_len}-token window in the texts")
    return torch.tensor(out[:need])


# --- what the worker receives -----------------------------------------------------------------------


def shallow_states(
    model: nn.Module, ids: torch.Tensor, ms: list[int], batch: int = 8, wire_dtype: torch.dtype = torch.float32
) -> dict[int, torch.Tensor]:
    """{m: [seqs, len, hidden]}: the real input submodel's output for each m, as the worker receives it (cast to
    the wire dtype and back, through clients/hat/wire.py's encoding).

    One InputSubmodel(max m) pass: its stack's layer j output is exactly InputSubmodel(j + 1)'s output (the same
    layers, positions and masks), so a forward hook on each layer gives every m at the cost of the largest."""
    from clients.hat.split import InputSubmodel

    sub = InputSubmodel(model, max(ms))
    got: dict[int, list[torch.Tensor]] = {m: [] for m in ms}
    current: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(lambda _mod, _inp, out, m=j + 1: current.__setitem__(m, out))
        for j, layer in enumerate(sub.stack.layers)
    ]
    try:
        with torch.inference_mode():
            for i in range(0, ids.shape[0], batch):
                sub(ids[i : i + batch])
                for m in ms:
                    got[m].append(as_received(current[m], wire_dtype))
    finally:
        for h in hooks:
            h.remove()
    return {m: torch.cat(v) for m, v in got.items()}


def as_received(hidden: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """`hidden` after a trip through a hidden-state frame in `wire_dtype`, as float32."""
    from clients.hat import wire

    data = wire.encode_tensor(wire.Kind.DRAFT, bytes(16), 1, hidden, wire_dtype=wire_dtype)
    return wire.decode_frame(data, max_frame_bytes=len(data)).tensor().float()  # one frame for all: no size limit


def noised(states: torch.Tensor, level: float, seed: int, wire_dtype: torch.dtype) -> torch.Tensor:
    """What the worker receives with HATOptions.noise = level (clients/hat/noise.py's add_noise)."""
    from clients.hat.noise import add_noise, noise_generator

    if level == 0:
        return states
    return as_received(add_noise(states, level, noise_generator(seed)), wire_dtype)


# --- the attacks ------------------------------------------------------------------------------------


@dataclass
class AttackData:
    fit_states: torch.Tensor  # [seqs, len, dim]
    fit_ids: torch.Tensor  # [seqs, len]
    eval_states: torch.Tensor
    eval_ids: torch.Tensor
    eval_kind: torch.Tensor  # [seqs] 0 code, 1 prose
    extra: dict[str, Any] = field(default_factory=dict)


def _rates(pred: torch.Tensor, data: AttackData) -> dict[str, float]:
    ids = data.eval_ids
    pred = pred.reshape(ids.shape)
    out = {"all": recovery_rate(pred, ids)}
    for kind, name in ((0, "code"), (1, "prose")):
        rows = data.eval_kind == kind
        if rows.any():
            out[name] = recovery_rate(pred[rows], ids[rows])
    return out


def run_attacks(
    data: AttackData,
    embeddings: torch.Tensor,
    alpha: float,
    inverter_seconds: float,
    attacker_states: Any = None,
    near: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Nearest / linear / inverter recovery on data's eval set. `attacker_states`: extra fitting states (e.g. noised
    ones) to fit on as well; the better of the two fits on the eval set is reported, with which it was."""
    flat_eval = data.eval_states.reshape(-1, data.eval_states.shape[-1])
    out: dict[str, Any] = {"nearest": _rates(nearest_rows(flat_eval, embeddings), data)}
    targets = embeddings[data.fit_ids.reshape(-1)].float()
    fits = {"clean": data.fit_states} if attacker_states is None else {"clean": data.fit_states, **attacker_states}
    best: dict[str, Any] = {}
    for name, states in fits.items():
        probe = LinearProbe.fit(states.reshape(-1, states.shape[-1]), targets, alpha)
        rates = _rates(nearest_rows(probe(flat_eval), embeddings), data)
        if not best or rates["all"] > best["rates"]["all"]:
            best = {"rates": rates, "probe": probe, "fit_on": name, "states": states}
    out["linear"] = best["rates"] | {"fit_on": best["fit_on"]}
    if inverter_seconds > 0:
        inv, info = train_inverter(best["states"], data.fit_ids, embeddings, best["probe"], inverter_seconds, near=near)
        with torch.inference_mode():
            pred = inv(data.eval_states)
        out["inverter"] = _rates(nearest_rows(pred, embeddings), data) | {"fit_on": best["fit_on"]} | info
    return out


# --- device cost -------------------------------------------------------------------------------------


def input_ms_per_token(model: nn.Module, m: int, context: int = 256, repeat: int = 7) -> float:
    """Median ms of one decode step of the input submodel (m layers + embedding) with a `context`-token KV cache,
    on one torch thread (the gateway's device half default)."""
    from clients.hat.split import InputSubmodel

    sub = InputSubmodel(model, m)
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            cache = sub.new_cache()
            sub(ids[:, :context], cache, positions=0)
            samples = []
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                sub(ids[:, context:], cache, positions=context)
                samples.append(time.perf_counter() - t0)
                cache.crop(context)
    finally:
        torch.set_num_threads(threads)
    return 1e3 * statistics.median(samples[1:])


def adapter_note(model: str, m: int) -> dict[str, Any]:
    """The shipped adapter's held-out accept length for this m (its report: eta 0.6, low-confidence draft sent)."""
    from clients.hat.adapter import shipped_adapter_path

    path = shipped_adapter_path(model, m)
    meta = path.with_suffix(".json")
    if not path.is_file():
        return {"adapter": None}
    try:
        rounds = json.loads(meta.read_text())["report"]["variants"]["trained"]["rounds"]
        return {"adapter": path.name, "accept_length": rounds["eta=0.6,send_low"]["accept_length"]}
    except (OSError, KeyError, ValueError):
        return {"adapter": path.name}


# --- noise with a real worker --------------------------------------------------------------------------


async def live_noise(args: argparse.Namespace, model: Any, tok: Any, levels: list[float]) -> list[dict[str, Any]]:
    """Accept length, TBT and greedy agreement with the noiseless output, per noise level, through a real worker."""
    from app.config import EmbeddedWorkerSettings
    from app.embedded import EmbeddedWorker
    from app.tools.bench.hat_setup import run_request
    from clients.hat.adapter import draft_files
    from clients.hat.device import HATBackend
    from clients.hat.link import LinkProfile
    from clients.hat.options import HATOptions

    prompts = held_out_prompts(tok, args.live_prompts)
    adapter, vocab = draft_files(args.model, args.default_m)
    cpus = [args.worker_core] if args.worker_core >= 0 else None
    worker = EmbeddedWorker(  # as `tandem bench hat` runs it: a subprocess on its own core, one thread
        EmbeddedWorkerSettings(num_threads=1, cpus=cpus, device=args.worker_device), args.model, args.default_m, None
    )
    worker.start()
    await worker.wait_ready()
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    if args.device_core >= 0:
        os.sched_setaffinity(0, {args.device_core})
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    try:
        reference: list[list[int]] = []
        for level in levels:
            options = HATOptions(
                worker_url=worker.url, m=args.default_m, link=LinkProfile.parse(args.link), round_timeout=600.0,
                noise=level, noise_seed=args.seed,
            )  # fmt: skip
            backend = HATBackend(
                options, model_id=args.model, adapter_path=adapter, draft_vocab_path=vocab, model=model, tokenizer=tok
            )
            await backend.start()
            await run_request(backend, prompts[0], 2)  # warm-up
            runs = []
            rounds0, tokens0 = backend.stats.rounds, backend.stats.round_tokens
            for ids in prompts:
                runs.append(await run_request(backend, ids, args.live_tokens))
            await backend.close()
            outputs = [r["ids"] for r in runs]
            if not reference:
                reference = outputs if level == 0 else []
            rounds = backend.stats.rounds - rounds0
            row: dict[str, Any] = {
                "noise": level,
                "accept_length": (backend.stats.round_tokens - tokens0) / rounds if rounds else float("nan"),
                "tbt_ms": statistics.median(r["tbt_ms"] for r in runs if r["tokens"] > 1),
                "tokens": sum(r["tokens"] for r in runs),
            }
            if reference:
                row |= agreement(outputs, reference)
            rows.append(row)
            print(f"  live noise {level:g}: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        worker.stop()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return rows


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Greedy agreement with the reference outputs: the share of outputs identical to theirs, and the mean share of
    each reference output reproduced before the first differing token."""
    same = [a == b for a, b in zip(outputs, reference, strict=True)]
    prefix = []
    for a, b in zip(outputs, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(b), 1))
    return {"identical": sum(same) / len(same), "prefix_agreement": statistics.mean(prefix)}


def held_out_prompts(tok: Any, n: int) -> list[list[int]]:
    from app.tools.training.corpus import DEFAULT_PROMPTS, chat_ids, is_held_out, load_prompts

    prompts = load_prompts(DEFAULT_PROMPTS)
    return [chat_ids(tok, p) for i, p in enumerate(prompts) if is_held_out(i)][:n]


# --- report -----------------------------------------------------------------------------------------


ATTACKS = ("nearest", "linear", "inverter")


def _summary(row: dict[str, Any]) -> str:
    return ", ".join(f"{a} {_pct(row[a]['all'])}" for a in ATTACKS if a in row)


def _pct(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def report(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        "# HAT privacy: what the hidden states reveal",
        "",
        f"`tandem bench privacy {s['argv']}` — {s['date']}, {s['cpu']}, torch {s['torch']}; model {s['model']} "
        f"(fp32, hidden {s['hidden_size']}, vocab {s['vocab_size']}), wire dtype {s['wire_dtype']}; "
        f"fit on {s['fit_tokens']} tokens (stdlib code + docstrings/licences), held out {s['eval_tokens']} tokens "
        f"(this repository's code + README/ARCHITECTURE at 717abd1, pinned), {s['seq_len']}-token sequences; "
        f"{s['seconds']:.0f} s.",
        "",
        "Top-1 recovery of the input tokens from the states the worker receives (whole vocabulary):",
        "",
        "| m | nearest embedding | linear probe | learned inverter | input submodel ms/token | adapter accept length |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["by_m"]:
        inv = r.get("inverter")
        adapter = f"{r['accept_length']:.2f} (shipped)" if r.get("accept_length") else "no adapter"
        lines.append(
            f"| {r['m']} | {_pct(r['nearest']['all'])} | {_pct(r['linear']['all'])} | "
            f"{_pct(inv['all']) if inv else '—'} | {r['input_ms']:.1f} | {adapter} |"
        )
    lines += ["", "By held-out kind (code / prose):", "", "| m | nearest | linear probe | learned inverter |",
              "|---|---|---|---|"]  # fmt: skip
    for r in results["by_m"]:
        cells = []
        for a in ("nearest", "linear", "inverter"):
            x = r.get(a)
            cells.append(f"{_pct(x.get('code'))} / {_pct(x.get('prose'))}" if x else "—")
        lines.append(f"| {r['m']} | " + " | ".join(cells) + " |")
    if results.get("noise"):
        m = s["default_m"]
        lines += ["", f"Noise (HATOptions.noise, relative std per hidden vector) at m = {m}: recovery by the "
                  "same attacks (attacker fitted on clean or on equally noised states, whichever recovers more: "
                  "named)"]  # fmt: skip
        live = {r["noise"]: r for r in results.get("live", [])}
        head = "| noise | nearest | linear probe | learned inverter |"
        sep = "|---|---|---|---|"
        if live:
            head += " accept length | TBT ms | identical outputs | prefix agreement |"
            sep += "---|---|---|---|"
        lines += ["", head, sep]
        for r in results["noise"]:
            inv = r.get("inverter")
            row = (f"| {r['noise']:g} | {_pct(r['nearest']['all'])} | {_pct(r['linear']['all'])} "
                   f"({r['linear']['fit_on']}) | "
                   + (f"{_pct(inv['all'])} ({inv['fit_on']})" if inv else "—") + " |")  # fmt: skip
            lv = live.get(r["noise"])
            if lv:
                row += (f" {lv['accept_length']:.2f} | {lv['tbt_ms']:.0f} | {_pct(lv.get('identical'))} | "
                        f"{_pct(lv.get('prefix_agreement'))} |")  # fmt: skip
            elif live:
                row += " — | — | — | — |"
            lines.append(row)
        if live:
            lines += ["", f"Live: {s.get('live_prompts')} held-out chat prompts x {s.get('live_tokens')} greedy "
                      f"tokens through a real worker on loopback (link {s['link']}; device and worker on one core "
                      "each); agreement is with the noise-0 run's output."]  # fmt: skip
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str | Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if results.get("noise") else 1, figsize=(11, 4.2), squeeze=False)
    ax = axes[0][0]
    ms = [r["m"] for r in results["by_m"]]
    for attack, label in (("nearest", "nearest embedding"), ("linear", "linear probe"), ("inverter", "inverter")):
        ys = [100 * r[attack]["all"] if r.get(attack) else float("nan") for r in results["by_m"]]
        ax.plot(ms, ys, marker="o", label=label)
    ax.set_xlabel("m (layers on the device)")
    ax.set_ylabel("tokens recovered (%)")
    ax.set_ylim(0, 100)
    ax.set_title("What the worker can recover")
    ax2 = ax.twinx()
    ax2.plot(ms, [r["input_ms"] for r in results["by_m"]], "k--", alpha=0.5, label="input submodel ms/token")
    ax2.set_ylabel("device input submodel ms/token (dashed)")
    ax2.set_ylim(bottom=0)
    ax.legend(loc="center right", fontsize=8)
    if results.get("noise"):
        ax = axes[0][1]
        rows = results["noise"]
        xs = [r["noise"] for r in rows]
        for attack in ("nearest", "linear", "inverter"):
            ys = [100 * r[attack]["all"] if r.get(attack) else float("nan") for r in rows]
            ax.plot(xs, ys, marker="o", label=f"{attack} recovery")
        live = {r["noise"]: r for r in results.get("live", [])}
        if live:
            ax.plot(xs, [100 * live.get(x, {}).get("prefix_agreement", float("nan")) for x in xs], "k:", marker="s",
                    label="greedy prefix agreement")  # fmt: skip
        ax.set_xscale("symlog", linthresh=min([x for x in xs if x > 0] or [0.01]))
        ax.set_xlabel(f"noise (relative std), m = {results['setup']['default_m']}")
        ax.set_ylabel("%")
        ax.set_ylim(0, 100)
        ax.set_title("Noise: recovery vs quality")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench privacy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8], help="split points to attack")
    p.add_argument("--default-m", type=int, default=2, help="the split point of the noise section")
    p.add_argument("--wire-dtype", choices=["float32", "float16"], default="float32")
    p.add_argument("--fit-tokens", type=int, default=20_000)
    p.add_argument("--eval-tokens", type=int, default=2048, help="held out: half code, half prose")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1e-3, help="ridge penalty x n on standardised features")
    p.add_argument("--inverter-seconds", type=float, default=20.0, help="training time per inverter (0: skip)")
    p.add_argument("--noise", type=float, nargs="*", default=[0.0, 0.3, 1.0, 2.0], help="noise levels (at default m)")
    p.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the noise levels' accept length / TBT / agreement through a real worker")  # fmt: skip
    p.add_argument("--live-prompts", type=int, default=3)
    p.add_argument("--live-tokens", type=int, default=32)
    p.add_argument("--link", default=DEFAULT_LINK)
    p.add_argument("--device-core", type=int, default=0, help="pin the device half here while live (-1: no pinning)")
    p.add_argument("--worker-core", type=int, default=1, help="pin the worker here (-1: no pinning)")
    p.add_argument("--worker-device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the attacks (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long smoke run: m 1-2, few tokens, short inverter, no live part")  # fmt: skip
    p.add_argument("--out", default="var/bench/privacy.md")
    p.add_argument("--plot", default="docs/bench/privacy.png", help="the plot ('' for none)")
    return p


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from clients.hat import wire
    from clients.hf_model import load_hf_model
    from deploy.models import resolve_model

    if args.quick:
        args.ms, args.fit_tokens, args.eval_tokens, args.seq_len = [1, 2], 3072, 512, 64
        args.inverter_seconds, args.noise, args.live = 2.0, [0.0, 0.3], False
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[privacy {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    model, tok = load_hf_model(resolve_model(args.model))
    model.eval()
    embeddings = model.model.embed_tokens.weight.detach().float()
    wire_dtype = wire.dtype_by_name(args.wire_dtype)
    fit, held = fit_texts(), held_out_texts()
    fit_ids = torch.cat([sequences(tok, fit["code"], args.fit_tokens // 2, args.seq_len),
                         sequences(tok, fit["prose"], args.fit_tokens // 2, args.seq_len)])  # fmt: skip
    code_ids = sequences(tok, held["code"], args.eval_tokens // 2, args.seq_len)
    prose_ids = sequences(tok, held["prose"], args.eval_tokens // 2, args.seq_len)
    eval_ids = torch.cat([code_ids, prose_ids])
    eval_kind = torch.cat([torch.zeros(len(code_ids), dtype=torch.long), torch.ones(len(prose_ids), dtype=torch.long)])
    log(f"{fit_ids.numel()} fitting tokens, {eval_ids.numel()} held-out tokens")
    ms = sorted(set(args.ms) | ({args.default_m} if args.noise else set()))
    fit_states = shallow_states(model, fit_ids, ms, wire_dtype=wire_dtype)
    eval_states = shallow_states(model, eval_ids, ms, wire_dtype=wire_dtype)
    log("hidden states computed")
    near = embedding_neighbours(embeddings, torch.unique(fit_ids), 8) if args.inverter_seconds > 0 else None
    log("hard negatives found")
    results: dict[str, Any] = {"by_m": [], "noise": []}
    for m in sorted(args.ms):
        data = AttackData(fit_states[m], fit_ids, eval_states[m], eval_ids, eval_kind)
        row = {"m": m, **run_attacks(data, embeddings, args.alpha, args.inverter_seconds, near=near)}
        row["input_ms"] = input_ms_per_token(model, m)
        row |= adapter_note(args.model, m)
        results["by_m"].append(row)
        log(f"m={m}: {_summary(row)}")
    for level in args.noise:
        m = args.default_m
        if level == 0:
            base = next((r for r in results["by_m"] if r["m"] == m), None)
            if base is not None:
                results["noise"].append({"noise": 0.0, **{a: base[a] for a in ATTACKS if a in base}})
                continue
        data = AttackData(fit_states[m], fit_ids, noised(eval_states[m], level, args.seed + 1, wire_dtype), eval_ids,
                          eval_kind)  # fmt: skip
        attacker = {"noised": noised(fit_states[m], level, args.seed + 2, wire_dtype)} if level > 0 else None
        row = {"noise": level, **run_attacks(data, embeddings, args.alpha, args.inverter_seconds, attacker, near)}
        results["noise"].append(row)
        log(f"noise {level:g}: {_summary(row)}")
    del fit_states, eval_states
    if args.live and args.noise:
        results["live"] = asyncio.run(live_noise(args, model, tok, sorted(set(args.noise) | {0.0})))
    results["setup"] = {
        "argv": " ".join(argv), "date": time.strftime("%Y-%m-%d"), "cpu": f"{cpu_name()} ({os.cpu_count()} cores)",
        "torch": torch.__version__, "model": args.model, "hidden_size": model.config.hidden_size,
        "vocab_size": embeddings.shape[0], "wire_dtype": args.wire_dtype, "fit_tokens": fit_ids.numel(),
        "eval_tokens": eval_ids.numel(), "seq_len": args.seq_len, "default_m": args.default_m, "link": args.link,
        "live_prompts": args.live_prompts, "live_tokens": args.live_tokens, "alpha": args.alpha,
        "inverter_seconds": args.inverter_seconds, "seconds": time.perf_counter() - t_start,
    }  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    results = run(args, argv)
    publish(report(results), args.out)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
