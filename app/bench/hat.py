"""`tandem bench hat`: HAT (issue 4) end to end — Table 5 ablation, Table 4, component times, link sweep, and
the worker's throughput with and without continuous batching.

Set-up (one run): a real worker (`tandem worker`, a subprocess) hosts the middle layers; this process is the
device half (clients.hat.device.HATBackend with the shipped adapter and reduced draft vocabulary). By default
the worker is pinned to core 1 and the device half to core 0, one torch thread each, so the two halves never
compete for a core. Every device <-> worker frame goes through the link emulator (clients/hat/link.py;
default 20 ms RTT, 7.5 MB/s up, 12.5 MB/s down: the middle of the issue's 5-10 / 10-15 MB/s ranges).

With `--worker-device auto` (the default) the worker computes on a CUDA GPU when torch sees one, which is the
paper's regime (a cloud much faster than the device); the device half stays on the CPU. `--worker-url` points
the device half at a worker started elsewhere (e.g. on a GPU machine) instead.

Sections (`--sections`, all by default):
- table5: for each prompt length, the six SD / PC / PD combinations of the paper's Table 5, one greedy request
  each, interleaved per length: TTFT (request to first token, session set-up included) and TBT (mean time per
  token after the first).
- table4: accept length (tokens per verification round) and decode speedup (U-shape TBT / HAT TBT) on
  held-out prompts of deploy/adapter_prompts.txt, SD alone, as in the paper's Table 4.
- components: the device's input submodel, draft step (reduced and full vocabulary), LM head; the worker's
  middle compute per token count (timed as loopback round trips on a raw session, minus the loopback's own
  round trip); the link model's upload / download time for the same payloads.
- sweep: TBT of U-shape / SD / SD+PD over RTT, and TTFT without / with chunking over upload bandwidth: where
  each strategy starts to win.
- throughput: 1, 4 and 8 devices (raw protocol clients replaying real shallow states, so the devices' own
  compute does not bound the measurement) decoding concurrently (continuous batching) vs one at a time.

Greedy decoding throughout (HAT's output is then exactly the U-shape's, so the configurations produce the same
text and differ only in time). Results: printed tables (Markdown) and --out JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
DEFAULT_LINK = "latency=10ms,up=7.5MB/s,down=12.5MB/s"
_CODE_FILES = ("app/serving/orchestrator.py", "app/worker/engine.py", "clients/hat/device.py", "policies/dispatch.py")


@dataclass(frozen=True)
class Variant:
    sd: bool
    pc: bool
    pd: bool

    @property
    def name(self) -> str:
        on = [n for n, v in (("SD", self.sd), ("PC", self.pc), ("PD", self.pd)) if v]
        return "+".join(on) if on else "U-shape"


TABLE5 = [Variant(False, False, False), Variant(False, True, False), Variant(True, False, False),
          Variant(True, False, True), Variant(True, True, False), Variant(True, True, True)]  # fmt: skip
U_SHAPE, SD_ONLY, SD_PD = TABLE5[0], TABLE5[2], TABLE5[3]


# --- set-up -----------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from clients.hat.adapter import draft_files
        from clients.hat.link import LinkProfile
        from clients.hf_model import load_hf_model
        from deploy.models import resolve_model

        self.args = args
        self.link = LinkProfile.parse(args.link)
        self.gguf = resolve_model(args.model)
        self.model, self.tok = load_hf_model(self.gguf)
        self.model.eval()
        self.adapter, self.draft_vocab = draft_files(args.model, args.m)
        self.worker: Any = None
        self.url = args.worker_url
        self.info: dict[str, Any] = {}
        self.results: dict[str, Any] = {"setup": {}}

    async def start_worker(self) -> None:
        if self.url:
            return
        from app.config import EmbeddedWorkerSettings
        from app.embedded import EmbeddedWorker

        cpus = [self.args.worker_core] if self.args.worker_core >= 0 else None
        a = self.args
        settings = EmbeddedWorkerSettings(num_threads=a.worker_threads, cpus=cpus, device=a.worker_device)
        self.worker = EmbeddedWorker(settings, self.args.model, self.args.m, None)
        self.worker.start()
        await self.worker.wait_ready()
        self.url = self.worker.url

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def backend(self, v: Variant, link: Any = None, full_vocab: bool = False) -> Any:
        from clients.hat.device import HATBackend
        from clients.hat.options import HATOptions

        options = HATOptions(
            self.url,
            model_id=self.args.model,
            m=self.args.m,
            adapter_path=self.adapter,
            draft_vocab_path=None if full_vocab else self.draft_vocab,
            speculative=v.sd,
            parallel_drafting=v.pd,
            chunk_size=None if v.pc else 1 << 20,  # no chunking = the whole prompt in one frame
            link=self.link if link is None else link,
            round_timeout=600.0,
        )
        return HATBackend(options, model=self.model, tokenizer=self.tok)

    # --- prompts ------------------------------------------------------------------------------------

    def code_prompt(self, length: int) -> list[int]:
        """Exactly `length` tokens: a chat-templated request to explain a slice of this repository's code."""
        code = "\n".join((ROOT / f).read_text() for f in _CODE_FILES)
        marker = "\u2063"
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": f"Explain what this code does, briefly:\n```python\n{marker}\n```"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        head, tail = text.split(marker)
        ids_head = self.tok(head, add_special_tokens=False)["input_ids"]
        ids_tail = self.tok(tail, add_special_tokens=False)["input_ids"]
        room = length - len(ids_head) - len(ids_tail)
        body = self.tok(code, add_special_tokens=False)["input_ids"]
        if room <= 0 or room > len(body):
            raise SystemExit(f"cannot build a {length}-token prompt (room {room}, code {len(body)} tokens)")
        return [*ids_head, *body[:room], *ids_tail]

    def held_out_prompts(self, n: int) -> list[list[int]]:
        from app.training.train_adapter import chat_ids, is_held_out, load_prompts

        prompts = load_prompts(ROOT / "deploy" / "adapter_prompts.txt")
        held = [p for i, p in enumerate(prompts) if is_held_out(i)]
        return [chat_ids(self.tok, p) for p in held[:n]]


