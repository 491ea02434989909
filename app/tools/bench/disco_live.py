"""`tandem bench disco-live`: DiSCo against Stoch on the real backends, behind an injected-latency link.

`--dialects` runs the other comparison: migration onto a cloud that is not the device's vocabulary (the tokenizer
a real provider has) in a continuation dialect (`completions` with the cloud's own chat template, text continuation
across tokenizers) against today's only choice for such a cloud (`continuation = "chat"`, never a migration
target), each request answered through both, side by side: cost, TTFT, migrations.

The simulator (`tandem bench disco`) shows the ordering on 10,000 synthetic
requests; this confirms it live. A real gateway serves the bundled pair —
Qwen2.5-Coder-0.5B on llama.cpp as the device, the 1.5B behind a real
OpenAI-compatible server as the cloud — and the cloud is reached through a
loopback TCP proxy that holds each connection's first response byte for a
delay drawn from the same log-normal server-TTFT fit the simulator uses
(network + provider queueing; this kernel has no netem). The same seeded
prompts (lengths log-normal) go through each policy at the same budget, one at a
time; the client measures TTFT. Server-constrained regime (the cloud is the
dearer side), as in the paper's Table 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import sys
import threading
import time

import httpx

from app.tools.bench.output import publish

_WORDS = ("data", "model", "token", "stream", "cloud", "device", "cache", "queue", "graph", "tensor", "route")


class DelayLink:
    """TCP proxy on loopback: holds the first response bytes of every request for a delay drawn
    from log-normal(median, sigma); the rest of the response flows freely. Per request, not per
    connection: the gateway keeps connections alive."""

    def __init__(self, target_port: int, median: float, sigma: float, seed: int):
        self.target_port = target_port
        self.median, self.sigma = median, sigma
        self.rng = random.Random(seed)
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        hold = [0.0]  # delay owed before the next response bytes

        def draw() -> float:
            return self.median * math.exp(self.sigma * self.rng.gauss(0, 1))

        async def pipe(src, dst, requests: bool) -> None:
            try:
                while data := await src.read(65536):
                    if requests:
                        hold[0] = draw()  # a new request: its response will be held
                    elif hold[0]:
                        await asyncio.sleep(hold[0])
                        hold[0] = 0.0
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))


def _prompt(rng: random.Random, median: int, sigma: float) -> str:
    n = max(4, min(700, int(median * math.exp(sigma * rng.gauss(0, 1)))))
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _messages(words: str, tag: str) -> list[dict]:
    # The tag comes first so no two runs share a prompt prefix beyond the chat template's own:
    # otherwise llama.cpp's prefix cache would answer a repeated prompt almost for free.
    return [{"role": "user", "content": f"[{tag}] Summarise in one line: {words}"}]


def _ttft(url: str, messages, policy: str) -> float:
    body = {
        "model": "tandem",
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "tandem": {"policy": policy},
    }
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - t0
    raise RuntimeError("no content in the answer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench disco-live", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--requests", type=int, default=30)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--ttft-median", type=float, default=0.405, help="injected cloud delay median (s)")
    parser.add_argument("--ttft-sigma", type=float, default=0.6, help="log-normal sigma of the injected delay")
    parser.add_argument("--prompt-median", type=int, default=48, help="prompt length median (words)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="var/bench/disco-live.md")
    parser.add_argument(
        "--dialects",
        action="store_true",
        help="migration onto a chat cloud in a continuation dialect against continuation = 'chat' (cost, TTFT)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length with --dialects")
    parser.add_argument(
        "--consumption-rate", type=float, default=None, help="r_c (tokens/s) with --dialects (default: the config's)"
    )
    parser.add_argument(
        "--llama-server",
        action="store_true",
        help="with --dialects: the cloud is llama.cpp's llama-server serving SmolLM2-135M (another tokenizer), "
        "continued in the prefill dialect",
    )
    args = parser.parse_args(argv)
    if args.dialects:
        return _dialects(args)

    from app.config import EmbeddedServerSettings
    from app.embedded import EmbeddedServer
    from app.launcher import start_gateway, stop_gateway
    from deploy.models import fetch

    # Device and cloud on separate cores, one thread each: on one shared CPU a race would make the
    # two models fight for the same cores, which no real device-cloud pair does.
    cloud = EmbeddedServer(
        EmbeddedServerSettings(port=0, n_threads=1, cpus=[1]),
        fetch("qwen2.5-coder-1.5b-instruct"),
        "qwen2.5-coder-1.5b-instruct",
    )
    cloud.start()
    gw = None
    try:
        asyncio.run(cloud.wait_ready())
        link = DelayLink(cloud.port, args.ttft_median, args.ttft_sigma, args.seed)
        gw = start_gateway(
            f"""
