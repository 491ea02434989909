"""`tandem bench quality --half tune --tune-thresholds ...`: the quality policy's threshold τ, tuned where it may be —
on the tune half only (humaneval.TUNE_HALF), never on the half a frontier is reported on.

For each of the device's own answers (the `device` row), the device's top-token probability at every answer token,
teacher-forced through the device model (llama.cpp, every position's logits in one pass), read by the policy's own
rule (policies.quality.ConfidenceMonitor): at each τ, whether and after which token that answer would escalate.
Greedy decoding with the same weights wrote these very tokens, so the escalation points are the live policy's up to
a one-pass prefill's rounding against token-by-token decoding and the answer's text tokenized again (a near-tie may
fall the other way). What an escalated answer scores is estimated by the cloud's own answer to the problem; the
live run on the report half measures it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from app.tools.bench import humaneval
from app.tools.bench.humaneval import Problem
from policies.quality import ConfidenceMonitor, TokenConfidence


def top_probabilities(model_path: Path, problems: Sequence[Problem], answers: Sequence[str]) -> list[list[float]]:
    """The device model's top-token probability before each token of each answer, the chat rendered as the gateway
    renders it (the model's own template; the response prefix continued)."""
    import llama_cpp

    from clients.chat_template import render_chat
    from clients.logprobs import confidence_of, log_softmax

    llm = llama_cpp.Llama(str(model_path), n_ctx=4096, n_threads=2, logits_all=True, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    tops = []
    for problem, answer in zip(problems, answers, strict=True):
        *chat, opened = humaneval.messages(problem)
        prompt = llm.tokenize(render_chat(template, chat).encode(), add_bos=False, special=True)
        prefix = llm.tokenize(opened["content"].encode(), add_bos=False, special=False)
        tokens = llm.tokenize(answer.encode(), add_bos=False, special=False)
        ids = (prompt + prefix + tokens)[: llm.n_ctx()]
        llm.reset()
        llm.eval(ids)
        start = len(prompt) + len(prefix)
        # the live device's own reading of a row of logits (clients/llamacpp.py captures them the same way)
        tops.append([confidence_of(log_softmax(row)).top for row in llm.scores[start - 1 : len(ids) - 1]])
    return tops


def escalation_point(tops: Sequence[float], threshold: float) -> int | None:
    """After how many answer tokens the policy's rule escalates at τ = threshold (None: never)."""
    monitor = ConfidenceMonitor(threshold)
    for top in tops:
        if monitor.add(TokenConfidence(top, 0.0, 0.0)):
            return monitor.tokens
    return None


def lowest_window_mean(tops: Sequence[float]) -> float:
    """The lowest value the rule's windowed mean takes over the answer: the τ above which it escalates."""
    monitor, lowest = ConfidenceMonitor(0.0), 1.0
    for top in tops:
        monitor.add(TokenConfidence(top, 0.0, 0.0))
        if monitor.checking:
            lowest = min(lowest, monitor.mean)
    return lowest


def auroc(scores_failed: Sequence[float], scores_passed: Sequence[float]) -> float:
    """How well a low score picks a device failure: P(a failed answer's score < a passed one's), ties half."""
    pairs = [(f < p) + 0.5 * (f == p) for f in scores_failed for p in scores_passed]
    return sum(pairs) / len(pairs) if pairs else float("nan")


def tune(
    task_ids: Sequence[str],
    device_passed: Sequence[bool],
    cloud_passed: Sequence[bool],
    tops: Sequence[Sequence[float]],
    thresholds: Sequence[float],
) -> tuple[list[str], dict]:
    """The table: at each τ, the answers that would escalate, the device failures among them, the median token at
    which they would, and pass@1 estimated with each escalated answer scored as the cloud's own."""
    n = len(task_ids)
    lowest = [lowest_window_mean(t) for t in tops]
    failed = [s for s, ok in zip(lowest, device_passed, strict=True) if not ok]
    passed = [s for s, ok in zip(lowest, device_passed, strict=True) if ok]
    separation = auroc(failed, passed)
    lines = [
        f"{n} problems of the tune half: device {sum(device_passed)}/{n}, cloud {sum(cloud_passed)}/{n}; the rule's "
        f"lowest windowed confidence tells a device failure from a pass with AUROC {separation:.3f}.",
        "",
        "| τ | answers escalated | device failures among them | median escalation token | pass@1 estimated "
        "(escalated = the cloud's answer) |",
        "|---|---|---|---|---|",
    ]
    data = {"problems": list(task_ids), "auroc": separation, "lowest_window_mean": lowest, "rows": []}
    for tau in thresholds:
        points = [escalation_point(t, tau) for t in tops]
        moved = [i for i, p in enumerate(points) if p is not None]
        estimate = sum(cloud_passed[i] if points[i] is not None else device_passed[i] for i in range(n))
        median = statistics.median(points[i] for i in moved) if moved else None
        caught = sum(not device_passed[i] for i in moved)
        lines.append(
            f"| {tau:g} | {len(moved)}/{n} | {caught}/{len(failed)} | {'—' if median is None else f'{median:g}'} | "
            f"{estimate}/{n} ({100 * estimate / n:.1f} %) |"
        )
        row = {"threshold": tau, "escalated": len(moved), "failures_escalated": caught, "median_token": median}
        data["rows"].append({**row, "estimated_passed": estimate})
    return lines, data
