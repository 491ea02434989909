"""`tandem bench gateway`: the gateway's own cost, measured against calling the upstream directly.

One run, side by side on loopback: a fast deterministic OpenAI-compatible upstream
(this module's `upstream` ASGI app, pre-rendered chunks, no model) and a real
`tandem serve` in front of it. The same load generator drives both paths in
alternating rounds, so machine noise hits them alike. Reports:

- added TTFT p50/p99 at 1 and 32 concurrent streams (gateway minus direct, per percentile);
- relayed chunk throughput at 32 streams, gateway / direct, for an upstream paced like a
  fast LLM (10 ms per chunk = 100 tok/s per stream) and for an unpaced one (saturation);
- the gateway process's CPU time per relayed chunk;
- the time to the first tool-call delta of a streamed tool call (paced upstream): the gateway sends a call only
  once it is whole, so it arrives when the upstream's last argument piece does.

`--busy` keeps one core spinning in another process for the whole run, as a device model generating on
the same machine would: it shows what the gateway pays for each wake-up of a peer process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.tools.bench.output import publish

# --- the fast deterministic upstream ------------------------------------------------------------

_CHUNK = 'data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":0,"model":"fast","choices":[{"index":0,"delta":{"content":"tok%d "},"logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501
_LAST = 'data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":0,"model":"fast","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"%s"}]}\n\n'  # noqa: E501
_TOOL = 'data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":0,"model":"fast","choices":[{"index":0,"delta":{"tool_calls":[%s]},"logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501
_USAGE = 'data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":0,"model":"fast","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n'  # noqa: E501


def make_upstream(gap: float):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"].endswith("/models"):
            body = b'{"object":"list","data":[{"id":"fast","object":"model","created":0,"owned_by":"bench"}]}'
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        req = json.loads(raw)
        n = int(req.get("max_tokens") or 16)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        pieces = [_CHUNK % i for i in range(n)]
        finish = "length"
        if req.get("tools"):  # one call, its arguments in n pieces: {"q": "tok0 tok1 ... "}
            head = {"index": 0, "id": "call_up", "type": "function", "function": {"name": "search", "arguments": ""}}
            args = ['{"q": "', *(f"tok{i} " for i in range(n - 2)), '"}']
            pieces = [_TOOL % json.dumps(head)]
            pieces += [_TOOL % json.dumps({"index": 0, "function": {"arguments": a}}) for a in args]
            finish = "tool_calls"
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece.encode(), "more_body": True})
            if gap:
                await asyncio.sleep(gap)
        tail = _LAST % finish
        if (req.get("stream_options") or {}).get("include_usage"):
            tail += _USAGE % (10, n, 10 + n)
        await send({"type": "http.response.body", "body": (tail + "data: [DONE]\n\n").encode()})

    return app


def _serve_upstream(port: int, gap: float) -> None:
    import uvicorn

    uvicorn.run(make_upstream(gap), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- load generation ---------------------------------------------------------------------------


def _request(model: str, n: int) -> dict:
    """The request both load generators send: an n-token streamed answer to a one-word prompt."""
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "stream": True}


async def _one(client: httpx.AsyncClient, url: str, model: str, n: int) -> tuple[float, int]:
    body = _request(model, n)
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    async with client.stream("POST", url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith('data: {"id"') and '"content":"tok' in line:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    if chunks != n:
        raise RuntimeError(f"{url}: expected {n} content chunks, got {chunks}")
    return ttft, chunks


_TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


async def _first_tool_delta(client: httpx.AsyncClient, url: str, n: int) -> float:
    """Seconds to the first tool-call delta of a streamed answer that is one call (n argument pieces)."""
    body = {**_request("paced", n), "tools": _TOOLS}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if first is None and '"tool_calls"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: no tool call in the answer")
    return first


class RawClient:
    """One kept-alive HTTP/1.1 connection written and read by hand: TTFT is the first content chunk's
    arrival, without an HTTP client library's own work (~1 ms of Python per request with httpx, which on
    two cores competes with the gateway for the CPU) in the measurement."""

    def __init__(self, url: str, n: int, key: str | None = None) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port
        body = json.dumps(_request("fast", n))
        auth = f"authorization: Bearer {key}\r\n" if key else ""
        self.request = (
            f"POST {parsed.path}/chat/completions HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"{auth}content-length: {len(body)}\r\n\r\n{body}"
        ).encode()

    async def __aenter__(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()

    async def ttft(self) -> float:
        t0 = time.perf_counter()
        self.writer.write(self.request)
        seen, ttft = b"", None
        while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's end
            data = await self.reader.read(65536)
            if not data:
                raise RuntimeError("connection closed mid-answer")
            seen = seen[-16:] + data if ttft is not None else seen + data
            if ttft is None and b'"content":"tok' in seen:
                ttft = time.perf_counter() - t0
        return ttft


async def _round(client, url: str, model: str, concurrency: int, n: int) -> tuple[list[float], int, float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(client, url, model, n) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return [r[0] for r in results], sum(r[1] for r in results), wall


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(direct: dict[str, str], gateway: str, gw_pid: int, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    out: dict = {}
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for url in (*direct.values(), gateway):  # warm-up: connections, code paths
            for model in ("fast", "paced"):
                await _round(client, url if url == gateway else direct[model], model, 4, 4)
        # TTFT at 1 and 32 concurrent streams (4-chunk answers, unpaced upstream).
        for conc in (1, 32):
            d_ttft, g_ttft = [], []
            reps = rounds * (100 if conc == 1 else 1)  # single requests are cheap: enough for a stable p99
            for _ in range(reps):
                d_ttft += (await _round(client, direct["fast"], "fast", conc, 4))[0]
                g_ttft += (await _round(client, gateway, "fast", conc, 4))[0]
            out[f"ttft_c{conc}"] = (d_ttft, g_ttft)
        # Throughput at 32 streams, paced like a fast LLM and unpaced.
        for model, n in (("paced", 200), ("fast", 400)):
            d_rates, g_rates, cpu_per_chunk = [], [], []
            for _ in range(rounds):
                _, chunks, wall = await _round(client, direct[model], model, 32, n)
                d_rates.append(chunks / wall)
                cpu0 = _cpu_seconds(gw_pid)
                _, chunks, wall = await _round(client, gateway, model, 32, n)
                cpu_per_chunk.append((_cpu_seconds(gw_pid) - cpu0) / chunks)
                g_rates.append(chunks / wall)
            out[f"tput_{model}"] = (d_rates, g_rates, cpu_per_chunk)
        # A streamed tool call of 16 pieces, 10 ms apart.
        d_tool, g_tool = [], []
        for _ in range(rounds * 4):
            d_tool.append(await _first_tool_delta(client, direct["paced"], 16))
            g_tool.append(await _first_tool_delta(client, gateway, 16))
        out["tool_call"] = (d_tool, g_tool)
    # Last, so that no kept-alive connection of the client above idles long enough for a server to close it.
    async with RawClient(direct["fast"], 4) as d_raw, RawClient(gateway, 4) as g_raw:
        d_ttft, g_ttft = [], []
        for _ in range(rounds * 100 + 20):
            d_ttft.append(await d_raw.ttft())
            g_ttft.append(await g_raw.ttft())
        out["ttft_raw"] = (d_ttft[20:], g_ttft[20:])  # after the connections' warm-up
    return out


def _report(results: dict, rounds: int) -> str:
    lines = [
        "| measurement | direct | via gateway | gateway − direct / ratio |",
        "|---|---|---|---|",
    ]
    for key, label in (("ttft_c1", "1 stream"), ("ttft_c32", "32 streams"), ("ttft_raw", "1 stream, raw client")):
        d, g = results[key]
        for q in (50, 99):
            dq, gq = pct(d, q) * 1e3, pct(g, q) * 1e3
            lines.append(f"| TTFT p{q}, {label} (n={len(d)}) | {dq:.2f} ms | {gq:.2f} ms | **{gq - dq:+.2f} ms** |")
    for model, label in (("paced", "paced 100 tok/s/stream"), ("fast", "unpaced")):
        d, g, cpu = results[f"tput_{model}"]
        dm, gm = statistics.median(d), statistics.median(g)
        lines.append(
            f"| chunks/s, 32 streams, {label} (median of {rounds}) | {dm:,.0f} | {gm:,.0f} | **{gm / dm:.1%}** |"
        )
        lines.append(f"| gateway CPU per relayed chunk, {label} | | {statistics.median(cpu) * 1e6:.0f} µs | |")
    d, g = results["tool_call"]
    dm, gm = statistics.median(d) * 1e3, statistics.median(g) * 1e3
    lines.append(
        f"| first tool-call delta, one 16-piece call at 10 ms/piece (median of {len(d)}) | {dm:.1f} ms | {gm:.1f} ms"
        f" | **{gm - dm:+.1f} ms** |"
    )
    return "\n".join(lines)


def start_upstreams() -> tuple[list[subprocess.Popen], dict[str, str]]:
    """The two upstreams, each in a process of its own, once they answer: "fast" (unpaced) and "paced" (10 ms per
    chunk). Their processes (the caller terminates them) and base URLs."""
    from app.launcher import free_port

    ports = {"fast": free_port(), "paced": free_port()}
    gaps = {"fast": 0.0, "paced": 0.01}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "app.tools.bench.gateway_bench", "--upstream", str(ports[m]), str(gaps[m])]
        )
        for m in ports
    ]
    direct = {m: f"http://127.0.0.1:{p}/v1" for m, p in ports.items()}
    for url in direct.values():
        for _ in range(100):
            try:
                httpx.get(url + "/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
    return children, direct


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per measurement")
    parser.add_argument("--out", default="var/bench/gateway.md")
    parser.add_argument("--busy", action="store_true", help="keep one core busy in another process meanwhile")
    parser.add_argument("--upstream", nargs=2, metavar=("PORT", "GAP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.upstream:
        _serve_upstream(int(args.upstream[0]), float(args.upstream[1]))
        return 0

    from app.launcher import start_gateway, stop_gateway  # the same launcher as the tests

    children, direct = start_upstreams()
    gw = None
    if args.busy:
        children.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    try:
        clouds = "".join(
            f'\n[clouds.{m}]\nbase_url = "{direct[m]}"\nmodel = "{m}"\nmax_connections = 256\n' for m in direct
        )
        gw = start_gateway(
            f'[gateway]\npolicy = "cloud"\ncloud = "fast"\nfallback = false\n'
            f'[device]\nmodel = "qwen2.5-coder-0.5b-instruct"\n{clouds}'
        )
        results = asyncio.run(_measure(direct, gw.v1, gw.process.pid, args.rounds))
    finally:
        if gw is not None:
            stop_gateway(gw)
        for p in children:
            p.terminate()
            p.wait()
    table = _report(results, args.rounds)
    header = (
        f"tandem bench gateway --rounds {args.rounds}{' --busy' if args.busy else ''}  "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, upstream, gateway and load generator on one machine"
        f"{'; one core kept busy' if args.busy else ''})\n\n"
    )
    publish(header + table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
