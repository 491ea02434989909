"""`tandem bench device`: decode speed and TTFT of the device path, against llama-cpp-python and llama-server alone.

One run, side by side on one machine, in alternating order (machine noise hits every subject alike):

- `in-process`: llama-cpp-python's `Llama.create_chat_completion(stream=True)` in a subprocess of its own (not
  this interpreter, which also runs the load generator);
- `llama_cpp.server`: llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`);
- `llama-server`: llama.cpp's own server (the set-up's build of the same llama.cpp: deploy/llama_server.py), the
  one most users would run instead;
- the gateway, three ways: `"model": "device"` (pinned: no race, no migration); `"model": "tandem"` with
  `"tandem": {"policy": "device"}`; and `"model": "tandem"` with DiSCo-S, which routes every prompt to the
  device (budget 0: the server side may take none) and runs the migration check after every token (the cloud
  is the dearer decoder, so the check says "stay").

Every subject loads the same GGUF with the same n_ctx and n_threads and answers the same greedy prompt, for a
short and a long answer. Each measurement gets a prompt of its own (a numbered task, same length), so no
subject finds the prompt in its KV cache while another did not. Decode speed is tokens/s from the first
content chunk to the last; TTFT is from sending the request to the first content chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.tools.bench.output import publish

DEVICE_MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPT = (
    "Task {nonce}: write a Python module that implements a small in-memory key-value store with "
    "expiring keys, with type hints, docstrings and a few unit tests. Explain each part."
)
PINNED, POLICY_DEVICE, DISCO = "gateway, pinned", "gateway, policy device", "gateway, DiSCo → device"
IN_PROCESS, PEER, LLAMA_SERVER = "in-process", "llama_cpp.server", "llama-server"
GATEWAY_SUBJECTS = {
    PINNED: {"model": "device"},
    POLICY_DEVICE: {"model": "tandem", "tandem": {"policy": "device"}},
    DISCO: {"model": "tandem", "tandem": {"policy": "disco-s"}},
}


def _messages(nonce: str) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(nonce=nonce)}]


def _rates(t0: float, stamps: list[float]) -> dict:
    """TTFT and decode tokens/s from the send time and each content chunk's arrival."""
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return {"ttft": stamps[0] - t0, "tok_s": decode, "tokens": len(stamps)}


# --- the in-process baseline: its own interpreter, driven over stdin/stdout -------------------------


def _serve_in_process(model: str, n_ctx: int, n_threads: int) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        stamps = []
        for chunk in llm.create_chat_completion(
            _messages(job["nonce"]), max_tokens=job["max_tokens"], temperature=0.0, stream=True
        ):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
        print(json.dumps(_rates(t0, stamps)), flush=True)


