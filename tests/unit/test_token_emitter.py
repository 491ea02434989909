"""The device backends' one token emitter (clients/token_emitter.py) on scripted token sequences: end of sequence,
a grammar that completes, the token budget, characters split over tokens (both detokenizers), and a stop sequence
across tokens, which the emitter leaves to the relay."""

from __future__ import annotations

import threading

import pytest

from app.serving.relay import Relay
from clients.base import GenerationRequest, TokenEvent, TokenLogprob
from clients.grammar import HFTokenizerGrammars
from clients.hf_model import IncrementalDetokenizer
from clients.llamacpp import PieceDetokenizer
from clients.token_emitter import TokenEmitter

EOS = 257  # the byte tokenizer's end token (conftest.py)


@pytest.fixture(scope="module")
def tok(byte_tokenizer):
    return byte_tokenizer


def emitter(tok, max_tokens: int = 100, mask=None, context=()) -> TokenEmitter:
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True), context)
    return TokenEmitter(detok, {EOS}.__contains__, max_tokens, mask)


def run(em: TokenEmitter, tokens: list[int]) -> list[TokenEvent]:
    """The events of `tokens`, checking that only the last one ends the answer and that it uses them all."""
    events = [em.emit(t) for t in tokens]
    assert [e.finish_reason is not None for e in events] == [False] * (len(tokens) - 1) + [True]
    return events


def lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, -0.5, token.encode(), ())


def test_an_end_token_is_not_emitted_and_ends_the_answer_with_stop(tok) -> None:
    em = emitter(tok)
    h, i = tok.encode("hi")
    events = [em.emit(h, (lp("h"),)), em.emit(i, (lp("i"),)), em.emit(EOS, (lp("<eos>"),), cached_tokens=4)]
    assert [(e.text, e.token_id, e.finish_reason) for e in events] == [
        ("h", h, None),
        ("i", i, None),
        ("", None, "stop"),
    ]
    assert [e.logprobs for e in events] == [(lp("h"),), (lp("i"),), None]  # the end token's are dropped with it
    assert events[-1].cached_tokens == 4
    assert em.taken == 3


def test_the_token_that_completes_the_grammar_ends_the_answer_with_stop(tok) -> None:
    grammars = HFTokenizerGrammars(tok, [EOS], threading.Lock())
    (c,) = tok.encode("c")
    mask = grammars.mask('start: "ab" "c"')
    events = run(emitter(tok, mask=mask), [256, c])
    assert [(e.text, e.token_id, e.finish_reason) for e in events] == [("ab", 256, None), ("c", c, "stop")]
    assert mask.finished  # the emitter advanced the grammar over what it emitted
    # Complete on the budget's last token: the grammar's end wins.
    events = run(emitter(tok, max_tokens=2, mask=grammars.mask('start: "ab" "c"')), [256, c])
    assert events[-1].finish_reason == "stop"
    # Not complete yet on the budget's last token: "length".
    events = run(emitter(tok, max_tokens=1, mask=grammars.mask('start: "ab" "c"')), [256])
    assert events[-1].finish_reason == "length"


def test_the_budgets_last_token_ends_the_answer_with_length(tok) -> None:
    em = emitter(tok, max_tokens=3)
    ids = tok.encode("hello")
    assert em.remaining == 3
    events = run(em, ids[:3])
    assert [e.text for e in events] == ["h", "e", "l"] and events[-1].finish_reason == "length"
    assert [e.token_id for e in events] == ids[:3] and em.remaining == 0


def test_a_character_split_over_tokens_goes_out_whole_with_its_last_token(tok) -> None:
    text = "caf\u00e9 \U0001f389!"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token a byte: é spans 2, 🎉 spans 4
    events = run(emitter(tok, max_tokens=len(ids)), ids)
    assert [e.text for e in events] == ["c", "a", "f", "", "\u00e9", " ", "", "", "", "\U0001f389", "!"]
    assert all(e.token_id == t for e, t in zip(events, ids, strict=True))  # every token has its event
    # The prompt's last tokens decode with the answer's first (a leading space stays).
    events = run(emitter(tok, max_tokens=1, context=tok.encode("x")), tok.encode(" "))
    assert events[0].text == " "


def test_llama_cpps_byte_pieces_hold_a_split_character_too() -> None:
    pieces = [b"caf", b"\xc3", b"\xa9 \xf0\x9f", b"\x8e", b"\x89!", b"\xe2\x82"]
    end = len(pieces)
    em = TokenEmitter(PieceDetokenizer(pieces.__getitem__), lambda t: t == end, max_tokens=10)
    events = [em.emit(t) for t in range(len(pieces))]
    assert [e.text for e in events] == ["caf", "", "\u00e9 ", "", "\U0001f389!", ""]
    assert all(e.finish_reason is None for e in events)
    last = em.emit(end)  # the end token: what was held goes out with the last event (here half a character)
    assert (last.text, last.token_id, last.finish_reason) == ("\ufffd", None, "stop")


def test_a_stop_sequence_across_tokens_is_left_to_the_relay(tok) -> None:
    """The emitter never matches stops (GenerationRequest.stop is the relay's): it streams "END" through, and the
    relay fed its events ends the answer on the token that completes "END", its text cut before it."""
    text = "one END two"
    ids = tok.encode(text)
    events = run(emitter(tok, max_tokens=len(ids)), ids)
    assert "".join(e.text for e in events) == text and events[-1].finish_reason == "length"
    relay = Relay(GenerationRequest(prompt_text="p", max_tokens=100, stop=("END",)), 0.0, 10.0)
    deltas = []
    for event in events:
        deltas.append(relay.feed(event, 0.0))
        if deltas[-1].finish_reason is not None:
            break
    assert "".join(d.text for d in deltas) == "one " and deltas[-1].finish_reason == "stop"
    assert len(deltas) == text.index("END") + len("END")  # ended on the token that completes it
    assert relay.stopped
