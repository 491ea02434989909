"""Stop sequences, matched across token boundaries: the gateway's relay (app/serving/relay.py) enforces them for every
endpoint, also across a migration, and is the only place that does (why: clients/token_emitter.py)."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds stop sequences across token boundaries. Text that might be the start of a stop
    sequence is held back until the next token decides it, so a stop sequence is never
    shown to the client, not even partly."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched: str | None = None  # the stop sequence that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at], True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
