"""`tandem bench events`: does a crowd of slow viewers of GET /v1/events cost the gateway's requests anything?

One gateway in front of `tandem bench gateway`'s fast deterministic upstream (no model on the answer's path, so
the gateway's own work is all there is to see). Rounds alternate: requests with no viewer, then the same requests
with `--viewers` viewers connected that never read a byte (the worst kind of slow: their sockets fill, then the
bus drops their events). TTFT is measured with the raw one-connection client of `bench gateway` (no HTTP library's
work in the number), sequentially; every request publishes its plan, the endpoint's start, win and finish and the
request's end with its trace to every viewer. Reports TTFT p50/p90/p99 of both and the events the bus dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx

from app.tools.bench.gateway_bench import RawClient, pct
from app.tools.bench.output import publish

KEY = "bench-events"


def _slow_viewer(url: str) -> socket.socket:
    """A viewer that connects, sends its request and never reads (a tiny receive buffer: it fills at once)."""
    parsed = httpx.URL(url)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((parsed.host, parsed.port))
    s.sendall(f"GET {parsed.path}/events HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\r\n".encode())
    return s


async def _ttfts(client: RawClient, n: int) -> list[float]:
    return [await client.ttft() for _ in range(n)]


async def _measure(gateway: str, rounds: int, per_round: int, viewers: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"none": [], "viewers": []}
    async with RawClient(gateway, 4, KEY) as raw:
        await _ttfts(raw, 20)  # warm-up
        for _ in range(rounds):
            out["none"] += await _ttfts(raw, per_round)
            crowd = [_slow_viewer(gateway) for _ in range(viewers)]
            await asyncio.sleep(0.2)  # connected and subscribed
            out["viewers"] += await _ttfts(raw, per_round)
            for s in crowd:
                s.close()
            await asyncio.sleep(0.2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench events", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds")
    parser.add_argument("--requests", type=int, default=50, help="requests per round and side")
    parser.add_argument("--viewers", type=int, default=20)
    parser.add_argument("--out", default="var/bench/events.md")
    args = parser.parse_args(argv)

    from app.launcher import free_port, start_gateway, stop_gateway

    port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "app.tools.bench.gateway_bench", "--upstream", str(port), "0"])
    gw = None
    try:
        gw = start_gateway(
            f'[gateway]\npolicy = "cloud"\ncloud = "fast"\nfallback = false\napi_keys = ["{KEY}"]\n'
            '[device]\nmodel = "qwen2.5-coder-0.5b-instruct"\n[disco]\nprofile_device = false\n'
            f'[clouds.fast]\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "fast"\n'
        )
        results = asyncio.run(_measure(gw.v1, args.rounds, args.requests, args.viewers))
        dropped = gw.metric("tandem_events_dropped_total")
    finally:
        if gw is not None:
            stop_gateway(gw)
        upstream.terminate()
        upstream.wait()
    lines = [
        f"tandem bench events --rounds {args.rounds} --requests {args.requests} --viewers {args.viewers}  "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, upstream, gateway, viewers and client on one machine)",
        "",
        "| TTFT through the gateway | no viewer | " + f"{args.viewers} viewers that never read | difference |",
        "|---|---|---|---|",
    ]
    none, crowd = results["none"], results["viewers"]
    for q in (50, 90, 99):
        a, b = pct(none, q) * 1e3, pct(crowd, q) * 1e3
        lines.append(f"| p{q} (n={len(none)} each) | {a:.2f} ms | {b:.2f} ms | **{b - a:+.2f} ms** |")
    lines.append(f"\nEvents the bus dropped for the slow viewers (never for serving): {dropped:.0f}.")
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
