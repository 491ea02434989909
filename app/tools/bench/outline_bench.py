"""`tandem bench outline`: outline-based parallel decoding against the cloud's sequential answer.

The embedded default (device Qwen2.5-Coder-0.5B, loopback cloud Qwen2.5-Coder-1.5B) answers list-style questions
(deploy/outline_questions.txt) twice each, alternating: sequentially on the cloud (`model = "cloud"`), and with
`tandem.decoding = "outline"` (the outline on the endpoint DiSCo picks, the points spread over device and cloud).
Reports per mode the median end-to-end time, TTFT and tokens, the ratio, the fallbacks, and one sample pair.
By default the device (in the gateway) and the cloud server are pinned to separate cores, one thread each, as a real
device and a remote cloud never share a CPU; `--no-pin` runs them as the embedded default does (two threads each on
whatever cores the OS picks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx

from app.tools import REPO_ROOT
from app.tools.bench.output import publish

QUESTIONS = REPO_ROOT / "deploy" / "outline_questions.txt"


def _ask(url: str, question: str, max_tokens: int, outline: bool) -> dict:
    body = {
        "model": "tandem" if outline else "cloud",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tandem": {"decoding": "outline" if outline else "sequential"},
    }
    t0 = time.perf_counter()
    ttft, parts, usage, rid = None, [], None, None
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
    total = time.perf_counter() - t0
    trace = httpx.get(f"{url}/requests/{rid}", timeout=10).json()
    decoding = trace.get("decoding") or {}
    return {
        "total": total,
        "ttft": ttft or total,
        "tokens": usage["completion_tokens"] if usage else 0,
        "text": "".join(parts),
        "outline": bool(decoding.get("outline")),
        "points": len(decoding.get("points", [])),
        "endpoints": decoding.get("endpoints", []),
    }


def pinned(config: str, device_core: int, cloud_core: int) -> str:
    """The config with the device on one thread and the embedded cloud server on one thread pinned to `cloud_core`
    (the gateway process itself is pinned to `device_core` by the caller)."""
    out, section, done = [], "", set()
    for line in config.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.split("]")[0].strip("[")
            out.append(line)
            if section == "clouds.cloud.embedded":
                out.append(f"cpus = [{cloud_core}]")
                done.add("cpus")
            continue
        if section in ("device", "clouds.cloud.embedded") and stripped.startswith("n_threads"):
            line = "n_threads = 1"
            done.add(section)
        out.append(line)
    if done != {"device", "clouds.cloud.embedded", "cpus"}:
        raise ValueError(f"cannot pin this config: it lacks {sorted({'device', 'clouds.cloud.embedded'} - done)}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench outline", description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=10, help="how many of the questions (in order)")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--out", default="var/bench/outline.md")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave device and cloud unpinned, two threads each (the embedded default)"
    )
    args = parser.parse_args(argv)
    from app.config import embedded_default
    from app.launcher import start_gateway, stop_gateway

    questions = [q for q in QUESTIONS.read_text().splitlines() if q.strip()][: args.questions]
    config = embedded_default().read_text()
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    if pin:
        device_core, cloud_core = sorted(os.sched_getaffinity(0))[:2]
        gw = start_gateway(pinned(config, device_core, cloud_core), cpus=[device_core])
        placement = f"device pinned to core {device_core} and cloud to core {cloud_core}, one thread each"
    else:
        gw = start_gateway(config)
        placement = "device and cloud unpinned, two threads each, sharing the machine's cores"
    rows = []
    try:
        _ask(gw.v1, "Say hi.", 4, outline=False)  # warm-up: both models' first calls
        for q in questions:
            rows.append((q, _ask(gw.v1, q, args.max_tokens, outline=False), _ask(gw.v1, q, args.max_tokens, True)))
    finally:
        stop_gateway(gw)
    used = [(q, s, o) for q, s, o in rows if o["outline"]]
    lines = [
        f"tandem bench outline --questions {len(questions)} --max-tokens {args.max_tokens}  "
        f"({time.strftime('%Y-%m-%d %H:%M')}, embedded default, {placement})",
        "",
        "| mode | end-to-end (median) | TTFT (median) | completion tokens (median) |",
        "|---|---|---|---|",
    ]
    for label, idx in (("cloud, sequential", 1), ("outline decoding", 2)):
        col = [r[idx] for r in rows]
        lines.append(
            f"| {label} | {statistics.median(c['total'] for c in col):.1f} s | "
            f"{statistics.median(c['ttft'] for c in col):.2f} s | {statistics.median(c['tokens'] for c in col):.0f} |"
        )
    ratios = [o["total"] / s["total"] for _, s, o in used if o["points"] >= 4]
    lines += [
        "",
        f"Outline used for {len(used)} of {len(rows)} questions (the rest fell back: unparseable outline); "
        f"points per outline: {[o['points'] for _, _, o in used]}; endpoints used: "
        f"{sorted({e for _, _, o in used for e in o['endpoints']})}.",
        f"End-to-end time, outline / cloud sequential, answers of 4 or more points: median "
        f"{statistics.median(ratios):.2f}× over {len(ratios)} questions (target ≤ 0.8×)."
        if ratios
        else "No answer had 4 or more points.",
    ]
    if used:
        q, s, o = used[0]
        lines += [
            "",
            f"Sample — {q}",
            "",
            "Sequential (cloud):",
            "",
            s["text"][:900],
            "",
            "Outline:",
            "",
            o["text"][:900],
        ]
    publish("\n".join(lines), args.out)
    return 0
