"""`tandem bench fleet`: what the shared store costs a request, and what a second replica buys.

One run on loopback, against gateway_bench's fast deterministic upstream (pre-rendered chunks, no model), with a
real Redis-protocol server (`--store URL`, else a `valkey-server` / `redis-server` started for the run with
persistence off):

- TTFT p50/p99 at 1 and 32 concurrent streams through a gateway on the in-process ledger (`[state] backend =
  "memory"`) and through one on the store (`"valkey"`), alternating rounds, both admitting every request under an
  API key with a dollar cap and an RPM limit (so the store's admission and settlement are on the path);
- relayed chunks/s at 32 streams (an upstream paced at 10 ms per chunk) through one store-backed replica, then
  through two replicas on the same store, the streams split between them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import redis

from app.tools.bench.gateway_bench import _round, pct, start_upstreams
from app.tools.bench.output import publish

KEY = "bench-key"


def _gateway_config(upstreams: dict[str, str], state: str) -> str:
    clouds = "".join(
        f'\n[clouds.{m}]\nbase_url = "{url}"\nmodel = "{m}"\nmax_connections = 256\n' for m, url in upstreams.items()
    )
    return (
        f'[gateway]\npolicy = "cloud"\ncloud = "fast"\nfallback = false\nstate_file = ""\n'
        f'api_keys = [{{ key = "{KEY}", name = "bench", cap_usd = 1000000, rpm = 1000000 }}]\n'
        f'[device]\nmodel = "qwen2.5-coder-0.5b-instruct"\n[disco]\nprofile_device = false\n{clouds}\n{state}'
    )


def _start_store() -> tuple[subprocess.Popen, str, str]:
    from app.launcher import free_port

    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no valkey-server or redis-server on PATH: give --store URL (README, 'Several gateways')")
    port, tmp = free_port(), tempfile.mkdtemp(prefix="tandem-bench-store-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.RedisError:
            time.sleep(0.1)
    client.close()
    return process, url, tmp


async def _measure(gateways: dict[str, str], rounds: int) -> dict:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    headers = {"Authorization": f"Bearer {KEY}"}
    out: dict = {}
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as client:
        for url in gateways.values():  # warm-up: connections, code paths
            await _round(client, url, "fast", 4, 4)
        for conc in (1, 32):
            samples: dict[str, list[float]] = {name: [] for name in gateways}
            for _ in range(rounds * (50 if conc == 1 else 1)):
                for name, url in gateways.items():
                    samples[name] += (await _round(client, url, "fast", conc, 4))[0]
            out[f"ttft_c{conc}"] = samples
        one, two = [], []
        store = gateways["store"]
        both = [store, gateways["replica"]]
        for _ in range(rounds):
            _, chunks, wall = await _round(client, store, "paced", 32, 100)
            one.append(chunks / wall)
            t0 = time.perf_counter()
            halves = await asyncio.gather(*(_round(client, url, "paced", 16, 100) for url in both))
            two.append(sum(h[1] for h in halves) / (time.perf_counter() - t0))
        out["tput"] = (one, two)
    return out


def _report(results: dict, rounds: int) -> str:
    lines = ["| measurement | in-process ledger | shared store | store − memory / ratio |", "|---|---|---|---|"]
    for conc in (1, 32):
        samples = results[f"ttft_c{conc}"]
        memory, store = samples["memory"], samples["store"]
        for q in (50, 99):
            m, s = pct(memory, q) * 1e3, pct(store, q) * 1e3
            lines.append(
                f"| TTFT p{q}, {conc} stream{'s' if conc > 1 else ''} (n={len(memory)}) | {m:.2f} ms | {s:.2f} ms"
                f" | **{s - m:+.2f} ms** |"
            )
    one, two = results["tput"]
    o, t = statistics.median(one), statistics.median(two)
    lines += [
        "",
        f"| 32 streams, paced 100 tok/s/stream (median of {rounds}) | one replica | two replicas, one store | ratio |",
        "|---|---|---|---|",
        f"| relayed chunks/s | {o:,.0f} | {t:,.0f} | **{t / o:.2f}×** |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per measurement")
    parser.add_argument("--store", default="", help="a Redis-protocol URL (default: a server started for the run)")
    parser.add_argument("--out", default="var/bench/fleet.md")
    args = parser.parse_args(argv)

    from app.launcher import start_gateway, stop_gateway  # the same launcher as the tests

    load = os.getloadavg()

    children, upstreams = start_upstreams()
    store_process, url, tmp = (None, args.store, None) if args.store else _start_store()
    started = []
    try:
        prefix = f"bench{os.getpid()}:"
        shared = f'[state]\nbackend = "valkey"\nurl = "{url}"\nkey_prefix = "{prefix}"\n'
        for state in ("", shared, shared):
            started.append(start_gateway(_gateway_config(upstreams, state), wait_for=("fast", "paced")))
        gateways = {"memory": started[0].v1, "store": started[1].v1, "replica": started[2].v1}
        results = asyncio.run(_measure(gateways, args.rounds))
    finally:
        for gw in started:
            stop_gateway(gw)
        for p in [*children, *([store_process] if store_process else [])]:
            p.terminate()
            p.wait()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    header = (
        f"tandem bench fleet --rounds {args.rounds}  ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load "
        f"average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the start; upstream, store, gateways and load "
        "generator on one machine)\n\n"
    )
    publish(header + _report(results, args.rounds), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
