"""`tandem bench prompt-cache`: the device's prompt cache on agent-shaped conversations, against llama-server.

An agent's turn re-sends a long system prompt (tool schemas) and the whole conversation, adding a few hundred tokens
a turn. One run, on one machine, the same sequence of requests to each subject:

- `tandem`: a device-only gateway (`policy = "device"`, the fast path) with the prompt cache on, its disk folder a
  fresh one of this run;
- `llama-server`: llama.cpp's own server (the set-up's build), one slot holding the whole context, with its
  host-memory cache of prompt states (`--cache-ram`), `--cache-reuse` and a `--slot-save-path` (which it fills only
  when a client asks: an agent does not).

The sequence: one session's turns 1..n (turn 1 cold); both subjects restarted, then that session's next turn; then
three sessions with distinct system prompts (two new ones: cold), interleaved turn by turn. Each request streams a
short answer; TTFT is from sending it to its first content chunk. Cached tokens: the gateway's trace (its device
attempt's `cached_tokens`), llama-server's `timings.cache_n`. The cold prefill a warm turn is set against is the
subject's own turn 1 scaled by prompt length (linear: prefill grows faster than that, so the ratio is an upper
bound).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from app.launcher import ServerProcess, start_gateway, start_llama_server, stop_gateway, stop_server
from app.tools.bench.output import cpu_name, publish, write_json
from deploy.models import model_path

MODEL = "qwen2.5-coder-0.5b-instruct"
ANSWER = "I will look at that next and report what I find."  # every turn's assistant message, alike for both


def _tools_prompt(seed: int, tokens: int, count) -> str:
    """A coding agent's system prompt: instructions and tool schemas (JSON), about `tokens` long."""
    lines = [f"You are coding agent #{seed}. Use the tools below; answer briefly. Tools:"]
    i = 0
    while count("\n".join(lines)) < tokens:
        schema = {
            "name": f"tool_{seed}_{i}",
            "description": f"Operation {i} of agent {seed}: reads, edits or searches files in the workspace ({i * 7}).",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": f"the file to act on, relative to root {i}"},
                    "pattern": {"type": "string", "description": f"a regular expression ({seed}.{i})"},
                    "limit": {"type": "integer", "description": f"at most this many results, default {i % 50}"},
                },
                "required": ["path"],
            },
        }
        lines.append(json.dumps(schema))
        i += 1
    return "\n".join(lines)


