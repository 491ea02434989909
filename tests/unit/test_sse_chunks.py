"""One chunk renderer (endpoints/sse.py) for chat with n = 1 and n > 1: each write's bytes for scripted deltas, the
opening with the first content, tool calls after their text, the end of the stream in the last write, failures."""

from __future__ import annotations

import asyncio
import json

from app.serving.job import Job
from app.serving.relay import Delta
from app.serving.tool_calls import ToolCall
from clients.base import BackendError, GenerationRequest, TokenLogprob, Usage
from endpoints.sse import ChatChunks, stream_answer, stream_choices

CALL = ToolCall("call_1", "get_weather", '{"city":"Paris"}')


def job() -> Job:
    j = Job(id="chatcmpl-1", gen=GenerationRequest(prompt_text="hi"), prompt_tokens=3, policy="disco")
    j.usage = Usage(3, 4)
    return j


async def _deltas(items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def one(deltas, chat: bool = True, include_usage: bool = False, logprobs: bool = False) -> list[list[dict | str]]:
    """Each write of a one-choice stream, as its events (JSON objects, or "[DONE]")."""
    chunks = ChatChunks("chatcmpl-1", "m", chat, include_usage, logprobs=logprobs)

    async def run():
        return [w async for w in stream_answer(job(), deltas[0], _deltas(deltas[1:]), chunks)]

    return [events(w) for w in asyncio.run(run())]


def events(write: bytes) -> list[dict | str]:
    assert write.endswith(b"\n\n")
    out = []
    for block in write.decode().split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def deltas_of(write: list) -> list:
    return [
        e["choices"][0].get("delta", e["choices"][0].get("text")) if e != "[DONE]" and e["choices"] else e
        for e in write
    ]


def test_the_role_goes_with_the_first_text_and_the_end_with_the_last_chunk():
    writes = one([Delta(""), Delta("Hel"), Delta("lo", "stop")], include_usage=True)
    assert len(writes) == 2  # nothing for the held first delta
    assert deltas_of(writes[0]) == [{"role": "assistant", "content": ""}, {"content": "Hel"}]
    *last, usage, done = writes[1]
    assert deltas_of(last) == [{"content": "lo"}] and last[0]["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    assert done == "[DONE]"
    assert all(e["usage"] is None for w in writes for e in w if e != "[DONE]" and e["choices"])


def test_reasoning_goes_out_as_it_came_before_the_text_it_led_to():
    writes = one(
        [Delta("", reasoning="Let me"), Delta("", reasoning=" think."), Delta("42", reasoning="\n"), Delta("", "stop")]
    )
    chunks = [d for w in writes for d in deltas_of(w)]
    assert chunks[:5] == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "Let me"},
        {"reasoning_content": " think."},
        {"reasoning_content": "\n"},
        {"content": "42"},
    ]
    # completions have no place for thinking: only the text goes out
    text = [
        d for w in one([Delta("", reasoning="hm"), Delta("42"), Delta("", "stop")], chat=False) for d in deltas_of(w)
    ]
    assert text[0] == "42"


def test_tool_calls_follow_their_text_and_the_finish_has_a_chunk_of_its_own():
    writes = one([Delta("Checking."), Delta("", "tool_calls", None, (CALL,))])
    name, arguments, finish, done = writes[1]
    assert name["choices"][0]["delta"]["tool_calls"][0] == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert arguments["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": CALL.arguments}}]}
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert done == "[DONE]"
    # Text and a call in one delta: one write, the text first; a later call counts on from the first.
    writes = one([Delta("a", None, None, (CALL,)), Delta("", None, None, (CALL,)), Delta("", "tool_calls")])
    assert [e["choices"][0]["delta"].get("content") for e in writes[0]] == ["", "a", None, None]
    assert [e["choices"][0]["delta"]["tool_calls"][0]["index"] for e in writes[1]] == [1, 1]


def test_completions_have_no_role_chunk_and_logprobs_go_with_their_text():
    lp = (TokenLogprob(-0.5, b"Hi", (), "Hi"),)
    writes = one([Delta("Hi", None, lp), Delta("", "length")], chat=False, logprobs=True)
    (first,) = writes[0]
    assert first["choices"][0]["text"] == "Hi" and first["choices"][0]["logprobs"]["tokens"] == ["Hi"]
    assert writes[1] == [
        {**first, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]},
        "[DONE]",
    ]


def test_a_failure_after_the_first_token_is_an_error_event_then_done():
    writes = one([Delta(""), BackendError("upstream went away", 502)])
    role, error, done = writes[0]  # the role chunk was still owed
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert error["error"]["code"] == "backend_502" and error["error"]["type"] == "server_error" and done == "[DONE]"


def test_n_choices_share_the_renderer_and_end_once_with_the_summed_usage():
    def run(items, include_usage: bool) -> list[list[dict | str]]:
        chunks = [ChatChunks("chatcmpl-1", "m", True, include_usage, index=i) for i in range(2)]
        body = stream_choices("chatcmpl-1", items[0], _deltas(items[1:]), chunks, lambda: Usage(3, 9))

        async def read():
            return [w async for w in body]

        return [events(w) for w in asyncio.run(read())]

    merged = [(1, Delta("b")), (0, Delta("a")), (1, Delta("", "stop")), (0, Delta("!", "length"))]
    writes = run(merged, include_usage=True)
    assert [[(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in w] for w in writes[:4]] == [
        [(1, {"role": "assistant", "content": ""}), (1, {"content": "b"})],
        [(0, {"role": "assistant", "content": ""}), (0, {"content": "a"})],
        [(1, {})],
        [(0, {"content": "!"})],
    ]
    usage, done = writes[4]
    assert usage["usage"]["completion_tokens"] == 9 and done == "[DONE]"
    writes = run([(0, Delta("a")), (1, BackendError("gone", 504))], include_usage=False)
    assert len(writes) == 2 and writes[1][0]["error"]["code"] == "backend_504" and writes[1][1] == "[DONE]"
