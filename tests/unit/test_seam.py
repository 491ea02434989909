"""The text seam (app/serving/seam.py): trailing whitespace moved out of a prefix, dropped where the continuation
writes it again, and the continuation's ids dropped where its text went its own way (pure logic)."""

from __future__ import annotations

from app.serving.seam import Seam, split_trailing_whitespace
from clients.base import TokenEvent, TokenLogprob


def fed(seam: Seam, *events: TokenEvent) -> list[TokenEvent]:
    return [out for e in events if (out := seam.feed(e)) is not None]


def test_trailing_whitespace_is_split_off():
    assert split_trailing_whitespace("def f():\n    ") == ("def f():", "\n    ")
    assert split_trailing_whitespace("word") == ("word", "")
    assert split_trailing_whitespace(" \n") == ("", " \n")


def test_the_held_whitespace_is_dropped_where_it_is_written_again():
    seam = Seam(" ", 10, "prefill")
    out = fed(seam, TokenEvent(" world", token_id=7), TokenEvent(" again", token_id=8))
    assert [e.text for e in out] == ["world", " again"]
    assert out[0].token_id == 7  # the token spells " world": the answer's ids still match its text
    assert seam.describe() == {"dialect": "prefill", "prefix_chars": 10, "held": " ", "dropped": " "}


def test_held_whitespace_written_over_several_pieces_and_then_more():
    seam = Seam("\n    ", 3, "tokens")
    out = fed(seam, TokenEvent("\n"), TokenEvent("        return"))
    assert "".join(e.text for e in out) == "    return"  # deeper indentation survives: only the held part goes
    assert seam.dropped == "\n    "


def test_a_piece_of_nothing_but_held_whitespace_disappears_unless_it_is_a_token():
    out = fed(Seam(" ", 1, "prefill"), TokenEvent(" "), TokenEvent("x"))
    assert [e.text for e in out] == ["x"]
    kept = fed(Seam(" ", 1, "tokens"), TokenEvent(" ", token_id=3))
    assert [(e.text, e.token_id) for e in kept] == [("", 3)]  # still a token the device produced


def test_a_continuation_that_goes_its_own_way_keeps_its_text_and_loses_its_ids():
    seam = Seam("\n\n", 1, "tokens")
    (out,) = fed(seam, TokenEvent("\nNext", token_id=5))
    assert out.text == "Next" and out.token_id is None  # "\n" + "\nNext" is not what the ids spell
    assert fed(seam, TokenEvent(" more", token_id=6))[0].token_id == 6  # the seam is closed


def test_no_held_whitespace_changes_nothing():
    event = TokenEvent(" word", token_id=1)
    assert Seam("", 0, "prefill").feed(event) is event


def test_logprob_token_texts_lose_the_dropped_characters():
    lp = (TokenLogprob(-0.1, b" hi", (), " hi"),)
    (out,) = fed(Seam(" ", 1, "prefill"), TokenEvent(" hi", logprobs=lp))
    assert out.logprobs[0].token == "hi" and out.logprobs[0].bytes == b"hi"


def test_a_prefill_sent_back_first_is_dropped():
    seam = Seam(" ", 9, "prefill", echo="The cat")
    out = fed(seam, TokenEvent("The"), TokenEvent(" cat"), TokenEvent(" sat"), TokenEvent(" down"))
    assert [e.text for e in out] == ["sat", " down"]  # the echo, then the held space it wrote again
    assert seam.describe()["echo_dropped"] is True


def test_text_that_only_begins_like_the_prefix_goes_out_whole():
    seam = Seam("", 7, "prefill", echo="The cat")
    out = fed(seam, TokenEvent("The"), TokenEvent(" dog"))
    assert [e.text for e in out] == ["The dog"]
    assert "echo_dropped" not in seam.describe()