class _InProcess:
    def __init__(self, model: Path, n_ctx: int, n_threads: int) -> None:
        cmd = [sys.executable, "-m", "app.tools.bench.device_bench", "--in-process"]
        cmd += [str(model), str(n_ctx), str(n_threads)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the in-process baseline did not start")

    def measure(self, nonce: str, max_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"nonce": nonce, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        self.process.terminate()  # it may be mid-answer when the bench is interrupted
        self.process.wait()


# --- HTTP subjects ---------------------------------------------------------------------------------


def _measure_http(client: httpx.Client, url: str, body: dict, nonce: str, max_tokens: int) -> dict:
    request = {**body, "messages": _messages(nonce), "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    stamps = []
    t0 = time.perf_counter()
    with client.stream("POST", url + "/chat/completions", json=request) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} {body}: HTTP {r.status_code}: {r.read()[:300]!r}")
        backend = r.headers.get("x-tandem-backend")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    if backend not in (None, "device"):
        raise RuntimeError(f"{body}: answered by {backend}, not the device")
    return _rates(t0, stamps)


def _start_peer(model: Path, n_ctx: int, n_threads: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", "peer",
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(n_threads),
           "--n_threads_batch", str(n_threads), "--verbose", "False"]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError("llama_cpp.server exited during start-up")
        time.sleep(0.25)
    raise RuntimeError("llama_cpp.server not ready after 150 s")


def gateway_config(peer_url: str, n_ctx: int, n_threads: int, embedded: bool) -> str:
    """The device, plus the cloud DiSCo plays against: llama_cpp.server itself, priced far above the device, so
    DiSCo-S with budget 0 keeps every prompt on the device and every per-token migration check says "stay".
    `embedded` adds the rest of the embedded default (the cloud stand-in server, HAT's device half and worker)
    idling beside it, to show what they cost the device."""
    config = f"""
[gateway]
cloud = "peer"
fallback = false
[disco]
side = "server"
budget = 0.0
[device]
model = "{DEVICE_MODEL}"
n_ctx = {n_ctx}
n_threads = {n_threads}
[clouds.peer]
base_url = "{peer_url}"
model = "peer"
tokenizer = "device"
continuation = "completions"
price = {{ prefill_per_million = 100.0, decode_per_million = 400.0 }}
"""
    if embedded:
        config += """
[clouds.cloud]
model = "qwen2.5-coder-1.5b-instruct"
tokenizer = "device"
continuation = "completions"
[clouds.cloud.embedded]
model = "qwen2.5-coder-1.5b-instruct"
port = 0
n_ctx = 4096
n_threads = 2
[clouds.hat]
kind = "hat"
model = "qwen2.5-coder-0.5b-instruct"
m = 2
[clouds.hat.embedded]
port = 0
"""
    return config


# --- the run ---------------------------------------------------------------------------------------


class ForeignLoad:
    """CPU time other processes (not the bench's own process trees) used while a measurement ran. The machine
    may be shared; a measurement that a foreign burst ran into is repeated, not averaged in."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = set(roots)
        self._mark = self._foreign_jiffies()

    def _foreign_jiffies(self) -> int:
        busy = sum(
            int(v)
            for i, v in enumerate(Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:])
            if i not in (3, 4)
        )
        parents, used = {}, {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                parents[int(entry)], used[int(entry)] = int(fields[1]), int(fields[11]) + int(fields[12])
        ours = 0
        for pid, jiffies in used.items():
            p = pid
            while p > 1 and p not in self.roots:
                p = parents.get(p, 0)
            ours += jiffies if p in self.roots else 0
        return busy - ours

    def since_mark(self) -> float:
        """Cores' worth of seconds other processes used since the last call."""
        now = self._foreign_jiffies()
        used, self._mark = now - self._mark, now
        return used / os.sysconf("SC_CLK_TCK")


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(results: dict[tuple[str, int], list[dict]], lengths: list[int], subjects: list[str]) -> str:
    lines = [
        "| answer | subject | decode tok/s | TTFT ms | decode vs server | decode vs in-process "
        "| decode vs llama-server | TTFT − server |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        peer_rate, peer_ttft = _median(results[PEER, n], "tok_s"), _median(results[PEER, n], "ttft")
        local_rate = _median(results[IN_PROCESS, n], "tok_s")
        llama_rate = _median(results[LLAMA_SERVER, n], "tok_s")
        for subject in subjects:
            rows = results[subject, n]
            rate, ttft = _median(rows, "tok_s"), _median(rows, "ttft")
            lines.append(
                f"| {n} tokens | {subject} | {rate:.1f} | {ttft * 1e3:.1f} | **{rate / peer_rate:.3f}×** | "
                f"{rate / local_rate:.3f}× | {rate / llama_rate:.3f}× | {(ttft - peer_ttft) * 1e3:+.1f} ms |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench device", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (one answer per subject each)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 160], help="answer lengths in tokens")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--embedded", action="store_true", help="run the embedded default's other parts too")
    parser.add_argument(
        "--foreign-limit",
        type=float,
        default=0.1,
        help="repeat a round when other processes used more than this share of a core meanwhile",
    )
    parser.add_argument("--max-repeats", type=int, default=8, help="repeats of a disturbed round before keeping it")
    parser.add_argument("--out", default="var/bench/device.md")
    parser.add_argument("--in-process", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process:
        _serve_in_process(args.in_process[0], int(args.in_process[1]), int(args.in_process[2]))
        return 0

    from app.launcher import free_port, start_gateway, start_llama_server, stop_gateway, stop_server
    from deploy.models import model_path

    model = model_path(DEVICE_MODEL)
    peer_port = free_port()
    peer_url = f"http://127.0.0.1:{peer_port}/v1"
    peer = in_process = gw = llama = None
    try:
        peer = _start_peer(model, args.n_ctx, args.threads, peer_port)
        llama = start_llama_server(model, alias=LLAMA_SERVER, ctx_size=args.n_ctx, threads=args.threads)
        in_process = _InProcess(model, args.n_ctx, args.threads)
        gw = start_gateway(gateway_config(peer_url, args.n_ctx, args.threads, args.embedded))
        subjects = [IN_PROCESS, PEER, LLAMA_SERVER, *GATEWAY_SUBJECTS]

        def measure(subject: str, nonce: str, n: int) -> dict:
            if subject == IN_PROCESS:
                return in_process.measure(nonce, n)
            if subject == PEER:
                return _measure_http(client, peer_url, {"model": "peer"}, nonce, n)
            if subject == LLAMA_SERVER:
                return _measure_http(client, llama.v1, {"model": LLAMA_SERVER}, nonce, n)
            return _measure_http(client, gw.v1, GATEWAY_SUBJECTS[subject], nonce, n)

        results: dict[tuple[str, int], list[dict]] = {(s, n): [] for s in subjects for n in args.lengths}
        load = ForeignLoad([os.getpid(), peer.pid, llama.process.pid, in_process.process.pid, gw.process.pid])
        repeated = 0
        with httpx.Client(timeout=120) as client:
            for subject in subjects:  # warm-up: code paths, connections, the shared system prompt's KV
                measure(subject, "warm-up", 8)
            for r in range(args.rounds):
                for n in args.lengths:
                    order = subjects[r % len(subjects) :] + subjects[: r % len(subjects)]  # rotate who goes first
                    for attempt in range(args.max_repeats + 1):
                        rows, disturbed = {}, False
                        for i, subject in enumerate(order):
                            load.since_mark()
                            t0 = time.perf_counter()
                            rows[subject] = measure(subject, f"{r:03d}{n:03d}{attempt:02d}{i}", n)
                            foreign = load.since_mark() / (time.perf_counter() - t0)
                            disturbed |= foreign > args.foreign_limit
                            print(f"round {r} {n:3d} tokens {subject:28s} {rows[subject]['tok_s']:6.1f} tok/s "
                                  f"TTFT {rows[subject]['ttft'] * 1e3:7.1f} ms ({rows[subject]['tokens']} chunks) "
                                  f"other processes {foreign:.0%} of a core", file=sys.stderr)  # fmt: skip
                        if not disturbed or attempt == args.max_repeats:
                            break
                        repeated += 1
                        print("round disturbed by other processes: repeating it", file=sys.stderr)
                    for subject, row in rows.items():
                        results[subject, n].append(row)
    finally:
        if gw is not None:
            stop_gateway(gw)
        if in_process is not None:
            in_process.stop()
        if llama is not None:
            stop_server(llama)
        if peer is not None:
            peer.terminate()
            peer.wait()
    table = report(results, args.lengths, subjects)
    header = (
        f"tandem bench device --rounds {args.rounds}{' --embedded' if args.embedded else ''}  "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {DEVICE_MODEL}, n_ctx {args.n_ctx}, "
        f"{args.threads} threads, greedy; medians of {args.rounds}; {repeated} rounds repeated because other "
        f"processes used over {args.foreign_limit:.0%} of a core meanwhile)\n\n"
    )
    publish(header + table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