[gateway]
policy = "disco-s"
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_threads = 1
[disco]
side = "server"
budget = {args.budget}
migration = false
[clouds.cloud]
base_url = "http://127.0.0.1:{link.port}/v1"
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
""",
            cpus=[0],
        )
        rng = random.Random(args.seed)
        prompts = [_prompt(rng, args.prompt_median, 0.6) for _ in range(args.requests)]
        policies = ("disco-s", "stoch-s", "server-only", "device-only")
        # Warm-up: DiSCo's estimators see the cloud's TTFTs and prompt lengths, as after some use.
        for i, words in enumerate(prompts[: max(5, args.requests // 5)]):
            _ttft(gw.v1, _messages(words, f"warm-up {i}"), "stoch-s")
        results: dict[str, list[float]] = {p: [] for p in policies}
        for i, words in enumerate(prompts):  # interleaved: load drifts hit every policy alike
            for policy in policies:
                results[policy].append(_ttft(gw.v1, _messages(words, f"{i} {policy}"), policy))
    finally:
        if gw is not None:
            stop_gateway(gw)
        cloud.stop()

    def p99(v: list[float]) -> float:
        s = sorted(v)
        return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]

    lines = [
        f"tandem bench disco-live -n {args.requests} --budget {args.budget}  ({time.strftime('%Y-%m-%d')}; "
        f"injected cloud delay log-normal(median {args.ttft_median} s, σ {args.ttft_sigma}))",
        "",
        "| policy | mean TTFT (s) | median (s) | P99 (s) |",
        "|---|---|---|---|",
    ]
    for policy, v in results.items():
        lines.append(f"| {policy} | {statistics.mean(v):.3f} | {statistics.median(v):.3f} | {p99(v):.3f} |")
    d, s = results["disco-s"], results["stoch-s"]
    lines += [
        "",
        f"DiSCo-S vs Stoch-S at b = {args.budget}: mean {statistics.mean(d) / statistics.mean(s):.2f}×, "
        f"P99 {p99(d) / p99(s):.2f}×",
    ]
    publish("\n".join(lines), args.out)
    return 0


def _answer(url: str, messages, cloud: str, max_tokens: int) -> tuple[float, dict]:
    """(client TTFT, the request's trace) of one streamed answer DiSCo plays against `cloud`."""
    body = {
        "model": "tandem",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "tandem": {"cloud": cloud},
    }
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no content in the answer")
    return ttft, httpx.get(f"{url}/requests/{request_id}", timeout=10).json()


def _dialects(args) -> int:
    """DiSCo (auto side) with the device's decoding dear (λ = 50) and a cheap cloud: the constrained side is the
    device, so DiSCo-D races, and an answer the device starts pays to move to the cloud. The one cloud server behind
    the delay link is configured twice, as a provider would be (tokenizer unknown): `chat`, today's only choice, and
    `text`, in a continuation dialect: the embedded Qwen2.5-Coder-1.5B with `continuation = "completions"` and its
    own template, or (`--llama-server`) llama.cpp's llama-server serving SmolLM2-135M with `continuation =
    "prefill"`."""
    from app.config import EmbeddedServerSettings
    from app.embedded import EmbeddedServer
    from app.launcher import start_gateway, stop_gateway
    from deploy.models import fetch

    model = "smollm2-135m-instruct" if args.llama_server else "qwen2.5-coder-1.5b-instruct"
    if args.llama_server:
        from app.launcher import start_llama_server, stop_server

        server = start_llama_server(fetch(model), alias=model, ctx_size=2048, threads=1, cpus=[1])
        port, stop = int(server.url.rsplit(":", 1)[1]), lambda: stop_server(server)
        moving = 'continuation = "prefill"'
    else:
        cloud = EmbeddedServer(EmbeddedServerSettings(port=0, n_threads=1, cpus=[1]), fetch(model), model)
        cloud.start()
        asyncio.run(cloud.wait_ready())
        port, stop = cloud.port, cloud.stop
        moving = f'continuation = "completions"\ntemplate = "{model}"'
    gw = None
    price = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"
    entries = {"chat": 'continuation = "chat"', "text": moving}
    try:
        link = DelayLink(port, args.ttft_median, args.ttft_sigma, args.seed)
        clouds = "".join(
            f"""
[clouds.{name}]
base_url = "http://127.0.0.1:{link.port}/v1"
model = "{model}"
price = {price}
{entry}
"""
            for name, entry in entries.items()
        )
        gw = start_gateway(
            f"""
[gateway]
policy = "disco"
cloud = "chat"
stall_timeout = 60
[device]
model = "qwen2.5-coder-0.5b-instruct"
n_threads = 1
[disco]
exchange_rate = 50
migration = true
{f"consumption_rate = {args.consumption_rate}" if args.consumption_rate else ""}
{clouds}""",
            cpus=[0],
        )
        rng = random.Random(args.seed)
        prompts = [_prompt(rng, args.prompt_median, 0.6) for _ in range(args.requests)]
        for i, words in enumerate(prompts[: max(3, args.requests // 5)]):  # the estimators see both endpoints
            for name in entries:
                _answer(gw.v1, _messages(words, f"warm-up {i} {name}"), name, 4)
        rows: dict[str, list[tuple[float, dict]]] = {name: [] for name in entries}
        for i, words in enumerate(prompts):  # interleaved: load drifts hit both alike
            for name in entries:
                rows[name].append(_answer(gw.v1, _messages(words, f"{i} {name}"), name, args.max_tokens))
    finally:
        if gw is not None:
            stop_gateway(gw)
        stop()

    lines = [
        f"tandem bench disco-live --dialects -n {args.requests} --max-tokens {args.max_tokens}"
        + (f" --consumption-rate {args.consumption_rate}" if args.consumption_rate else "")
        + (" --llama-server" if args.llama_server else "")
        + "  "
        f"({time.strftime('%Y-%m-%d')}; injected cloud delay log-normal(median {args.ttft_median} s, "
        f"σ {args.ttft_sigma}); DiSCo auto side, λ = 50, cloud 0.05 / 0.10 USD per million)",
        "",
        "| cloud continuation | mean cost (µUSD) | median TTFT (s) | P90 TTFT (s) | device-started | moved to cloud |",
        "|---|---|---|---|---|---|",
    ]
    costs = {}
    for name, results in rows.items():
        ttfts = sorted(t for t, _ in results)
        costs[name] = statistics.mean(tr["cost_usd"] for _, tr in results) * 1e6
        started = sum(
            any(
                e["endpoint"] == "device" and e["outcome"] in ("migrated-from", "finished") and e["from_token"] == 0
                for e in tr["endpoints"]
            )
            for _, tr in results
        )
        moved = sum(any(m["to"] == name for m in tr["migrations"]) for _, tr in results)
        label = "chat (today: never a target)" if name == "chat" else entries[name].replace("\n", ", ")
        lines.append(
            f"| {label} | {costs[name]:.3f} | {statistics.median(ttfts):.3f} | "
            f"{ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))]:.3f} | {started}/{len(results)} | "
            f"{moved}/{len(results)} |"
        )
    lines += ["", f"cost with migration onto the chat cloud / without: {costs['text'] / costs['chat']:.2f}×"]
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
