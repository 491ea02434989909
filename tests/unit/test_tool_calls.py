"""The tool-call reader: content goes out at once, calls only whole, and what was delivered is always a whole
number of tokens (where another endpoint would take over)."""

from __future__ import annotations

import json

from app.serving.tool_calls import ToolCallSplitter

NAMES = frozenset({"get_weather"})
CALL = ["<tool_call>", "\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n", "</tool_call>"]


def feed_all(splitter: ToolCallSplitter, tokens: list[str]) -> tuple[str, list]:
    content, calls = [], []
    for token in tokens:
        text, done = splitter.feed(token)
        content.append(text)
        calls += done
    text, done = splitter.finish()
    return "".join(content) + text, calls + done


def test_plain_text_goes_out_token_by_token():
    s = ToolCallSplitter(NAMES)
    assert [s.feed(t) for t in ["Hello", " world", "."]] == [("Hello", []), (" world", []), (".", [])]
    assert s.committed == 3 and not s.holding


def test_a_tagged_call_is_held_until_whole_and_the_text_before_it_goes_out():
    s = ToolCallSplitter(NAMES)
    assert s.feed("Let me check.") == ("Let me check.", [])
    for token in CALL[:-1]:
        assert s.feed(token) == ("", [])
        assert s.holding and s.committed == 1  # delivered: exactly the first token
    text, calls = s.feed(CALL[-1])
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and s.committed == 1 + len(CALL) and not s.holding


def test_two_calls_and_the_whitespace_between_them():
    content, calls = feed_all(ToolCallSplitter(NAMES), [*CALL, "\n", *CALL])
    assert content == "" and len(calls) == 2 and calls[0].id != calls[1].id


def test_what_is_not_a_valid_call_is_delivered_as_text():
    bad = ["<tool_call>", "\n", "{not json}", "\n", "</tool_call>", " ok"]
    assert feed_all(ToolCallSplitter(NAMES), bad) == ("<tool_call>\n{not json}\n</tool_call> ok", [])
    almost = ["a <", "tool", " b"]  # looked like the start of a tag for two tokens
    assert feed_all(ToolCallSplitter(NAMES), almost) == ("a <tool b", [])


def test_at_the_end_an_unclosed_call_counts_only_if_its_json_is_complete():
    content, calls = feed_all(ToolCallSplitter(NAMES), CALL[:-2])
    assert content == "" and calls[0].name == "get_weather"
    content, calls = feed_all(ToolCallSplitter(NAMES), CALL[:3])
    assert content == "".join(CALL[:3]) and calls == []


def test_a_bare_json_call_at_the_start_is_a_call():
    bare = ['{"', 'name": "get_weather", "arguments": ', '{"city": "Rome"}}']
    content, calls = feed_all(ToolCallSplitter(NAMES), bare)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Rome"}
    # Naming a tool that was not offered, it is text; so is JSON of another shape, released as soon as it differs.
    assert feed_all(ToolCallSplitter(frozenset({"other"})), bare) == ("".join(bare), [])
    s = ToolCallSplitter(NAMES)
    assert s.feed('{"') == ("", []) and s.feed('city": 1}') == ('{"city": 1}', [])
    # After other content, a JSON object is content.
    s = ToolCallSplitter(NAMES)
    assert s.feed("Here:") == ("Here:", []) and s.feed('{"name": 1}') == ('{"name": 1}', [])


def test_a_fenced_json_call_at_the_start_is_a_call_held_until_whole():
    fenced = ["```", "json", "\n", "{\n", '  "name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "\n", "```"]
    s = ToolCallSplitter(NAMES)
    for token in fenced:
        assert s.feed(token) == ("", [])  # held, a whole token at a time: nothing half-delivered
        assert s.holding and s.committed == 0
    text, calls = s.finish()
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert s.committed == len(fenced) and not s.holding
    # An untagged fence, written in other pieces, and one whose closing fence never came, are calls too.
    for pieces in (
        ["``", "`\n{", '"name": "get_weather", "arguments": {}}\n``', "`"],
        ["```json {", '"name": "get_weather"}'],
    ):
        assert feed_all(ToolCallSplitter(NAMES), pieces)[1][0].name == "get_weather"


def test_a_fence_that_holds_no_call_is_text_released_as_soon_as_it_differs():
    s = ToolCallSplitter(NAMES)
    assert s.feed("```") == ("", []) and s.feed("python") == ("```python", [])  # another language: text at once
    s = ToolCallSplitter(NAMES)
    assert s.feed("```json\n") == ("", []) and s.feed('{"city": 1}') == ('```json\n{"city": 1}', [])
    # A fenced call of a tool not offered, or with text after its fence, is delivered as the text it is.
    other = ["```json\n", '{"name": "launch", "arguments": {}}', "\n```"]
    assert feed_all(ToolCallSplitter(NAMES), other) == ("".join(other), [])
    trailing = ["```json\n", '{"name": "get_weather", "arguments": {}}', "\n```", " Done."]
    assert feed_all(ToolCallSplitter(NAMES), trailing) == ("".join(trailing), [])


def test_discard_forgets_the_held_call_and_keeps_the_boundary():
    s = ToolCallSplitter(NAMES)
    s.feed("Sure.")
    for token in CALL[:3]:
        s.feed(token)
    s.discard()
    assert not s.holding and s.committed == 1
    assert s.feed(" Done") == (" Done", [])
