"""A real agent loop under each policy: the OpenAI Agents SDK, one `add(a, b)` tool, `tool_choice` left at auto.

Handed the tool's result, Qwen2.5-Coder-0.5B calls `add` again rather than answering, whatever the instructions say,
until the turn limit (tests/integration/test_agents_sdk.py stops the agent at its first call for that reason); the
1.5B stand-in cloud, told to tell the user the result, tells it. Under every policy that can reach the cloud the
device's repeated call is a fault, never delivered: the answer goes on on the cloud (reason `loop`). The run completes
with the tool called once and the answer given. The quality policy runs at τ = 0 here, so only the repeated call can
move the answer. device-only delivers the call as written.

Real parts: a gateway of the embedded default's shape with its own 1.5B cloud (the session's `gateway` stands the 0.5B
in for the cloud as well: here the cloud must be the better model), the 0.5B device in reproducible mode,
llama-cpp-python's server, the real `openai-agents` SDK over the real `openai` client on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from tests.conftest import EMBEDDED_CONFIG
from tests.integration.disco_helpers import trace

set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers

# The embedded default's shape with the 1.5B as its cloud (the device's model line stays the 0.5B).
CONFIG = EMBEDDED_CONFIG.replace(
    '[clouds.cloud]\nmodel = "qwen2.5-coder-0.5b-instruct"', '[clouds.cloud]\nmodel = "qwen2.5-coder-1.5b-instruct"'
).replace(
    '[clouds.cloud.embedded]\nmodel = "qwen2.5-coder-0.5b-instruct"',
    '[clouds.cloud.embedded]\nmodel = "qwen2.5-coder-1.5b-instruct"',
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    assert CONFIG.count("1.5b") == 2, CONFIG
    gw = start_gateway(CONFIG)
    yield gw
    stop_gateway(gw)


QUALITY = {"tandem": {"policy": "quality", "quality_threshold": 0}}


def run_agent(gw, extra_body: dict, max_turns: int = 4) -> tuple[str, list, list]:
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
            timeout=180,
            http_client=DefaultAsyncHttpxClient(event_hooks={"response": [remember]}),
        )
        agent = Agent(
            name="calculator",
            instructions="You are a calculator. Use the add tool to add numbers, then tell the user the result.",
            tools=[add],
            model=OpenAIChatCompletionsModel(model="tandem", openai_client=client),
            model_settings=ModelSettings(max_tokens=40, temperature=0, extra_body=extra_body),
        )
        result = await Runner.run(agent, "What is 17 + 25?", max_turns=max_turns)
        return result.final_output

    return asyncio.run(main()), calls, ids


@pytest.mark.parametrize("body", [QUALITY, {"tandem": {"policy": "disco"}}], ids=["quality", "disco"])
def test_a_repeated_tool_call_is_a_fault_the_cloud_takes_over_and_the_run_completes(gateway, body):
    """Under every policy that can reach a cloud the device's repeated call is a fault: never delivered, the answer
    goes on on the cloud. DiSCo's start for a request with tools under auto is the device (its calls come out whole
    there); the quality policy's is DiSCo's."""
    policy = body["tandem"]["policy"]
    output, calls, ids = run_agent(gateway, body)
    assert calls == [(17, 25)]
    assert "42" in str(output)
    first, second = (trace(gateway, rid) for rid in ids)  # the call, then the answer: no third turn
    assert first["policy"] == policy and first["migrations"] == []
    assert [e["backend"] for e in first["endpoints"]] == ["device"]  # the call itself, written on the device
    (move,) = second["migrations"]
    assert (move["from"], move["to"], move["reason"], move["at_token"]) == ("device", "cloud", "loop", 0)
    assert [(e["backend"], e["outcome"]) for e in second["endpoints"]] == [
        ("device", "migrated-from"),
        ("cloud", "finished"),
    ]
    assert gateway.metric("tandem_migrations_total", source="device", target="cloud", reason="loop") >= 1


def test_device_only_delivers_the_repeated_call_as_written(gateway):
    """device-only promised the device: its repeated call reaches the client, and the loop runs to the turn limit."""
    with pytest.raises(MaxTurnsExceeded):
        run_agent(gateway, {"tandem": {"policy": "device-only"}}, max_turns=3)
