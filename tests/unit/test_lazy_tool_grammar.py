"""tool_choice auto: the lazy call grammar (free text, but a started call is whole and names an offered tool), and
the tool list as the prompt shows it (no schema titles a small model could take for the tool's name).

Why these tests: with `auto`, Qwen2.5-Coder-0.5B wrote `{"name": "add_args", ...}` for the OpenAI Agents SDK's
`add` tool (the parameters schema's title, which the prompt showed): a call to a tool nobody offered. The grammar
must leave answers that are not calls alone (any text, JSON that is not a call), and must make every call the
model starts, with the tag or as a bare JSON object, one the client can run. Both ways of writing the tag are
checked: a special token of the vocabulary (Qwen's), and the tag spelled out in text (a vocabulary without it).
"""

from __future__ import annotations

import threading

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from app.serving.requests import ChatInput
from app.serving.structured import CLOSE, OPEN, lazy_call_grammar, prompt_tool, structure_of
from clients.grammar import GrammarError, HFTokenizerGrammars

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        # What the OpenAI Agents SDK sends for `def add(a: int, b: int)`: pydantic's titles, strict mode.
        "parameters": {
            "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
            "required": ["a", "b"],
            "title": "add_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {"type": "object", "properties": {"title": {"type": "string", "title": "Title"}}},
    },
}


def _tokenizer(special_tags: bool) -> tuple[PreTrainedTokenizerFast, HFTokenizerGrammars]:
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    rust = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<eos>")
    if special_tags:
        tok.add_special_tokens({"additional_special_tokens": [OPEN, CLOSE]})
    return tok, HFTokenizerGrammars(tok, [tok.eos_token_id], threading.Lock())


@pytest.fixture(scope="module", params=["special-token", "spelled-out"])
def vocab(request):
    """(tokenizer, its grammars, the lazy grammar for add and note) for each way of writing the tag."""
    special = request.param == "special-token"
    tok, grammars = _tokenizer(special)

    def marker(text: str) -> str:
        return f"<[{tok.convert_tokens_to_ids(text)}]>" if special else f'"{text}"'

    return tok, grammars, lazy_call_grammar([ADD, NOTE], parallel=False, marker=marker)


def walk(vocab, text: str) -> tuple[bool, bool, bool]:
    """(every token of `text` allowed, the grammar finished after it, the end token allowed after it)."""
    tok, grammars, grammar = vocab
    mask = grammars.mask(grammar)
    for token in tok.encode(text):
        if not mask.allowed()[token]:
            return False, False, False
        mask.accept(token)
    return True, mask.finished, bool(mask.finished or mask.allowed()[tok.eos_token_id])


CALL = '{"name": "add", "arguments": {"a": 17, "b": 25}}'


@pytest.mark.parametrize(
    "text",
    [
        "The sum of 17 and 25 is 42.",
        "Use <b>bold</b> or {braces} freely.\nAnd newlines.",
        '{"x": 1, "name": "add"}',  # JSON that does not open with "name" is an answer, not a call
        "",
    ],
)
def test_an_answer_that_is_not_a_call_is_left_alone(vocab, text):
    allowed, finished, may_end = walk(vocab, text)
    assert allowed and not finished and may_end


@pytest.mark.parametrize("text", [f"{OPEN}\n{CALL}\n{CLOSE}", f"Let me add them.\n{OPEN}\n{CALL}\n{CLOSE}", CALL])
def test_a_well_formed_call_goes_through_and_ends_the_answer(vocab, text):
    assert walk(vocab, text) == (True, True, True)


@pytest.mark.parametrize(
    "text",
    [
        f'{OPEN}\n{{"name": "add_args", "arguments": {{"a": 1, "b": 2}}}}',  # the schema's title as the name
        '{"name": "add_args"',  # the same, bare
        f'{OPEN}\n{{"name": "add", "arguments": {{"a": "17", "b": 25}}}}',  # a string where the schema says integer
        '{"name": "add", "arguments": {"a": 1}}',  # b is required
        f'Sure.\n{OPEN}\n{{"name": "subtract"',  # no such tool
        f"{OPEN}\nI will call add.",  # a started call is a call
    ],
)
def test_a_started_call_must_be_a_valid_call_of_an_offered_tool(vocab, text):
    assert walk(vocab, text)[0] is False


def test_the_lazy_grammar_fits_a_prefix_written_without_it_or_says_not():
    tok, grammars = _tokenizer(special_tags=False)
    grammar = lazy_call_grammar([ADD], parallel=False)
    mask = grammars.mask(grammar)
    mask.advance(tok.encode("The answer is "))  # free text so far: it goes on
    with pytest.raises(GrammarError):
        grammars.mask(grammar).advance(tok.encode('{"name": "add_args"'))


def test_the_prompt_shows_tools_without_schema_titles_or_request_only_fields():
    shown = prompt_tool(ADD)
    assert shown == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "type": "object",
                "additionalProperties": False,
            },
        },
    }
    assert "add_args" not in str(shown)
    # A property named "title" is a name, not an annotation: it stays (its own title goes).
    assert prompt_tool(NOTE)["function"]["parameters"] == {
        "type": "object",
        "properties": {"title": {"type": "string"}},
    }
    assert ADD["function"]["parameters"]["title"] == "add_args"  # the request's tools are not changed


def chat(**fields) -> ChatInput:
    return ChatInput(model="m", messages=({"role": "user", "content": "17 + 25?"},), tools=(ADD,), **fields)


def test_only_auto_gets_the_lazy_grammar_and_every_request_with_tools_the_prompt_tools():
    auto = structure_of(chat())
    assert auto.grammar is None and auto.tool_grammar is not None and auto.prompt_tools == (prompt_tool(ADD),)
    assert structure_of(chat(tool_choice="auto")).tool_grammar == auto.tool_grammar
    forced = structure_of(chat(tool_choice="required"))
    assert forced.grammar is not None and forced.tool_grammar is None
    assert structure_of(chat(tool_choice="none")).tool_grammar is None
