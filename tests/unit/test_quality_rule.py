"""The quality policy's pure parts (policies/quality.py): the confidence monitor behind its one knob τ, how tool calls
compare, an agent loop seen in a conversation; the device's confidence from its logits; a held tool call looked at
before it is delivered."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.serving.relay import Relay
from app.serving.tool_calls import ToolCallSplitter
from clients.base import GenerationRequest, TokenEvent
from clients.logprobs import confidence_of, log_softmax
from policies.quality import ConfidenceMonitor, TokenConfidence, call_key, check_threshold, loops, repeats


def sure(p: float) -> TokenConfidence:
    return TokenConfidence(p, p / 2, 1.0)


def test_the_monitor_escalates_when_the_windows_mean_falls_below_tau():
    m = ConfidenceMonitor(0.5, window=4, warmup=2)
    assert not m.add(sure(0.1))  # before the warm-up: no verdict on one token
    assert m.add(sure(0.2))  # mean 0.15 < 0.5
    m = ConfidenceMonitor(0.5, window=4, warmup=2)
    verdicts = [m.add(sure(p)) for p in (0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1)]
    # means over the last 4: 0.9, 0.9, 0.9, 0.9, 0.7, 0.5 (not below), 0.3 → the 7th token escalates
    assert verdicts == [False, False, False, False, False, False, True]
    assert m.mean == pytest.approx((0.9 + 0.1 * 3) / 4)


def test_tau_zero_never_escalates_and_tau_one_at_the_first_check():
    never, always = ConfidenceMonitor(0.0, warmup=1), ConfidenceMonitor(1.0, warmup=1)
    assert not any(never.add(sure(0.0)) for _ in range(50))
    assert always.add(sure(0.999))


@pytest.mark.parametrize("bad", [-0.01, 1.01, math.nan, "0.5", True, None])
def test_tau_is_a_number_in_the_unit_interval(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_threshold(bad)
    assert check_threshold(1) == 1.0


def test_calls_compare_by_name_and_canonical_arguments():
    a = call_key("add", '{"a": 1, "b": 2}')
    assert a == call_key("add", {"b": 2, "a": 1}) == call_key("add", '{"b":2,"a":1}')
    assert a != call_key("add", {"a": 2, "b": 1}) and a != call_key("sub", {"a": 1, "b": 2})
    assert call_key("f", "not json") == ("f", "not json")
    assert repeats(a, [call_key("sub", {}), a]) and not repeats(a, [])
    assert loops([a, call_key("sub", {}), a]) and not loops([a, call_key("sub", {})])


def test_confidence_from_logits():
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    c = confidence_of(log_softmax(logits))
    assert c.top == pytest.approx(0.7, rel=1e-5) and c.margin == pytest.approx(0.5, rel=1e-5)
    assert c.entropy == pytest.approx(-(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1)), rel=1e-5)
    flat = confidence_of(log_softmax(np.zeros(1000, dtype=np.float32)))
    assert flat.top == pytest.approx(1e-3) and flat.margin == pytest.approx(0.0, abs=1e-7)
    assert flat.entropy == pytest.approx(math.log(1000), rel=1e-5)


def test_a_held_call_is_looked_at_without_changing_what_is_held():
    splitter = ToolCallSplitter(frozenset({"add"}))
    assert splitter.feed("<tool_call>") == ("", [])
    assert splitter.feed('{"name": "add", "arguments": {"a": 1}}') == ("", [])
    (call,) = splitter.peek("</tool_call>", final=False)
    assert (call.name, call.arguments) == ("add", '{"a": 1}')
    assert splitter.holding and splitter.committed == 0 and splitter.calls == 0
    assert splitter.peek(" more", final=False) == []
    _, (delivered,) = splitter.feed("</tool_call>")  # the real feed still completes it
    assert delivered.name == "add" and not splitter.holding


def test_the_relay_names_the_call_an_event_would_complete():
    tools = ({"type": "function", "function": {"name": "add"}},)
    relay = Relay(GenerationRequest(prompt_text="q", tools=tools, max_tokens=50), 0.0, 4.0)
    relay.feed(TokenEvent(" ok", token_id=1), 0.0)
    assert relay.call_completed_by(TokenEvent("<tool_call>", token_id=2)) is None  # not holding yet
    relay.feed(TokenEvent("<tool_call>", token_id=2), 0.0)
    relay.feed(TokenEvent('{"name": "add", "arguments": {}}', token_id=3), 0.0)
    assert relay.call_completed_by(TokenEvent(" ", token_id=4)) is None
    call = relay.call_completed_by(TokenEvent("</tool_call>", token_id=5))
    assert call is not None and call.name == "add"
    assert relay.produced == 3 and relay.holding_call
    # The answer's end completes a call whose closing tag never came.
    assert relay.call_completed_by(TokenEvent("", finish_reason="stop")).name == "add"
