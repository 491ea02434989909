"""The OpenAI Agents SDK's tool loop against a real gateway: one `add(a, b)` tool, `tool_choice` left at auto.

What a new user tried (issue 26): pinned to the device, Qwen2.5-Coder-0.5B wrote `{"name": "add_args", ...}` as
text (the parameters schema's title, which the prompt showed), so the agent never ran its tool; routed, the agent
looped to its turn limit. Now the prompt lists tools without schema titles and the device answers under the lazy
call grammar: a call it starts names an offered tool with valid arguments, and the SDK runs it.

The agent stops at its first tool call (`tool_use_behavior="stop_on_first_tool"`, the SDK's own option): handed
the tool's result, the 0.5B model calls `add` again rather than answering (with the result or without, whatever the
instructions say), so a loop that asks it again ends only at its turn limit. That is the model, not the wire; what
these tests hold is that the loop's call is well-formed, reaches the tool and completes the run.

A call written in a code fence (```` ```json ... ``` ````, as small models write them in agent loops) is read as a
call too: a scripted upstream writes exactly that answer, so the fence is certain, and the SDK's tool must run. The
real model asked to fence its calls is a separate check of the loop only: whether it did fence is not visible from
outside (a call reaches the client parsed either way), so that check does not claim it.

Real parts: the embedded default's shape (session fixture: the 0.5B device in reproducible mode, the 0.5B again as
the stand-in cloud, llama-cpp-python's server); a gateway of this module with a scripted OpenAI-compatible cloud on
loopback (tests/integration/scripted_upstream.py) that answers through the gateway's rendered prompt, as a completions
upstream does; the real `openai-agents` SDK over the real `openai` client on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.integration.disco_helpers import trace
from tests.integration.scripted_upstream import Answer, ScriptedUpstream

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


# The answer a small model writes when asked for fenced calls, piece by piece as a stream brings it.
FENCED_CALL = ("```", "json", "\n", '{"name": "add", ', '"arguments": {"a": 17, "b": 25}}', "\n", "```")


@pytest.fixture(scope="module")
def fence_gw(upstream: ScriptedUpstream) -> Iterator[GatewayProcess]:
    """A gateway whose cloud "scripted" is the scripted upstream as a completions upstream: the gateway renders the
    tools into the prompt and reads calls out of the text that comes back, as it does the device's."""
    process = start_gateway(f"""
[gateway]
policy = "cloud"
cloud = "scripted"
[device]
model = "smollm2-135m-instruct"   # never asked here: the model names the cloud
n_ctx = 2048
n_threads = 1
[disco]
profile_device = false
[clouds.scripted]
base_url = "{upstream.base_url}"
model = "scripted"
tokenizer = "device"
continuation = "completions"
""")
    yield process
    stop_gateway(process)


@pytest.mark.parametrize("streamed", [False, True], ids=["collected", "streamed"])
def test_a_call_written_in_a_code_fence_runs_the_agents_tool(fence_gw, upstream, streamed):
    upstream.reset()
    upstream.push(Answer(pieces=FENCED_CALL))
    output, calls, ids = run_agent(fence_gw, "scripted", streamed, instructions=FENCED)
    assert calls == [(17, 25)] and str(output) == "42"
    (sent,) = upstream.completions()  # the fenced answer was the one the agent's turn got
    assert '"name": "add"' in sent.body["prompt"]  # the tools travelled in the rendered prompt
    (request_id,) = ids
    (cloud,) = trace(fence_gw, request_id)["endpoints"]
    assert (cloud["backend"], cloud["outcome"]) == ("scripted", "finished")


@pytest.mark.parametrize("streamed", [False, True], ids=["collected", "streamed"])
def test_the_agent_loop_asked_for_fenced_calls_runs_add_on_the_device(gateway, streamed):
    """The real model under the fence-asking instructions: the loop's call reaches the tool and the run completes.
    Fenced or bare, its call reaches the client parsed, so the fence itself is the scripted test's to show."""
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
