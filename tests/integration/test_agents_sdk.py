"""The OpenAI Agents SDK's tool loop against a real gateway: one `add(a, b)` tool, `tool_choice` left at auto.

What a new user tried (issue 26): pinned to the device, Qwen2.5-Coder-0.5B wrote `{"name": "add_args", ...}` as
text (the parameters schema's title, which the prompt showed), so the agent never ran its tool; routed, the agent
looped to its turn limit. Now the prompt lists tools without schema titles and the device answers under the lazy
call grammar: a call it starts names an offered tool with valid arguments, and the SDK runs it.

The agent stops at its first tool call (`tool_use_behavior="stop_on_first_tool"`, the SDK's own option): handed
the tool's result, the 0.5B model calls `add` again rather than answering (with the result or without, whatever the
instructions say), so a loop that asks it again ends only at its turn limit. That is the model, not the wire; what
these tests hold is that the loop's call is well-formed, reaches the tool and completes the run.

Real parts: the embedded default's shape (session fixture: the 0.5B device in reproducible mode, the 0.5B again as
the stand-in cloud, llama-cpp-python's server), the real `openai-agents` SDK over the real `openai` client on loopback.
"""

from __future__ import annotations

import asyncio

import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from tests.integration.disco_helpers import trace

set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers

INSTRUCTIONS = "You are a calculator. Use the add tool to add numbers."
# Asked so, the 0.5B model writes its call as ```json\n{\n  "name": "add", ...}\n``` (checked on the old code: there
# it reached the agent as text, and the tool never ran).
FENCED = INSTRUCTIONS + " Write each tool call as JSON inside a markdown code block (```json ... ```)."


def run_agent(
    gw, model: str, streamed: bool, extra_body: dict | None = None, instructions: str = INSTRUCTIONS
) -> tuple[str, list, list]:
    """(the run's final output, the tool's calls, the gateway's request ids)."""
    calls: list[tuple[int, int]] = []
    ids: list[str] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async def remember(response) -> None:
        ids.append(response.headers["x-request-id"])

    async def main() -> str:
        client = AsyncOpenAI(
            base_url=gw.v1,
            api_key="unused",
            max_retries=0,
            timeout=120,
            http_client=DefaultAsyncHttpxClient(event_hooks={"response": [remember]}),
        )
        agent = Agent(
            name="calculator",
            instructions=instructions,
            tools=[add],
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            model_settings=ModelSettings(max_tokens=40, temperature=0, extra_body=extra_body),
            tool_use_behavior="stop_on_first_tool",
        )
        if streamed:
            result = Runner.run_streamed(agent, "What is 17 + 25?", max_turns=2)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "What is 17 + 25?", max_turns=2)
        return result.final_output

    return asyncio.run(main()), calls, ids


@pytest.mark.parametrize("streamed", [False, True], ids=["collected", "streamed"])
def test_the_agent_loop_calls_add_on_the_device(gateway, streamed):
    output, calls, ids = run_agent(gateway, "device", streamed)
    assert calls == [(17, 25)] and str(output) == "42"
    (request_id,) = ids
    (device,) = trace(gateway, request_id)["endpoints"]
    assert (device["backend"], device["outcome"]) == ("device", "finished")


@pytest.mark.parametrize("streamed", [False, True], ids=["collected", "streamed"])
def test_a_call_written_in_a_code_fence_runs_the_agents_tool_on_the_device(gateway, streamed):
    output, calls, ids = run_agent(gateway, "device", streamed, instructions=FENCED)
    assert calls == [(17, 25)] and str(output) == "42"
    (request_id,) = ids
    (device,) = trace(gateway, request_id)["endpoints"]
    assert (device["backend"], device["outcome"]) == ("device", "finished")


def test_the_agent_loop_calls_add_through_routing(gateway):
    """DiSCo's own policy picks the endpoints; a request with tools under auto starts where a started call comes
    out whole (the device here: the stand-in cloud takes the tools only as prompt text)."""
    output, calls, ids = run_agent(gateway, "tandem", streamed=False, extra_body={"tandem": {"policy": "disco"}})
    assert calls == [(17, 25)] and str(output) == "42"
    t = trace(gateway, ids[0])
    assert t["policy"] == "disco" and t["endpoints"][0]["backend"] == "device"