# --- one request ------------------------------------------------------------------------------------


async def run_request(backend: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    from clients.base import GenerationRequest

    before = backend.stats.summary() | {"round_tokens": backend.stats.round_tokens}
    req = GenerationRequest(prompt_text="", prompt_ids=tuple(ids), max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    async for ev in backend.stream(req):
        if ev.token_id is not None:
            times.append(time.perf_counter())
            tokens.append(ev.token_id)
    st = backend.stats
    rounds = st.rounds - before["rounds"]
    return {
        "prompt_tokens": len(ids),
        "tokens": len(tokens),
        "ttft_ms": 1e3 * (times[0] - t0),
        "tbt_ms": 1e3 * (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
        "accept_length": (st.round_tokens - before["round_tokens"]) / rounds if rounds else float("nan"),
        "ids": tokens,
    }


async def started(bench: Bench, v: Variant, **kw: Any) -> Any:
    b = bench.backend(v, **kw)
    await b.start()
    return b


# --- sections ---------------------------------------------------------------------------------------


async def table5(bench: Bench) -> list[dict[str, Any]]:
    a = bench.args
    backends = {v: await started(bench, v) for v in TABLE5}
    await run_request(backends[U_SHAPE], bench.code_prompt(128), 4)  # warm-up
    rows = []
    for length in a.lengths:
        ids = bench.code_prompt(length)
        for v in TABLE5:
            r = await run_request(backends[v], ids, a.decode_tokens)
            r.update(variant=v.name, sd=v.sd, pc=v.pc, pd=v.pd)
            rows.append(r)
            print(f"  table5 {length:5d} {v.name:9s} TTFT {r['ttft_ms']:8.0f} ms  TBT {r['tbt_ms']:6.1f} ms  "
                  f"accept {r['accept_length']:.2f}", file=sys.stderr)  # fmt: skip
        base = next(r for r in rows if r["prompt_tokens"] == length and r["variant"] == U_SHAPE.name)
        for r in rows:
            if r["prompt_tokens"] == length and r["ids"] != base["ids"]:
                r["differs_from_u_shape"] = True  # greedy HAT == U-shape up to fp near-ties (reported)
    for b in backends.values():
        await b.close()
    return rows


async def table4(bench: Bench) -> dict[str, Any]:
    from clients.hat.options import HATStats

    a = bench.args
    prompts = bench.held_out_prompts(a.table4_prompts)
    out: dict[str, Any] = {}
    for v in (U_SHAPE, SD_ONLY):
        b = await started(bench, v)
        await run_request(b, prompts[0], 4)
        b.stats = HATStats()  # count the measured requests only
        runs = [await run_request(b, ids, a.table4_tokens) for ids in prompts]
        out[v.name] = {
            "tbt_ms_median": statistics.median(r["tbt_ms"] for r in runs if r["tokens"] > 1),
            "tbt_ms_per_prompt": [round(r["tbt_ms"], 2) for r in runs],
            "tokens": sum(r["tokens"] for r in runs),
            "accept_length": b.stats.round_tokens / max(b.stats.rounds, 1) if v.sd else 1.0,
            "stats": b.stats.summary(),
        }
        print(f"  table4 {v.name}: {json.dumps({k: out[v.name][k] for k in ('tbt_ms_median', 'accept_length')})}",
              file=sys.stderr)  # fmt: skip
        await b.close()
    out["decode_speedup"] = out[U_SHAPE.name]["tbt_ms_median"] / out[SD_ONLY.name]["tbt_ms_median"]
    out["prompts"] = len(prompts)
    return out


def _timeit(fn: Any, repeat: int = 7) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


async def components(bench: Bench) -> dict[str, Any]:
    b = await started(bench, SD_ONLY)
    full = await started(bench, SD_ONLY, full_vocab=True)
    ids = bench.code_prompt(512)
    hidden = b.hidden_size
    out: dict[str, Any] = {"device_ms": {}, "worker_ms": {}, "link_ms": {}}
    dev = out["device_ms"]
    with torch.inference_mode():
        cache = b._input.new_cache()
        b._input(torch.tensor([ids[:256]]), cache, positions=0)

        def input_one() -> None:
            b._input(torch.tensor([[ids[256]]]), cache, positions=256)
            cache.crop(256)

        dev["input_submodel_1_token"] = _timeit(input_one)
        dev["input_submodel_256_tokens"] = _timeit(lambda: b._input(torch.tensor([ids[:256]]), None, positions=0), 3)
        feats = torch.randn(1, hidden)
        dev["draft_head_reduced_vocab"] = _timeit(lambda: b._draft_logits(feats, 0))
        dev["draft_head_full_vocab"] = _timeit(lambda: full._draft_logits(feats, 0))
        acache = b.adapter.new_cache()
        shallow = b._input(torch.tensor([ids[:256]]), None, positions=0)
        b.adapter(shallow, acache, positions=0)

        def adapter_one() -> None:
            b.adapter(shallow[:, :1], acache, positions=256)
            acache.crop(256)

        dev["adapter_1_token"] = _timeit(adapter_one)
        body = dev["input_submodel_1_token"] + dev["adapter_1_token"]
        dev["draft_step_reduced_vocab"] = body + dev["draft_head_reduced_vocab"]
        dev["draft_step_full_vocab"] = body + dev["draft_head_full_vocab"]
        for rows in (1, 4):
            deep = torch.randn(rows, hidden)
            dev[f"lm_head_{rows}_rows"] = _timeit(lambda deep=deep: b._output(deep))
    await b.close()
    await full.close()
    token_bytes = hidden * 4
    out["worker_ms"] = await worker_compute(bench, [1, 2, 4, 8, 16, 64, 256, 1024])
    link = bench.link
    for n in (1, 4, 256):
        up = n * token_bytes / link.up_bandwidth if link.up_bandwidth else 0.0
        down = n * token_bytes / link.down_bandwidth if link.down_bandwidth else 0.0
        out["link_ms"][f"{n}_tokens"] = {"upload": 1e3 * (up + link.latency), "download": 1e3 * (down + link.latency)}
    out["token_bytes"] = token_bytes
    return out


class RawDevice:
    """A device speaking the worker protocol directly (no device-side model): replays given shallow states."""

    def __init__(self, url: str, bench: Bench) -> None:
        self.url = url if "/v1/hidden/ws" in url else url.rstrip("/") + "/v1/hidden/ws"
        self.bench = bench
        self.seq = 0
        self.sid = b""

    async def __aenter__(self) -> RawDevice:
        from websockets.asyncio.client import connect

        from clients.hat import wire

        self.ws = await connect(self.url, max_size=None)
        cfg = self.bench.model.config
        params = {"protocol": 1, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
                  "m": self.bench.args.m, "dtype": "float32", "model": self.bench.args.model}  # fmt: skip
        await self.ws.send(wire.encode_text(wire.Kind.OPEN, b"\0" * 16, 0, json.dumps(params)))
        frame = wire.decode_frame(await self.ws.recv())
        self.sid = frame.session
        self.info = json.loads(frame.text())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        from clients.hat import wire

        with contextlib.suppress(Exception):
            self.seq += 1
            await self.ws.send(wire.encode_control(wire.Kind.CLOSE, self.sid, self.seq))
        await self.ws.close()

    async def send(self, states: torch.Tensor, position: int, kind: Any) -> None:
        from clients.hat import wire

        self.seq += 1
        await self.ws.send(wire.encode_tensor(kind, self.sid, self.seq, states, arg=position))
        reply = wire.decode_frame(await self.ws.recv())
        if reply.kind == wire.Kind.ERROR:
            raise RuntimeError(f"worker error: {reply.text()}")

    async def rollback(self, keep: int) -> None:
        from clients.hat import wire

        self.seq += 1
        await self.ws.send(wire.encode_control(wire.Kind.ROLLBACK, self.sid, self.seq, arg=keep))


def shallow_states(bench: Bench, n: int) -> torch.Tensor:
    from clients.hat.split import InputSubmodel

    ids = bench.code_prompt(max(n, 128))[:n]
    with torch.inference_mode():
        return InputSubmodel(bench.model, bench.args.m)(torch.tensor([ids]), None)[0]


async def worker_compute(bench: Bench, counts: list[int]) -> dict[str, float]:
    """Median loopback round trip of an n-token frame (no link emulation) minus that of an empty round trip."""
    from clients.hat import wire

    states = shallow_states(bench, max(counts) + 16)
    out: dict[str, float] = {}
    async with RawDevice(bench.url, bench) as d:
        await d.send(states[:16], 0, wire.Kind.PREFILL_CHUNK)
        for n in counts:
            samples = []
            for _ in range(5 if n <= 64 else 2):
                t0 = time.perf_counter()
                await d.send(states[16 : 16 + n], 16, wire.Kind.DRAFT)
                samples.append(time.perf_counter() - t0)
                await d.rollback(16)
            out[f"middle_{n}_tokens"] = 1e3 * statistics.median(samples)
    return out


async def sweep(bench: Bench) -> dict[str, Any]:
    from clients.hat.link import LinkProfile

    a, base = bench.args, bench.link
    out: dict[str, Any] = {"rtt": [], "up_bandwidth": []}
    short = bench.code_prompt(128)
    for rtt in a.sweep_rtt_ms:
        link = LinkProfile(latency=rtt / 2e3, up_bandwidth=base.up_bandwidth, down_bandwidth=base.down_bandwidth)
        row: dict[str, Any] = {"rtt_ms": rtt}
        for v in (U_SHAPE, SD_ONLY, SD_PD):
            b = await started(bench, v, link=link)
            row[v.name] = (await run_request(b, short, a.sweep_tokens))["tbt_ms"]
            await b.close()
        out["rtt"].append(row)
        print(f"  sweep rtt {rtt:5.0f} ms: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "rtt_ms"),
              file=sys.stderr)  # fmt: skip
    long = bench.code_prompt(a.sweep_prompt)
    for mbps in a.sweep_up_mbps:
        link = LinkProfile(latency=base.latency, up_bandwidth=mbps * 1e6, down_bandwidth=base.down_bandwidth)
        row = {"up_MBps": mbps}
        for v in (U_SHAPE, Variant(False, True, False)):
            b = await started(bench, v, link=link)
            row[v.name] = (await run_request(b, long, 1))["ttft_ms"]
            await b.close()
        out["up_bandwidth"].append(row)
        print(f"  sweep up {mbps:5.1f} MB/s: " + "  ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "up_MBps"),
              file=sys.stderr)  # fmt: skip
    return out


async def throughput(bench: Bench) -> dict[str, Any]:
    """Decode tokens/s of the worker for N devices: concurrent (continuous batching) vs one at a time."""
    from clients.hat import wire

    a = bench.args
    prompt = 64
    states = shallow_states(bench, prompt + a.throughput_tokens)

    async def one_device() -> int:
        async with RawDevice(bench.url, bench) as d:
            await d.send(states[:prompt], 0, wire.Kind.PREFILL_CHUNK)
            for i in range(a.throughput_tokens):
                await d.send(states[prompt + i : prompt + i + 1], prompt + i, wire.Kind.DRAFT)
        return a.throughput_tokens

    out = []
    await one_device()  # warm-up
    for n in a.throughput_devices:
        t0 = time.perf_counter()
        done = sum(await asyncio.gather(*(one_device() for _ in range(n))))
        concurrent = done / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = 0
        for _ in range(n):
            done += await one_device()
        sequential = done / (time.perf_counter() - t0)
        out.append({"devices": n, "batched_tok_s": concurrent, "one_at_a_time_tok_s": sequential,
                    "ratio": concurrent / sequential})  # fmt: skip
        print(f"  throughput {n} devices: batched {concurrent:.1f} tok/s, one at a time {sequential:.1f} tok/s",
              file=sys.stderr)  # fmt: skip
    return {"prompt_tokens": prompt, "decode_tokens_per_device": a.throughput_tokens, "rows": out}


# --- report -----------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = []
    setup = results["setup"]
    lines.append(f"setup: {json.dumps(setup)}")
    if "table5" in results:
        rows = results["table5"]
        lines += ["", "Table 5 (one greedy request per cell; TTFT ms / TBT ms; ratio to U-shape at that length)", "",
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
        lines += ["", "Table 4 (held-out prompts, SD alone)", "",
                  "| method | accept length | TBT median ms | speedup |", "|---|---|---|---|",
                  f"| U-shape | 1.00 | {t['U-shape']['tbt_ms_median']:.1f} | 1.00x |",
                  f"| HAT (SD) | {t['SD']['accept_length']:.2f} | {t['SD']['tbt_ms_median']:.1f} | "
                  f"{t['decode_speedup']:.2f}x |"]  # fmt: skip
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
    if "throughput" in results:
        lines += ["", "Worker throughput (decode tokens/s)", "", "| devices | batched | one at a time | ratio |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['devices']} | {r['batched_tok_s']:.1f} | {r['one_at_a_time_tok_s']:.1f} | {r['ratio']:.2f}x |"
                  for r in results["throughput"]["rows"]]  # fmt: skip
    return "\n".join(lines)


SECTIONS = ("components", "table5", "table4", "sweep", "throughput")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench hat", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--link", default=DEFAULT_LINK, help="link emulation (clients/hat/link.py syntax)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--table4-prompts", type=int, default=8)
    p.add_argument("--table4-tokens", type=int, default=64)
    p.add_argument("--sweep-rtt-ms", type=float, nargs="+", default=[0, 20, 50, 100, 200])
    p.add_argument("--sweep-up-mbps", type=float, nargs="+", default=[1, 2.5, 5, 10, 40])
    p.add_argument("--sweep-prompt", type=int, default=1024)
    p.add_argument("--sweep-tokens", type=int, default=32)
    p.add_argument("--throughput-devices", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--throughput-tokens", type=int, default=24)
    p.add_argument("--device-core", type=int, default=0, help="pin this process to the core (-1: no pinning)")
    p.add_argument("--worker-core", type=int, default=1, help="pin the worker to the core (-1: no pinning)")
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--worker-device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--worker-url", default=None, help="use a running worker (ws://host:port) instead of starting one")
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
            "model": args.model, "m": args.m, "link": args.link,
            "link_parsed": LinkProfile.parse(args.link).__dict__,
            "worker_compute_device": info.get("compute_device"), "worker_core": args.worker_core,
            "device_core": args.device_core, "device_threads": torch.get_num_threads(),
            "adapter": str(bench.adapter), "draft_vocab": str(bench.draft_vocab),
            "cpu": _cpu_name(),
        }  # fmt: skip
        for section in SECTIONS:
            if section in args.sections:
                t0 = time.perf_counter()
                print(f"[{section}]", file=sys.stderr, flush=True)
                bench.results[section] = await globals()[section](bench)
                bench.results.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t0, 1)
    finally:
        bench.stop_worker()
    return bench.results


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = asyncio.run(amain(args))
    for row in results.get("table5", []):
        row.pop("ids", None)
    print(report(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
