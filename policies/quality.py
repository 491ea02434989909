"""Quality-aware routing (the `quality` policy): when a device answer should go on on the cloud because the device is
likely to get it wrong, and when a request should start there.

Why these signals: they are the device's own and cost nothing extra. A small model about to go wrong is unsure of
its tokens — U-HLM (arXiv 2412.12687) skips the large model exactly while the small one is confident; Co-LLM
(2403.03870) and CITER (2502.01976) learn the same deferral from the hidden state. Here:

* the device's per-token confidence: the top token's probability under the raw logits it computes anyway (with its
  top-1/top-2 margin and entropy beside it, `TokenConfidence`); the rule reads the top probability;
* the prompt's difficulty as the device sees it: its confidence over its first tokens — the first one comes from its
  prefill of the prompt — so a prompt it finds hard escalates after `warmup` tokens, before much is written;
* an agent loop: the device writing again a tool call whose result the conversation already holds (a 0.5B model in
  the OpenAI Agents SDK's loop calls the same tool until the turn limit). Such a call is never delivered: the answer
  goes to the cloud from where it stood, and a conversation that already holds the same call answered twice starts
  there (`loops`).

One knob: `threshold` τ ∈ [0, 1], the confidence below which the device's answer goes to the cloud — the mean top-token
probability over its last `window` tokens (over those so far while fewer, once `warmup` are in). τ = 0 never
escalates on confidence; τ = 1 escalates at the first check. An escalation is a migration like any other (the same
seam, booked and priced the same), at most one per answer, and never where the request may not use the cloud; an
answer the client gets whole (not streamed) starts over on the cloud instead of continuing the device's (the
orchestrator holds its text until then).

Pure: numbers in, decisions out; the orchestrator (app/serving/orchestrator.py) feeds it.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_THRESHOLD = 0.85  # tuned on HumanEval's tune half (BENCHMARKS.md, "Answer quality"): 0.6 never escalated there
DEFAULT_WINDOW = 16  # tokens: a code line or two; one unsure identifier alone does not move the answer
DEFAULT_WARMUP = 4  # tokens before the first check: the prompt's difficulty as the first tokens show it


@dataclass(frozen=True)
class TokenConfidence:
    """How sure the device was of one token, from its raw logits: the top token's probability, the margin between
    the top two, and the distribution's entropy (nats)."""

    top: float
    margin: float
    entropy: float


def check_threshold(value: object) -> float:
    """τ as a float in [0, 1]; ValueError saying what it must be otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(
            f"must be a number in [0, 1] (the device's confidence below which it escalates), got {value!r}"
        )
    return float(value)


class ConfidenceMonitor:
    """One answer's device confidence, token by token: `add` says when it has fallen below τ."""

    def __init__(self, threshold: float, window: int = DEFAULT_WINDOW, warmup: int = DEFAULT_WARMUP) -> None:
        self.threshold = check_threshold(threshold)
        if window < 1 or not 1 <= warmup <= window:
            raise ValueError(f"need window ≥ 1 and 1 ≤ warmup ≤ window, got window={window} warmup={warmup}")
        self._tops: deque[float] = deque(maxlen=window)
        self._warmup = warmup
        self.tokens = 0

    @property
    def mean(self) -> float | None:
        """The mean top-token probability over the window (None before any token)."""
        return sum(self._tops) / len(self._tops) if self._tops else None

    @property
    def checking(self) -> bool:
        """Whether the rule reads the mean yet (once `warmup` tokens are in)."""
        return self.tokens >= self._warmup

    def add(self, confidence: TokenConfidence) -> bool:
        """One more device token; whether the answer should escalate now."""
        self._tops.append(confidence.top)
        self.tokens += 1
        return self.threshold > 0.0 and self.checking and self.mean < self.threshold


def call_key(name: str, arguments: str | dict) -> tuple[str, str]:
    """A tool call as compared here: its name and its arguments as canonical JSON (key order and spacing ignored;
    arguments that are not JSON compare as written)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return name, arguments
    return name, json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def repeats(call: tuple[str, str], answered: Iterable[tuple[str, str]]) -> bool:
    """Whether `call` (a `call_key`) was already made and answered in this conversation."""
    return call in set(answered)


def loops(answered: Iterable[tuple[str, str]]) -> bool:
    """Whether the conversation already holds one call answered twice: an agent loop that the endpoint which wrote it
    has not left, so a `quality` request starts on the cloud."""
    seen: set[tuple[str, str]] = set()
    for call in answered:
        if call in seen:
            return True
        seen.add(call)
    return False
