"""GBNF for upstreams that enforce one (clients/gbnf.py): the device's compact JSON and tool-call languages, and the
residual grammar a continuation sends, which must accept exactly the rests of the grammar's sentences past the
delivered prefix. (The real servers' parsers read these grammars in tests/integration/test_upstream_grammars.py.)"""

from __future__ import annotations

import json

import pytest

from clients import gbnf

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOTE = {
    "type": "function",
    "function": {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}},
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["x,y", ":", "q]"]},
    },
    "required": ["name"],
}


def accepts(grammar: str, text: str) -> bool:
    """Whether `text` is a whole sentence of `grammar`: its residual may end at once."""
    try:
        return () in gbnf.parse(gbnf.residual(grammar, text))["root"]
    except gbnf.GBNFError:
        return False


def test_json_is_written_the_way_the_device_writes_it():
    g = gbnf.json_grammar(SCHEMA)
    assert accepts(g, '{"name": "Ann", "tags": ["a", "b"], "kind": "x,y"}')
    assert accepts(g, '{"name": "Ann", "kind": "q]"}')
    assert accepts(g, '{"name": "", "tags": []}')
    for other in ('{"name":"Ann"}', '{ "name": "Ann"}', '{"name": "Ann" }', '{"name": "Ann",\n"tags": []}', "{}"):
        assert not accepts(g, other), other


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Zo\\u00e9 \\"Z\\"", "tags": ["\\n", "é"], "kind": ":"}',
        '{"name": "a,b: c"}',
    ],
)
def test_the_residual_at_every_cut_accepts_exactly_the_rest(text):
    g = gbnf.json_grammar(SCHEMA)
    assert accepts(g, text)
    for cut in range(len(text) + 1):
        rest = gbnf.residual(g, text[:cut])
        gbnf.parse(rest)  # written back as a grammar that parses
        assert accepts(rest, text[cut:]), cut
        assert not accepts(rest, text[cut:] + "}"), cut
        if cut < len(text):
            assert not accepts(rest, text[cut:-1]), cut  # the closing brace is still owed


def test_a_prefix_outside_the_grammar_is_refused_with_where_it_left():
    with pytest.raises(gbnf.GBNFError, match="character 1"):
        gbnf.residual(gbnf.json_grammar(SCHEMA), '{ "name"')


def test_a_complete_answer_leaves_only_the_end():
    g = gbnf.json_grammar({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    assert gbnf.parse(gbnf.residual(g, '{"a": true}'))["root"] == [()]


def test_tool_calls_name_an_offered_function_with_valid_arguments():
    one = gbnf.tool_calls_grammar([ADD, NOTE], ["add", "note"], False, "<tool_call>", "</tool_call>")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": -25}}\n</tool_call>'
    note = '<tool_call>\n{"name": "note", "arguments": {"text": "hi"}}\n</tool_call>'
    assert accepts(one, call) and accepts(one, note)
    assert not accepts(one, call + "\n" + note)  # one call unless parallel calls are asked for
    assert not accepts(one, call.replace('"add"', '"sub"'))
    assert not accepts(one, call.replace("17", '"17"'))
    assert not accepts(one, call.replace(', "b": -25', ""))  # b is required
    several = gbnf.tool_calls_grammar([ADD, NOTE], ["add", "note"], True, "<tool_call>", "</tool_call>")
    assert accepts(several, call + "\n" + note)
    for cut in range(0, len(call) + 1, 7):
        assert accepts(gbnf.residual(several, call[:cut]), call[cut:] + "\n" + note)


def test_only_the_named_function_when_one_is_forced():
    g = gbnf.tool_calls_grammar([ADD, NOTE], ["note"], False, "<tool_call>", "</tool_call>")
    assert accepts(g, '<tool_call>\n{"name": "note", "arguments": {}}\n</tool_call>')
    assert not accepts(g, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_gbnf_syntax_round_trips():
    text = r"""
# a comment
root ::= greeting (", " name)+ tail?   # trailing comment
greeting ::= "h\x69" | [Hh] "ello"
name ::= [^\]\-\\"^,\n]{1,3} | "\"q\""
tail ::= [\u00e9-\u00ea] "\t" .
"""
    g = gbnf.write(gbnf.parse(text))
    assert gbnf.parse(g) == gbnf.parse(gbnf.write(gbnf.parse(g)))
    for grammar in (text, g):
        assert accepts(grammar, 'hi, ab, "q"')
        assert not accepts(grammar, "hi, a^")
        assert accepts(grammar, "Hello, x\u00ea\t!")
        assert not accepts(grammar, "hi")  # at least one name
        assert not accepts(grammar, "hi, abcd")  # at most 3 characters
        assert not accepts(grammar, "hi, a]")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("root ::= a", "not defined"),
        ("rot ::= [a]", "no root"),
        ('root ::= "a', "unterminated"),
        ("root ::= [a", "unterminated"),
        ('root ::= "\\q"', "escape"),
        ("root ::= root [a]", None),  # left recursion parses; it fails when run
        ('root ::= "a"\nroot ::= "b"', "twice"),
        ("root ::= <[12]>", "token"),
    ],
)
def test_bad_grammars_are_named(text, message):
    if message is None:
        with pytest.raises(gbnf.GBNFError, match="left recursion"):
            gbnf.residual(text, "a")
        return
    with pytest.raises(gbnf.GBNFError, match=message):
        gbnf.parse(text)


def test_a_schema_with_no_gbnf_form_is_an_error():
    with pytest.raises(gbnf.GBNFError):
        gbnf.json_grammar({"$ref": "https://example.com/remote.json"})


def test_the_grammar_is_the_one_json_dumps_writes():
    # The compact separators are Python's json.dumps defaults: what a client's parser and the device produce.
    value = {"name": "N", "tags": ["t"], "kind": ":"}
    assert accepts(gbnf.json_grammar(SCHEMA), json.dumps(value))
