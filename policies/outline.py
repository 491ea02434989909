"""Outline-based parallel decoding (Jupiter §V-B): when to use it, reading an outline, placing its points.

A list-style answer's points are independent: write a short outline, expand the points concurrently on the
endpoints that can run at the same time, and join them in order. Pure decisions: the gateway
(app/serving/outline.py) runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_POINTS, MAX_POINTS = 2, 10
MIN_TOKENS = 160  # below this an answer is too short to gain from splitting

_CODE = re.compile(
    r"```|\b(def|class|function|return|import|code|python|javascript|java|rust|sql|regex|script|program|compile|"
    r"debug|bug|implement|refactor|snippet)\b|[{};]\s*$|\w+\(\)",
    re.IGNORECASE | re.MULTILINE,
)
_MATH = re.compile(
    r"\d\s*[-+*/^=]\s*\d|\b(solve|calculate|compute|equation|integral|derivative|prove|proof|sum of|how many|"
    r"probability)\b",
    re.IGNORECASE,
)
_LIST = re.compile(
    r"\b(list|ways|tips|steps|reasons|ideas|examples|benefits|advantages|disadvantages|pros|cons|factors|"
    r"things|points|aspects|kinds|types|suggestions|strategies|habits|causes|features|what are|how (can|do|to))\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Gate:
    use: bool
    reason: str


def gate(mode: str, user_turns: int, question: str, max_tokens: int, plain: bool) -> Gate:
    """Whether a request is answered by outline decoding. `mode`: "outline" (unless it cannot suit), "auto" (when it
    looks like a list-style question), "sequential" (never). `plain`: no tools, structured output, logprobs, n > 1."""
    if mode == "sequential":
        return Gate(False, "sequential decoding asked")
    if not plain:
        return Gate(False, "tools, structured output, logprobs or n > 1 need one sequential answer")
    if user_turns > 1:
        return Gate(False, "a follow-up turn (its points depend on the conversation)")
    if max_tokens < MIN_TOKENS:
        return Gate(False, f"a short answer (max_tokens {max_tokens} < {MIN_TOKENS})")
    if _CODE.search(question):
        return Gate(False, "a code question (its parts depend on each other)")
    if _MATH.search(question):
        return Gate(False, "a math question (its steps depend on each other)")
    if mode == "auto" and not _LIST.search(question):
        return Gate(False, "not a list-style question")
    return Gate(True, "outline asked" if mode == "outline" else "a list-style question")


_ITEM = re.compile(r"^\s*(?:\(?\d{1,2}[.):]|[-*•+]|\(?[a-jA-J][.)])\s+(.*\S)\s*$")


def parse_outline(text: str) -> list[str] | None:
    """The points of an outline (numbered, lettered or bulleted lines; other lines ignored), or None when it is not
    one: fewer than MIN_POINTS (the answer is then written normally). At most MAX_POINTS are kept."""
    points = []
    for line in text.splitlines():
        match = _ITEM.match(line)
        if match is None:
            continue
        point = re.sub(r"[*_`#]+", "", match.group(1)).strip().rstrip(":").strip()
        if point:
            points.append(point)
    if len(points) < MIN_POINTS:
        return None
    return points[:MAX_POINTS]


def assign(
    points: int,
    tokens_per_point: float,
    rates: dict[str, float],
    busy: dict[str, float],
    lanes: dict[str, int] | None = None,
) -> list[str]:
    """Each point's endpoint, by earliest predicted finish. Endpoint e runs `lanes[e]` points side by side (default 1:
    one after another), each at `rates[e]` tokens/s — a staged worker's P stages keep P points in flight, as Jupiter
    injects its points into the pipeline — so a lane finishes a point `tokens_per_point / rate[e]` seconds after its
    last one, starting when e is free (`busy[e]` seconds from now). Points go in order, each to the endpoint whose
    earliest-free lane would finish it first (ties to the first listed)."""
    lanes = lanes or {}
    free = {e: [busy.get(e, 0.0)] * max(1, lanes.get(e, 1)) for e in rates}
    out = []
    for _ in range(points):
        best = min(rates, key=lambda e: min(free[e]) + tokens_per_point / rates[e])
        lane = free[best].index(min(free[best]))
        free[best][lane] += tokens_per_point / rates[best]
        out.append(best)
    return out
