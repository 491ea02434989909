"""Dialects as declared objects (clients/dialects.py): each continuation's request, each provider's forwarded fields
under its own names, and what an endpoint reports as ignored."""

from __future__ import annotations

import pytest

from clients.dialects import CONTINUATIONS, LLAMA_CPP, PROVIDERS, UPSTREAM_CONTINUATIONS, upstream_dialect

HISTORY = [{"role": "user", "content": "Count."}]


@pytest.mark.parametrize(
    ("name", "final", "fields"),
    [
        ("prefill", {}, {}),
        ("prefix-flag", {"prefix": True}, {}),
        ("continue-final-message", {}, {"continue_final_message": True, "add_generation_prompt": False}),
    ],
)
def test_a_chat_continuation_is_the_answer_so_far_as_its_dialect_documents(name, final, fields):
    messages, top = CONTINUATIONS[name].chat_request(HISTORY, "1, 2,")
    assert messages == [*HISTORY, {"role": "assistant", "content": "1, 2,", **final}]
    assert top == fields


@pytest.mark.parametrize("name", ["chat", "completions", "tokens"])
def test_only_chat_dialects_build_a_chat_continuation(name):
    with pytest.raises(ValueError, match="not a chat continuation"):
        CONTINUATIONS[name].chat_request(HISTORY, "1,")


def test_whitespace_moves_out_of_a_prefix_in_every_chat_dialect_only():
    assert {n for n, c in CONTINUATIONS.items() if c.moves_whitespace} == {
        "chat",
        "prefill",
        "prefix-flag",
        "continue-final-message",
    }
    assert "tokens" not in UPSTREAM_CONTINUATIONS


def test_each_provider_forwards_in_its_own_names():
    asked = {"repeat_penalty": 1.1, "mirostat_mode": 2, "reasoning_effort": "low", "store": False}
    assert PROVIDERS["vllm"].forwarded(asked) == {"repetition_penalty": 1.1, "reasoning_effort": "low"}
    assert PROVIDERS["llama-server"].forwarded(asked) == {"repeat_penalty": 1.1, "mirostat": 2}
    assert PROVIDERS["openai"].forwarded(asked) == {"reasoning_effort": "low", "store": False}
    assert PROVIDERS["mistral"].forwarded(asked) == {}


def test_what_an_endpoint_does_not_take_is_ignored_with_its_reason_but_the_trace_keeps_user_and_metadata():
    asked = {"min_p": 0.1, "reasoning_effort": "low", "user": "alice", "metadata": {"a": "b"}}
    assert LLAMA_CPP.ignored(asked, "device") == {"reasoning_effort": "device (llama.cpp) does not take it"}
    assert set(PROVIDERS["openai"].ignored(asked, "oai")) == {"min_p"}


def test_a_clouds_own_settings_win_over_its_providers_dialect():
    dialect = upstream_dialect("mistral", "completions", stream_usage=True)
    assert dialect.name == "mistral" and dialect.continuation.raw_prompt and dialect.stream_usage
    assert upstream_dialect(None).name == "openai-compatible"
