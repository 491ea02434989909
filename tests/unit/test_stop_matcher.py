"""Stop sequences are found across token boundaries and never shown, even partly."""

from __future__ import annotations

from clients.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_no_stops_passes_through():
    assert run([], ["a", "b"]) == ("ab", False)


def test_stop_split_over_tokens():
    assert run(["END"], ["hello E", "N", "D more"]) == ("hello ", True)


def test_partial_match_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(("END",))
    assert m.feed("x EN") == ("x ", False)  # "EN" could start "END": held back
    assert m.feed("gine") == ("ENgine", False)


def test_earliest_of_several_stops_wins():
    assert run(["bb", "a"], ["xxbba"]) == ("xx", True)


def test_the_stop_that_ended_the_text_is_named():
    m = StopMatcher(("a", "bb"))
    assert m.matched is None
    assert m.feed("xb") == ("x", False) and m.matched is None
    assert m.feed("ba") == ("", True) and m.matched == "bb"  # the earliest, not the first listed


def test_held_text_flushed_at_end():
    assert run(["END"], ["the E"]) == ("the E", False)


def test_stop_inside_one_token():
    assert run(["\n\n"], ["line\n\nnext"]) == ("line", True)


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)
    assert m.feed("y\n") == ("y", False)
    assert m.feed("\nmore") == ("", True)
    assert StopMatcher([]).feed("END") == ("END", False)
    m2 = StopMatcher(["stop"])
    assert m2.feed("go st") == ("go ", False) and m2.flush() == "st"
