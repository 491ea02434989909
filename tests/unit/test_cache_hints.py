"""The Anthropic door's `cache_control` (endpoints/anthropic.py): one prompt-caching hint for the request, forwarded
where a dialect takes it (OpenRouter's top-level `cache_control`), needed by no llama.cpp device, and reported
ignored everywhere else (clients/dialects.py)."""

from __future__ import annotations

from clients.dialects import LLAMA_CPP, PROVIDERS, TORCH
from endpoints.anthropic import messages_input
from endpoints.anthropic_schemas import MessagesRequest
from endpoints.serving import KeyAccess

USER = {"role": "user", "content": "Hello"}
EPHEMERAL_1H = {"type": "ephemeral", "ttl": "1h"}


def extras(**fields) -> dict:
    body = MessagesRequest.model_validate({"model": "tandem", "max_tokens": 8, "messages": [USER], **fields})
    return dict(messages_input(body, KeyAccess()).extras)


def test_the_requests_own_hint_wins_and_a_blocks_hint_stands_for_the_request():
    assert extras(
        cache_control=EPHEMERAL_1H, system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]
    ) == {"cache_control": EPHEMERAL_1H}
    on_a_block = {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": EPHEMERAL_1H}]}
    assert extras(messages=[on_a_block]) == {"cache_control": EPHEMERAL_1H}
    on_a_tool = {"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    assert extras(tools=[on_a_tool]) == {"cache_control": {"type": "ephemeral"}}


def test_no_hint_no_extra():
    assert "cache_control" not in extras()


def test_openrouter_takes_the_hint_a_llama_cpp_device_needs_none_the_others_ignore_it_visibly():
    fields = {"cache_control": EPHEMERAL_1H}
    assert PROVIDERS["openrouter"].forwarded(fields) == fields
    assert LLAMA_CPP.ignored(fields, "device") == {}
    for dialect in (PROVIDERS["openai"], PROVIDERS["anthropic-openai"], TORCH):
        assert dialect.forwarded(fields) == {}
        assert set(dialect.ignored(fields, "x")) == {"cache_control"}
