"""One answer's relay (app/serving/relay.py) on scripted event sequences: what the client gets, when the answer
ends, what a migration target continues from, the consumption clock, and a rewind inside a held tool call."""

from __future__ import annotations

import json

import pytest

from app.serving.relay import Delta, Prefix, Relay
from clients.base import GenerationRequest, TokenEvent, TokenLogprob

WEATHER = ({"type": "function", "function": {"name": "get_weather", "parameters": {}}},)
CALL = ["<tool_call>", "\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n", "</tool_call>"]


def relay(max_tokens: int = 100, rate: float = 10.0, **fields) -> Relay:
    return Relay(
        GenerationRequest(prompt_text="hi", max_tokens=max_tokens, **fields), t_first=100.0, consumption_rate=rate
    )


def feed(r: Relay, pieces: list[str], first_id: int = 0, now: float = 100.0) -> list[Delta]:
    return [r.feed(TokenEvent(p, first_id + i), now) for i, p in enumerate(pieces)]


def test_text_goes_out_token_by_token_and_the_limit_ends_it():
    r = relay(max_tokens=3)
    deltas = feed(r, ["Hello", " world", "!"])
    assert deltas == [Delta("Hello"), Delta(" world"), Delta("!", "length")]
    assert r.prefix() == Prefix((0, 1, 2), "Hello world!", 3) and not r.stopped


def test_the_endpoints_finish_is_the_answers_and_an_empty_last_event_is_no_token():
    r = relay()
    assert feed(r, ["a", "b"]) == [Delta("a"), Delta("b")]
    assert r.feed(TokenEvent("", finish_reason="stop"), 100.0) == Delta("", "stop")
    assert r.produced == 2 and not r.stopped


def test_a_stop_sequence_across_tokens_is_never_shown_and_ends_the_answer():
    r = relay(stop=("END",))
    deltas = feed(r, ["one E", "N", "D two"])
    assert [d.text for d in deltas] == ["one ", "", ""] and deltas[-1].finish_reason == "stop"
    assert r.stopped  # the endpoint's stream goes on: it did not end the answer itself
    # What looked like a stop's start but was not goes out once the next token decides it, or at the end.
    r = relay(stop=("END",))
    assert [d.text for d in feed(r, ["E", "x"])] == ["", "Ex"]
    assert r.feed(TokenEvent("E", finish_reason="stop"), 100.0) == Delta("E", "stop")


def test_a_tool_call_goes_out_whole_and_the_answer_ends_in_tool_calls():
    r = relay(tools=WEATHER)
    deltas = feed(r, ["Checking.", *CALL])
    assert deltas[0] == Delta("Checking.")
    assert all(d == Delta("") for d in deltas[1:-1])
    call = deltas[-1].tool_calls[0]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    last = r.feed(TokenEvent("", finish_reason="stop"), 100.0)
    assert last == Delta("", "tool_calls")


def test_a_held_call_the_limit_cuts_goes_out_if_its_json_is_whole():
    r = relay(max_tokens=5, tools=WEATHER)
    *held, last = feed(r, ["Checking.", *CALL[:4]])
    assert all(d.text == "" and not d.tool_calls for d in held[1:])
    assert last.finish_reason == "length" and last.tool_calls[0].name == "get_weather"


def test_a_rewind_inside_a_held_call_goes_back_to_the_last_delivered_token():
    r = relay(tools=WEATHER)
    feed(r, ["Checking", "."])
    feed(r, CALL[:3], first_id=2)  # the source fails here, inside the call
    assert r.holding_call and r.produced == 5
    assert r.rewind_uncommitted_call()
    assert not r.holding_call and r.prefix() == Prefix((0, 1), "Checking.", 2)
    # The next endpoint writes the call again, whole, and the client gets it once.
    deltas = feed(r, CALL, first_id=2)
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 0, 0, 0, 1] and all(d.text == "" for d in deltas)
    assert r.prefix().tokens == 2 + len(CALL)
    assert not r.rewind_uncommitted_call()  # nothing held: nothing to forget
    assert r.prefix().tokens == 2 + len(CALL)


def test_no_rewind_without_tools_or_outside_a_call():
    r = relay()
    feed(r, ["<tool_call>", "x"])
    assert not r.holding_call and not r.rewind_uncommitted_call() and r.produced == 2


def test_text_pieces_without_ids_continue_as_text():
    r = relay()
    r.feed(TokenEvent("a", 7), 100.0)
    r.feed(TokenEvent("bc"), 100.0)
    r.feed(TokenEvent("d", 9), 100.0)
    assert r.prefix() == Prefix(None, "abcd", 3) and r.ids is None


def test_the_consumption_clock_counts_late_tokens_and_the_clients_lead():
    r = relay(rate=10.0)  # token i is due at 100 + i / 10
    r.feed(TokenEvent("a", 0), 100.0)  # on time
    r.feed(TokenEvent("b", 1), 100.1)  # exactly due
    r.feed(TokenEvent("c", 2), 100.5)  # due at 100.2: late
    r.feed(TokenEvent("", finish_reason=None), 200.0)  # no token: no deadline
    assert r.delayed == 1
    assert r.lead(100.0) == 3 and r.lead(100.1) == pytest.approx(2)  # tokens delivered, not read yet


def test_logprobs_go_with_their_text_and_a_cut_token_keeps_its_logprob():
    r = relay(stop=("swer",), logprobs=0)
    pieces = [" The", " answer", " is"]
    deltas = [
        r.feed(TokenEvent(p, i, logprobs=(TokenLogprob(-0.5 * i, p.encode()),)), 100.0) for i, p in enumerate(pieces)
    ]
    assert deltas[0] == Delta(" The", None, (TokenLogprob(-0.0, b" The", (), " The"),))
    last = deltas[1]
    assert last.finish_reason == "stop" and last.text == " an"
    assert [(e.token, e.logprob) for e in last.logprobs] == [(" an", -0.5)]
