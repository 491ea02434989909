"""`tandem bench reproducible`: what the device's reproducible path costs, against the fast path, side by side.

Two llama.cpp device backends on the same GGUF, one per path (`[device] reproducible = false | true`), answer the
same requests in alternating order, so machine noise hits both alike. Time to the first token (the backend's first
event, no HTTP) in four situations, for a few prompt lengths:

- `cold`: a prompt neither cache holds (a fresh nonce in its first words);
- `repeated`: the same prompt again (the fast path evaluates one token; the reproducible one the last chunk);
- `next turn`: the conversation sent back with the answer and a new question (the shared start is cached);
- `migration`: prompt + 16 delivered tokens continued on the device while its cache holds the prompt (a race lost,
  then a move onto the device).

Medians over the rounds, and the reproducible path's median over the fast path's, per cell.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from app.tools.bench.output import publish
from clients.base import GenerationRequest
from clients.llamacpp import CANONICAL_CHUNK, LlamaCppBackend
from deploy.models import model_path

FILLER = (
    "The service keeps its records in a table with an id, a name, an owner, a creation time and a status. "
    "Requests arrive from several clients at once and each must see a consistent view of the table. "
)
SITUATIONS = ("cold", "repeated", "next turn", "migration")


def _conversation(nonce: int, words: int) -> list[dict]:
    body = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    return [{"role": "user", "content": f"Case {nonce}. " + " ".join(body) + " Summarise the design in a sentence."}]


async def _ttft(backend: LlamaCppBackend, prompt: list[int], prefix: list[int] | None = None) -> tuple[float, list]:
    request = GenerationRequest(
        "", prompt_ids=tuple(prompt), prefix_ids=tuple(prefix) if prefix else None, max_tokens=16, temperature=0.0
    )
    t0 = time.perf_counter()
    events, first = [], None
    async for event in backend.stream(request):
        first = first if first is not None else time.perf_counter() - t0
        events.append(event)
    return first, events


async def _round(backend: LlamaCppBackend, nonce: int, words: int) -> dict[str, float]:
    messages = _conversation(nonce, words)
    prompt = backend.tokenize_prompt(backend.render_chat(messages))
    times = {}
    times["cold"], answer = await _ttft(backend, prompt)
    times["repeated"], _ = await _ttft(backend, prompt)
    delivered = [e.token_id for e in answer if e.token_id is not None]
    times["migration"], _ = await _ttft(backend, prompt, delivered)
    reply = "".join(e.text for e in answer)
    turn = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And its weak points?"}]
    await _ttft(backend, prompt)  # the cache holds the first turn again, as it would after the answer
    times["next turn"], _ = await _ttft(backend, backend.tokenize_prompt(backend.render_chat(turn)))
    return times


async def _run(args: argparse.Namespace) -> str:
    path = model_path(args.model)
    backends = {
        mode: LlamaCppBackend(
            mode, path, args.model, n_ctx=args.n_ctx, n_threads=args.threads, reproducible=on, chunk=args.chunk
        )
        for mode, on in (("fast", False), ("reproducible", True))
    }
    for backend in backends.values():
        await backend.start()
    samples = {(mode, words, s): [] for mode in backends for words in args.words for s in SITUATIONS}
    try:
        nonce = 0
        for r in range(args.rounds):
            for words in args.words:
                order = list(backends) if r % 2 == 0 else list(reversed(backends))
                for mode in order:
                    nonce += 1
                    for situation, seconds in (await _round(backends[mode], nonce, words)).items():
                        samples[(mode, words, situation)].append(seconds)
    finally:
        for backend in backends.values():
            await backend.close()

    lines = [
        f"# Reproducible device path: time to first token against the fast path ({args.model}, "
        f"{args.threads} threads, chunk {args.chunk}, {args.rounds} rounds, medians in ms)",
        "",
        "| prompt (words) | situation | fast | reproducible | reproducible / fast |",
        "|---:|---|---:|---:|---:|",
    ]
    for words in args.words:
        for situation in SITUATIONS:
            fast = statistics.median(samples[("fast", words, situation)]) * 1000
            slow = statistics.median(samples[("reproducible", words, situation)]) * 1000
            lines.append(f"| {words} | {situation} | {fast:.0f} | {slow:.0f} | {slow / fast:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench reproducible", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--words", type=int, nargs="+", default=[40, 200, 700], help="prompt lengths in words")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=CANONICAL_CHUNK, help="the reproducible path's batch")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--out", default="var/bench/reproducible.md")
    args = parser.parse_args(argv)
    publish(asyncio.run(_run(args)), args.out)
    return 0
