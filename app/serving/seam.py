"""Where a text continuation joins the answer: the seam.

An endpoint continuing an answer from its text (another vocabulary than the text's, or a chat upstream's dialect,
clients/continuation.py) is given the answer so far as its prefix. Trailing whitespace in that prefix is trouble:
transformers' `continue_final_message` cuts it off, Anthropic refuses a final assistant turn that ends in it, and a
tokenizer that did not write the text reads a lone trailing space as a token its model rarely saw before a word, so
the continuation tends to write the space again (a doubled space). So the whitespace is moved out of the prefix and
held here; where the continuation starts by writing it again, that much is dropped, since the client has it already.
The same holds for the client's own prefill (a final assistant message it asked to have continued).

Some servers send the prefilled text back before the continuation (llama.cpp's llama-server answers a prefill with
the whole assistant message). In the prefill dialect the seam holds the continuation's first text while it spells
the prefix sent (`echo`), and drops it once it has spelt all of it; text that leaves it earlier goes out whole.

The prefix is always text the relay has taken in (app/serving/relay.py): a character whose first bytes came as a
token without text (split over tokens) is not in it, and the continuation writes it whole. A stop sequence that
begins in the delivered text and ends in the continuation still stops: the relay's stop matcher runs across both.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from clients.base import TokenEvent


def split_trailing_whitespace(text: str) -> tuple[str, str]:
    """(text without its trailing whitespace, that whitespace)."""
    body = text.rstrip()
    return body, text[len(body) :]


class Seam:
    """One continuation's seam: the whitespace `held` out of its prefix, dropped from the start of the
    continuation as far as the continuation repeats it."""

    def __init__(self, held: str, prefix_chars: int, dialect: str, echo: str = "") -> None:
        self.held = held
        self.prefix_chars = prefix_chars  # the text the continuation was given after the prompt
        self.dialect = dialect
        self.echo = echo  # the prefix as sent, which the server may send back first
        self.echoed = False
        self.dropped = ""
        self._open = bool(held)
        self._spelt = ""  # the continuation's first text while it spells `echo`

    @property
    def active(self) -> bool:
        """Whether it may change any of the continuation's text."""
        return self._open or bool(self.echo)

    def feed(self, event: TokenEvent) -> TokenEvent | None:
        """The event as the answer takes it; None when all it carried was whitespace the client has already (or
        the prefix the server sent back)."""
        if self.echo and event.text:
            spelt = self._spelt + event.text
            if self.echo.startswith(spelt) and len(spelt) < len(self.echo) and event.finish_reason is None:
                self._spelt = spelt  # held until it is the whole echo or not one
                return None
            held_back, echo = self._spelt, self.echo
            self._spelt = self.echo = ""
            if spelt.startswith(echo):
                self.echoed = True
                event = replace(event, text=spelt[len(echo) :], token_id=None, logprobs=None)
            elif held_back:  # it only began like the echo: what was held goes out with this piece
                event = replace(event, text=spelt, token_id=None, logprobs=None)
            if not event.text:
                return event if event.finish_reason is not None or event.usage is not None else None
        if not self._open or not event.text:
            return event
        rest = self.held[len(self.dropped) :]
        n = 0
        while n < min(len(rest), len(event.text)) and event.text[n] == rest[n]:
            n += 1
        self.dropped += event.text[:n]
        text = event.text[n:]
        if text or self.dropped == self.held:
            self._open = False
        if n == 0:
            return event
        token_id = event.token_id
        if text and self.dropped != self.held:
            # The continuation went its own way inside the held whitespace: its tokens no longer spell the answer's
            # text, so the answer goes on from text, not ids.
            token_id = None
        if not text and token_id is None and event.finish_reason is None and event.usage is None:
            return None
        return replace(event, text=text, token_id=token_id, logprobs=_trim(event.logprobs, n))

    def describe(self) -> dict:
        return {
            "dialect": self.dialect,
            "prefix_chars": self.prefix_chars,
            "held": self.held,
            "dropped": self.dropped,
            **({"echo_dropped": True} if self.echoed else {}),
        }


def _trim(logprobs, n: int):
    """An event's logprobs with their first `n` characters of token text dropped (those the seam dropped)."""
    if not logprobs or logprobs[0].token is None:
        return logprobs  # the relay names each token by the event's text
    out = []
    for entry in logprobs:
        cut = min(n, len(entry.token))
        n -= cut
        out.append(replace(entry, token=entry.token[cut:], bytes=entry.token[cut:].encode("utf-8")))
    return tuple(out)


async def through_seam(stream: AsyncIterator[TokenEvent], seam: Seam) -> AsyncIterator[TokenEvent]:
    """A text continuation's events as the answer takes them (the Seam above); closing it closes `stream`."""
    try:
        async for event in stream:
            kept = seam.feed(event)
            if kept is not None:
                yield kept
    finally:
        await stream.aclose()
