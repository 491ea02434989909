"""What every section of `tandem bench hat` runs on: the HAT variants, the worker and the device halves, the
prompts, one timed request, and a raw protocol client that replays shallow states without a device-side model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.tools import REPO_ROOT, pinned_json

DEFAULT_LINK = "latency=10ms,up=7.5MB/s,down=12.5MB/s"  # the HAT benches' link: 20 ms RTT, 7.5 / 12.5 MB/s


def add_bench_options(p: argparse.ArgumentParser) -> None:
    """The options every `Bench` reads: the model and split, the link, where the device half and the worker run."""
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--link", default=DEFAULT_LINK, help="link emulation (clients/hat/link.py syntax)")
    p.add_argument("--device-core", type=int, default=0, help="pin this process to the core (-1: no pinning)")
    p.add_argument("--worker-core", type=int, default=1, help="pin the worker to the core (-1: no pinning)")
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--worker-device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--worker-url", default=None, help="use a running worker (ws://host:port) instead of starting one")
    p.add_argument("--adapter", default="", help="draft adapter (safetensors; default: the shipped one)")
    p.add_argument("--draft-vocab", default="", help='its reduced draft vocabulary (JSON; "full": none)')


# The code Table 5's prompts explain: four of this repository's files as they were at one commit, shipped gzipped
# in deploy/ and checked against this hash, so the prompts (and the published Table 5) do not move when the code is
# edited. Held out from the adapter's training, which reads the standard library's code (app/tools/training).
TABLE5_CODE = REPO_ROOT / "deploy" / "table5_code.json.gz"
TABLE5_CODE_SHA256 = "e7faea9cd80f9fc4e47b141961ae27e581d93788678c15b74f3b753daa07d9fb"


def table5_code(path: Path = TABLE5_CODE) -> str:
    """The pinned code (TABLE5_CODE), its files joined in their pinned order."""
    return "\n".join(text for _, text in pinned_json(path, TABLE5_CODE_SHA256)["files"])


def code_prompt(tok: Any, length: int, index: int = 0) -> list[int]:
    """Exactly `length` tokens: a chat-templated request to explain a slice of the pinned code (table5_code);
    prompt `index` explains the `index`-th slice of that length (consecutive slices, wrapping round the code)."""
    code = table5_code()
    marker = "\u2063"
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"Explain what this code does, briefly:\n```python\n{marker}\n```"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    head, tail = text.split(marker)
    ids_head = tok(head, add_special_tokens=False)["input_ids"]
    ids_tail = tok(tail, add_special_tokens=False)["input_ids"]
    room = length - len(ids_head) - len(ids_tail)
    body = tok(code, add_special_tokens=False)["input_ids"]
    if room <= 0 or room > len(body):
        raise SystemExit(f"cannot build a {length}-token prompt (room {room}, code {len(body)} tokens)")
    start = index * room % (len(body) - room + 1)
    return [*ids_head, *body[start : start + room], *ids_tail]


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
        self.adapter, self.draft_vocab = draft_files(args.model, args.m, args.adapter, args.draft_vocab)
        self.worker: Any = None
        self.url = args.worker_url
        self.info: dict[str, Any] = {}
        self.results: dict[str, Any] = {"setup": {}}
        self._profile: Path | None = None

    async def profile(self) -> Path:
        """The profile the speculation sections plan with: --profile, else `tandem profile` run once now against this
        bench's worker, over its link, from this (pinned) process's core — the hardware the sections measure."""
        if self._profile is not None:
            return self._profile
        import asyncio
        import shlex
        import sys

        from app.tools.profiling.main import default_out
        from clients.hat.profile import load_profile

        a = self.args
        if a.profile:
            path = Path(a.profile)
        else:
            path = REPO_ROOT / default_out(a.model, a.m, prefix="bench-")
            cmd = [sys.executable, "-m", "app.cli", "profile", "--model", a.model, "--m", str(a.m),
                   "--worker-url", self.url, "--link", a.link, "--threads", "1", "--out", str(path),
                   *(["--quick"] if a.profile_quick else []), *shlex.split(a.profile_args)]  # fmt: skip
            print(f"  profile: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO_ROOT, stdout=asyncio.subprocess.DEVNULL)
            if await proc.wait() != 0:
                raise SystemExit(f"tandem profile failed (exit {proc.returncode}): {shlex.join(cmd[1:])}")
            self.results["profile_seconds"] = round(time.perf_counter() - t0, 1)
        profile = load_profile(path)  # refuse a profile for another model or m before measuring with it
        profile.check_model({a.model, self.gguf.name}, a.m)
        self.results["profile"] = {"path": str(path), "created": profile.raw.get("created"),
                                   "link": profile.raw.get("link"), "made_in_this_run": not a.profile}  # fmt: skip
        self._profile = path
        return path

    async def start_worker(self) -> None:
        if self.url:
            return
        from app.config import EmbeddedWorkerSettings
        from app.embedded import EmbeddedWorker

        cpus = [self.args.worker_core] if self.args.worker_core >= 0 else None
        a = self.args
        # The DP chunk plan prices the worker's prefill with its tau; profiled at start it is measured, not fitted
        # from the few lone pieces one bench run sends.
        profile_tau = True if "chunks" in getattr(a, "sections", ()) else None  # bench hat-streams has no sections
        settings = EmbeddedWorkerSettings(
            num_threads=a.worker_threads, cpus=cpus, device=a.worker_device, prefill_profile=profile_tau
        )
        self.worker = EmbeddedWorker(settings, self.args.model, self.args.m, None)
        self.worker.start()
        await self.worker.wait_ready()
        self.url = self.worker.url

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def backend(
        self,
        v: Variant,
        link: Any = None,
        full_vocab: bool = False,
        draft_length: str = "eta",
        tree_width: int = 0,
        chunking: str = "eq3",
        **options: Any,
    ) -> Any:
        """A device half of variant `v`; `options`: further HATOptions (eta, max_draft, tree_paths, profile, arca)."""
        from clients.hat.device import HATBackend
        from clients.hat.options import HATOptions

        options = HATOptions(
            parallel_drafting=options.pop("parallel_drafting", v.pd),
            worker_url=self.url,
            m=self.args.m,
            speculative=v.sd,
            draft_length=draft_length,
            tree_width=tree_width,
            chunking=chunking,
            chunk_size=None if v.pc else 1 << 20,  # no chunking = the whole prompt in one frame
            link=self.link if link is None else link,
            round_timeout=600.0,
            num_threads=None,  # the process's own (amain pins it to one core, or leaves torch's default)
            **options,
        )
        return HATBackend(
            options,
            model_id=self.args.model,
            adapter_path=self.adapter,
            draft_vocab_path=None if full_vocab else self.draft_vocab,
            model=self.model,
            tokenizer=self.tok,
        )

    # --- prompts ------------------------------------------------------------------------------------

    def code_prompt(self, length: int, index: int = 0) -> list[int]:
        return code_prompt(self.tok, length, index)

    def held_out_prompts(self, n: int) -> list[list[int]]:
        from app.tools.training.corpus import DEFAULT_PROMPTS, chat_ids, is_held_out, load_prompts

        prompts = load_prompts(DEFAULT_PROMPTS)
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
        while reply.kind == wire.Kind.STATUS:  # the worker's mu and g, riding with a verification: not the reply
            reply = wire.decode_frame(await self.ws.recv())
        if reply.kind == wire.Kind.ERROR:
            raise RuntimeError(f"worker error: {reply.text()}")

    async def rollback(self, keep: int) -> None:
        from clients.hat import wire

        self.seq += 1
        await self.ws.send(wire.encode_control(wire.Kind.ROLLBACK, self.sid, self.seq, arg=keep))
