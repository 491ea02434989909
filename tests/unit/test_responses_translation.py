"""The Responses API's request → the chat request that answers it (endpoints/responses.py: chat_request)."""

from __future__ import annotations

from endpoints.responses import chat_request
from endpoints.responses_schemas import ResponsesRequest


def test_a_string_input_with_instructions_is_a_system_then_a_user_message() -> None:
    body = ResponsesRequest(
        model="tandem",
        input="Hi",
        instructions="Be brief.",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        user="u1",
        stream=True,
        tandem={"policy": "device"},
    )
    chat = chat_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert chat.token_limit == 7 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.user == "u1" and chat.stream and chat.tandem.policy == "device"


def test_message_items_keep_their_roles_and_join_their_parts() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": "tandem",
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "b", "annotations": []},
                        {"type": "output_text", "text": "c"},
                    ],
                },
                {"role": "user", "content": "d"},
            ],
        }
    )
    chat = chat_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("developer", "Rules."),
        ("user", "a"),
        ("assistant", "bc"),
        ("user", "d"),
    ]
    assert chat.token_limit is None and not chat.stream
