"""Claude Code's attribution block in `system` (`x-anthropic-billing-header: …`): not prompt, dropped and reported
(endpoints/anthropic_schemas.py, Conversation._attribution). Its fingerprint changes with every request, so as prompt
text it would be the first thing to differ between two turns of one conversation and the device's prompt cache would
never match past it (a Claude Code session re-prefilled its whole 13k-token prompt on every turn)."""

from __future__ import annotations

from endpoints.anthropic import messages_input
from endpoints.anthropic_schemas import CountTokensRequest, MessagesRequest

IDENTITY = "You are a Claude agent, built on Anthropic's Claude Agent SDK."


def system(fingerprint: str) -> list[dict]:
    header = f"x-anthropic-billing-header: cc_version=2.1.332.{fingerprint}; cc_entrypoint=sdk-cli; cch={fingerprint}0;"
    return [
        {"type": "text", "text": header},
        {"type": "text", "text": IDENTITY, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Use your tools."},
    ]


def request(fingerprint: str, **fields) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "tandem", "max_tokens": 8, "system": system(fingerprint), **fields}
        | {"messages": [{"role": "user", "content": "Create add.py"}]}
    )


def test_the_attribution_block_is_no_prompt_and_is_reported_ignored() -> None:
    first, second = (messages_input(request(f), None) for f in ("efc", "a1b"))
    assert first.messages[0] == {"role": "system", "content": f"{IDENTITY}\n\nUse your tools."}
    assert first.messages == second.messages  # two turns' prompts no longer differ at their first token
    assert first.extras["system.x-anthropic-billing-header"] is True
    assert first.extras["cache_control"] == {"type": "ephemeral"}  # the other blocks' hints stay


def test_a_system_of_the_attribution_block_alone_is_no_system_message() -> None:
    body = request("efc")
    body.system = body.system[:1]
    chat = messages_input(body, None)
    assert [m["role"] for m in chat.messages] == ["user"]


def test_other_system_texts_stay_whole() -> None:
    quoted = "Explain what x-anthropic-billing-header: means."  # not at the start of a block: prompt text
    body = MessagesRequest.model_validate(
        {
            "model": "tandem",
            "max_tokens": 8,
            "system": [{"type": "text", "text": quoted}],
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    chat = messages_input(body, None)
    assert chat.messages[0]["content"] == quoted and "system.x-anthropic-billing-header" not in chat.extras
    plain = MessagesRequest.model_validate(
        {"model": "tandem", "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert messages_input(plain, None).messages[0]["content"] == "Be brief."


def test_count_tokens_counts_the_prompt_without_it() -> None:
    counted = CountTokensRequest.model_validate(
        {"model": "tandem", "system": system("efc"), "messages": [{"role": "user", "content": "Create add.py"}]}
    )
    assert counted.system_text() == f"{IDENTITY}\n\nUse your tools."
