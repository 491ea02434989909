"""A generation's picked tokens → its TokenEvents: how a device answer ends, decided in one place.

The backends that pick tokens themselves (clients/torch_local.py, clients/llamacpp.py, clients/hat/device.py) hand
every picked token to a TokenEmitter and send on the event it returns. The answer ends at the first of:

- end of sequence: the model picked one of its end tokens. That token is not emitted: a last event without a token
  id carries the text still held back, finish_reason "stop".
- grammar complete: the request's grammar (clients/grammar.py) allows nothing after this token: "stop" on its event.
- length: the token budget (max_tokens, within the context) is spent: "length" on the last token's event.

Text goes out through the backend's incremental detokenizer (clients/hf_model.py, clients/llamacpp.py), so a
multi-byte character split over tokens goes out whole with the token that completes it, and what is still held at
the end goes out with the last event.

Stop sequences are matched neither here nor in any backend: the relay (app/serving/relay.py) enforces them, once, for
every endpoint, because only the relay sees the answer as the client gets it. A stop sequence can begin in one
endpoint's text and end in the text of the endpoint the answer migrated to; an upstream's own matching (it is sent
`stop` too, to end early) never sees what an earlier endpoint delivered; and the relay matches after tool calls are
split out, so a stop string inside a call's arguments does not cut the call. The cost: a backend streams on past a
stop sequence until the relay ends the answer and the orchestrator closes its stream, a token or so later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from clients.base import TokenEvent, TokenLogprob
from clients.grammar import TokenMask
from policies.quality import TokenConfidence


class Detokenizer(Protocol):
    """Token ids in, text out, never splitting a character: `push` may return "" while a character is incomplete."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TokenEmitter:
    """One generation's events. `is_end`: whether a token ends the sequence; `max_tokens`: the tokens it may emit
    (the caller has already bounded it by the context); `mask`: the request's grammar, which the emitter advances
    over every emitted token."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        is_end: Callable[[int], bool],
        max_tokens: int,
        mask: TokenMask | None = None,
    ) -> None:
        self._detokenizer = detokenizer
        self._is_end = is_end
        self._max_tokens = max_tokens
        self._mask = mask
        self.taken = 0  # tokens handed in, an end token included

    @property
    def remaining(self) -> int:
        """How many more tokens the answer may have."""
        return self._max_tokens - self.taken

    def emit(
        self,
        token: int,
        logprobs: tuple[TokenLogprob, ...] | None = None,
        cached_tokens: int | None = None,
        confidence: TokenConfidence | None = None,
    ) -> TokenEvent:
        """The event for the next picked token. One with a finish reason is the answer's last: hand in nothing
        after it. `logprobs` are the token's (dropped for an end token, which is not emitted)."""
        self.taken += 1
        if self._is_end(token):
            return TokenEvent(text=self._detokenizer.flush(), finish_reason="stop", cached_tokens=cached_tokens)
        complete = False
        if self._mask is not None:
            self._mask.accept(token)
            complete = self._mask.finished
        text = self._detokenizer.push(token)
        finish = "stop" if complete else "length" if self.taken >= self._max_tokens else None
        if finish is not None:
            text += self._detokenizer.flush()
        return TokenEvent(
            text, token, finish_reason=finish, cached_tokens=cached_tokens, logprobs=logprobs, confidence=confidence
        )