def _tool_result(session: int, turn: int, tokens: int) -> str:
    """A turn's new user content: a tool's output of roughly `tokens` tokens (100-400 a turn)."""
    rows = [f"Tool output {session}.{turn}:"]
    rows += [
        f"  line {j}: value_{session}_{turn}_{j} = compute({j}, {turn * j % 97})" for j in range(max(tokens // 24, 1))
    ]
    return "\n".join(rows)


class Subject:
    """One server under test: its start, a streamed request's TTFT and cached tokens, a restart."""

    def __init__(self, name: str, start, stop, cached) -> None:
        self.name, self._start, self._stop, self._cached = name, start, stop, cached
        self.server: ServerProcess | None = None

    def start(self) -> None:
        self.server = self._start()

    def stop(self) -> None:
        if self.server is not None:
            self._stop(self.server)
            self.server = None

    def ask(self, messages: list[dict]) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        ttft, last, request_id = None, None, None
        with httpx.stream("POST", self.server.v1 + "/chat/completions", json=body, timeout=900) as r:
            r.raise_for_status()
            request_id = r.headers.get("x-request-id")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
                if ttft is None and delta.get("content"):
                    ttft = time.perf_counter() - t0
                last = chunk
        prompt, cached = self._cached(self.server, request_id, last)
        return {"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached}

    model = "tandem"


def _tandem(folder: Path, n_ctx: int, threads: int) -> Subject:
    config = f"""
[gateway]
policy = "device"
[device]
model = "{MODEL}"
n_ctx = {n_ctx}
n_threads = {threads}
prompt_cache_dir = "{folder}"
[disco]
profile_device = false
"""

    def cached(server, request_id, _last):
        trace = httpx.get(f"{server.v1}/requests/{request_id}", timeout=10).json()
        (device,) = trace["endpoints"]
        return trace["prompt_tokens"], device["cached_tokens"]

    return Subject("tandem", lambda: start_gateway(config, ready_timeout=600), stop_gateway, cached)


def _llama_server(folder: Path, n_ctx: int, threads: int) -> Subject:
    extra = ("--parallel", "1", "--cache-ram", "8192", "--cache-reuse", "256", "--slot-save-path", str(folder))

    def cached(_server, _request_id, last):
        timings = (last or {}).get("timings", {})
        cache_n = int(timings.get("cache_n", 0))
        return cache_n + int(timings.get("prompt_n", 0)), cache_n

    subject = Subject(
        "llama-server",
        lambda: start_llama_server(
            model_path(MODEL), alias="tandem", ctx_size=n_ctx, threads=threads, extra_args=extra, ready_timeout=600
        ),
        stop_server,
        cached,
    )
    return subject


def _run(subject: Subject, systems: list[str], turns: int, rounds: int, words: list[int]) -> list[dict]:
    """The sequence, on one subject: rows of (scenario, session, turn, prompt, cached, TTFT)."""
    rows: list[dict] = []
    histories = {s: [{"role": "system", "content": systems[s]}] for s in range(len(systems))}
    sent = {s: 0 for s in histories}

    def turn(session: int, scenario: str) -> None:
        k = sent[session]
        histories[session].append({"role": "user", "content": _tool_result(session, k, words[k % len(words)])})
        result = subject.ask(histories[session])
        histories[session].append({"role": "assistant", "content": ANSWER})
        sent[session] += 1
        rows.append({"scenario": scenario, "session": session, "turn": k + 1, **result})
        print(f"  {subject.name:12s} {scenario:12s} session {session} turn {k + 1}: {result}", flush=True)

    subject.start()
    for _ in range(turns):
        turn(0, "one session")
    subject.stop()
    subject.start()
    turn(0, "restart")
    for r in range(rounds):
        for s in range(len(systems)):
            turn(s, "interleaved" if r else "interleaved (first)")
    subject.stop()
    return rows


def _report(results: dict, args) -> str:
    lines = [
        "# Device prompt cache: agent-shaped turns, tandem against llama-server",
        "",
        f"`tandem bench prompt-cache --system-tokens {args.system_tokens} --turns {args.turns} --rounds {args.rounds}`"
        f" on {cpu_name()}, {args.threads} threads, n_ctx {args.n_ctx}, {MODEL} (Q4_K_M), "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "| subject | scenario | session | turn | prompt tokens | cached | TTFT (s) | × cold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        cold = next(r for r in rows if r["turn"] == 1 and r["session"] == 0)
        per_token = cold["ttft_s"] / cold["prompt_tokens"]
        for r in rows:
            ratio = r["ttft_s"] / (per_token * r["prompt_tokens"])
            lines.append(
                f"| {name} | {r['scenario']} | {r['session']} | {r['turn']} | {r['prompt_tokens']} | "
                f"{r['cached_tokens']} | {r['ttft_s']:.2f} | {ratio:.3f} |"
            )
    lines += ["", "× cold: TTFT over the subject's own turn-1 TTFT scaled by prompt length (an upper bound)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench prompt-cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--system-tokens", type=int, default=12000, help="each agent's system prompt, in tokens")
    parser.add_argument("--turns", type=int, default=4, help="one session's turns before the restart")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the three sessions")
    parser.add_argument("--words", type=int, nargs="+", default=[320, 120, 400, 200], help="each turn's new tokens")
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--subjects", nargs="+", default=["tandem", "llama-server"])
    parser.add_argument("--out", default="var/bench/prompt-cache.md")
    parser.add_argument("--json", default=None, help="the raw rows as JSON here")
    args = parser.parse_args(argv)

    from llama_cpp import Llama

    vocab = Llama(model_path=str(model_path(MODEL)), vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(vocab.tokenize(text.encode(), add_bos=False, special=False))

    systems = [_tools_prompt(seed, args.system_tokens, count) for seed in range(3)]
    results = {}
    for name in args.subjects:
        folder = Path(tempfile.mkdtemp(prefix=f"tandem-bench-kv-{name}-"))
        make = _tandem if name == "tandem" else _llama_server
        print(f"{name}: {folder}", flush=True)
        results[name] = _run(make(folder, args.n_ctx, args.threads), systems, args.turns, args.rounds, args.words)
    publish(_report(results, args), args.out)
    write_json(results, args.json)
    return 0
