"""One answer's delivered state, token by token, whichever endpoints produce it.

The relay turns the serving endpoint's `TokenEvent`s into the deltas the client gets: stop sequences and the token
limit enforced here, so every endpoint, and an answer that moves between endpoints, ends the same way (stop sequences
here only, no backend matches them: clients/token_emitter.py says why); tool calls
held until whole (app/serving/tool_calls.py); text released on token boundaries with its tokens' logprobs when they
were asked (clients/logprobs.py). It keeps what a migration target continues from (the answer's token ids while
every token came with one, its text, its token count) and the consumption clock t_first + i/r_c: how many tokens
reached the client after the reader wanted them, and how far the client is ahead of its reader.

Synchronous and pure: no I/O, no clock reads (the time is an argument). Which endpoint serves, migrations and
recovery are the orchestrator's (app/serving/orchestrator.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.serving.tool_calls import ToolCall, ToolCallSplitter
from clients.base import GenerationRequest, TokenEvent, TokenLogprob
from clients.logprobs import LogprobAligner
from clients.stops import StopMatcher
from policies.migration import lead


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None
    # Only when the request asked for logprobs: one entry per token of `text` (their texts join to it).
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""  # a reasoning model's thinking, as the endpoint sent it (clients/base.py: TokenEvent)


@dataclass(frozen=True)
class Prefix:
    """The answer so far, as a continuing endpoint gets it."""

    ids: tuple[int, ...] | None  # None once a token came without an id (text pieces: it continues from the text)
    text: str
    tokens: int


class Relay:
    def __init__(self, gen: GenerationRequest, t_first: float, consumption_rate: float) -> None:
        self._limit = gen.max_tokens
        self._stops = StopMatcher(gen.stop)
        self._calls = ToolCallSplitter(frozenset(t["function"]["name"] for t in gen.tools)) if gen.tools else None
        # Only when logprobs are asked (never with tools): text then goes out on token boundaries, with its tokens'
        # logprobs.
        self._aligner = LogprobAligner() if gen.logprobs is not None else None
        self.t_first = t_first  # when the first token was here
        self._rate = consumption_rate
        self._ids: list[int] | None = []
        self._texts: list[str] = []
        self.produced = 0  # the answer's tokens so far (delivered, or held back here)
        self.delayed = 0  # tokens that came after the consumption clock's deadline
        self.stopped = False  # a stop sequence ended the answer (the endpoint did not: its stream goes on)
        self.reasoning_tokens = 0  # reasoning pieces passed on (one token each, as an upstream streams them)

    @property
    def holding_call(self) -> bool:
        """Whether part of a tool call is held back (the client has not seen it)."""
        return self._calls is not None and self._calls.holding

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the answer, if one did."""
        return self._stops.matched

    @property
    def ids(self) -> list[int] | None:
        """The answer's token ids so far (None once a token came without one). Read-only."""
        return self._ids

    def lead(self, now: float) -> float:
        """How many delivered tokens the client's reader has not read yet at `now` (policies/migration.py)."""
        return lead(self.produced, now, self.t_first, self._rate)

    def prefix(self) -> Prefix:
        return Prefix(tuple(self._ids) if self._ids is not None else None, "".join(self._texts), self.produced)

    def feed(self, event: TokenEvent, now: float) -> Delta:
        """One event of the serving endpoint → what the client gets now. A delta with a finish reason is the
        answer's last; nothing may be fed after it."""
        if event.reasoning:
            # Thinking is not the answer: it goes out as it came, before this event's text, and nothing that
            # shapes the answer (stops, the limit, tool calls, the continuation's prefix) reads it.
            self.reasoning_tokens += 1
            if not event.text and event.token_id is None and event.finish_reason is None:
                return Delta("", reasoning=event.reasoning)
        token = bool(event.text) or event.token_id is not None
        content = event.text
        calls: list[ToolCall] = []
        if token:
            self.produced += 1
            if self._ids is not None:
                if event.token_id is None:
                    self._ids = None
                else:
                    self._ids.append(event.token_id)
            self._texts.append(event.text)
            if now > self.t_first + (self.produced - 1) / self._rate + 1e-3:
                self.delayed += 1
            if self._calls is not None:
                content, calls = self._calls.feed(event.text)
        text, stopped = self._stops.feed(content)
        finish = "stop" if stopped else event.finish_reason
        if finish is None and self.produced >= self._limit:
            finish = "length"
        if self._aligner is not None:
            self._aligner.add(event)
        if finish is not None:
            delta = self._finish(text, calls, finish, stopped)
        else:
            logprobs = None
            if self._aligner is not None:
                text, logprobs = self._aligner.release(text)
            delta = Delta(text, None, logprobs, tuple(calls))
        return replace(delta, reasoning=event.reasoning) if event.reasoning else delta

    def _finish(self, text: str, calls: list[ToolCall], finish: str, stopped: bool) -> Delta:
        self.stopped = stopped
        if not stopped:  # what was held back goes out
            if self._calls is not None:
                content, more = self._calls.finish()
                text += self._stops.feed(content)[0]
                calls += more
            text += self._stops.flush()
        if self._calls is not None and self._calls.calls and finish == "stop":
            finish = "tool_calls"
        logprobs = None
        if self._aligner is not None:
            text, logprobs = self._aligner.release(text, final=True)
        return Delta(text, finish, logprobs, tuple(calls))

    def limit_to(self, tokens: int) -> None:
        """The answer may have at most `tokens` tokens from now on (it moved onto an endpoint with a smaller window)."""
        self._limit = min(self._limit, tokens)

    def call_completed_by(self, event: TokenEvent) -> ToolCall | None:
        """The tool call `event` would complete, fed next (nothing changes here): the orchestrator's look at a call
        before the client gets it."""
        if not self.holding_call:
            return None
        final = event.finish_reason is not None or self.produced + 1 >= self._limit
        calls = self._calls.peek(event.text, final)
        return calls[0] if calls else None

    def rewind_uncommitted_call(self) -> bool:
        """Forget the tool call being held (the client has not seen any of it), back to the last delivered token:
        the next endpoint writes the call again, whole, so nothing goes out half or twice. Whether there was one."""
        if not self.holding_call:
            return False
        self.produced = self._calls.committed
        del self._texts[self.produced :]
        if self._ids is not None:
            del self._ids[self.produced :]
        self._calls.discard()
        return True
