"""OpenAI's logprobs objects, rendered from the relay's per-token entries (clients.base.TokenLogprob).

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}`.
Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, text offsets counted in
characters from the start of the completion (this choice's text, not the prompt: Tandem does not echo).
A streamed chunk carries the entries of its own text; `CompletionLogprobs` keeps the offset across chunks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from clients.base import TokenLogprob


def _num(x: float | None) -> float | None:
    # JSON has no -Infinity: a token the model rules out entirely gets OpenAI's floor instead.
    return None if x is None else (x if math.isfinite(x) else -9999.0)


def _bytes(raw: bytes | None) -> list[int] | None:
    return None if raw is None else list(raw)


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _num(e.logprob),
                "bytes": _bytes(e.bytes),
                "top_logprobs": [{"token": t, "logprob": _num(lp), "bytes": list(b)} for t, lp, b in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


class CompletionLogprobs:
    """One choice's completions logprobs; `offset` advances with every rendered token."""

    def __init__(self) -> None:
        self.offset = 0

    def render(self, entries: Sequence[TokenLogprob]) -> dict:
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token or "")
        tops = []
        for e in entries:
            top: dict[str, float | None] = {}
            for t, lp, _ in e.top:
                top.setdefault(t, _num(lp))  # two alternatives with the same text: the likelier one stays
            tops.append(top)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_num(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class LogprobsRenderer:
    """One choice's logprobs as JSON text for streamed chunks, or as an object for a whole answer."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._completion = None if chat else CompletionLogprobs()

    def obj(self, entries: Sequence[TokenLogprob]) -> dict:
        return chat_logprobs(entries) if self._completion is None else self._completion.render(entries)

    def json(self, entries: Sequence[TokenLogprob]) -> str:
        return json.dumps(self.obj(entries), separators=(",", ":"))
