"""The coding-agent CLIs, unchanged, against one real gateway: Claude Code (the Anthropic Messages API), Codex CLI (the
Responses API), opencode (chat completions with tools) and aider (chat completions, edits as text), each run once,
headless, on a trivial task.

The binaries are the pinned ones deploy/agent_clis.py installs into its cache (`make agents`, part of the set-up);
where they are missing each test fails with the command that installs them. Each runs with a scratch HOME (its
config, data, cache and state folders under it) and is pointed at the gateway the way its documentation says
(app/tools/bench/agent_runs.py). Between the CLI and the gateway, the bench's recording proxy forwards every byte as
it is and records each request's status and the gateway's message.

The gateway is the embedded default's shape on the small SmolLM2-135M (device and embedded cloud), with a window
large enough for an agent's 10-20k-token prompts (SmolLM2 prefills them in seconds): the point is the wire, not the
task — whatever the model writes, every request the CLI sends must be answered (no 4xx/5xx, no error inside a
stream: the proxy's record and the gateway's own request counters both say so) and the CLI must exit 0. The slow,
real agent runs (solving tasks, per configuration) are `tandem bench agents`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from app.tools.bench import agents_bench
from app.tools.bench.agent_runs import DRIVERS, AgentRun, run_agent
from app.tools.bench.wire_recorder import WireRecorder
from deploy import agent_clis

MODEL = "tandem"
GATEWAY_CONFIG = f"""
[gateway]
model_name = "{MODEL}"
policy = "disco"
cloud = "cloud"
[device]
model = "smollm2-135m-instruct"
n_ctx = 32768
[disco]
profile_device = false
[clouds.cloud]
model = "smollm2-135m-instruct"
tokenizer = "device"
continuation = "completions"
[clouds.cloud.embedded]
model = "smollm2-135m-instruct"
port = 0
n_ctx = 32768
"""
TASK = "Create a file add.py with a Python function add(a, b) that returns a + b."
TIME_CAP = 120.0  # seconds a CLI gets; a run within the wire's budget takes far less


@pytest.fixture(scope="module")
def agent_gateway() -> Iterator[GatewayProcess]:
    missing = agent_clis.missing_message()
    if missing:  # not a skip: the set-up installs them (`make agents`)
        pytest.fail(missing, pytrace=False)
    gw = start_gateway(GATEWAY_CONFIG)
    yield gw
    stop_gateway(gw)


def refusals(gw: GatewayProcess) -> float:
    """The gateway's own count of requests it answered with a 4xx or 5xx, every route."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(gw.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "tandem_requests_total" and sample.labels.get("status", "0")[0] in "45":
                total += sample.value
    return total


def describe(exchanges) -> str:
    return "\n".join(
        f"{e.method} {e.path} -> {e.status}: {e.message or ('an error inside the stream' if e.stream_error else '')}"
        f"\n    {e.shape}"
        for e in exchanges
    )


@pytest.mark.parametrize("agent", list(DRIVERS))
def test_an_agent_cli_runs_against_the_gateway_with_every_request_answered(agent, agent_gateway, tmp_path):
    home_before = set(os.listdir(Path.home()))
    refused_before = refusals(agent_gateway)
    started = time.monotonic()
    with WireRecorder(agent_gateway.url) as wire:
        run = AgentRun(tmp_path / "repo", tmp_path / "home", wire.url, MODEL, TASK, transcript=tmp_path, lean=True)
        result = run_agent(agent, run, TIME_CAP)
    print(f"{agent}: {time.monotonic() - started:.1f} s, {len(wire.exchanges)} requests")  # the module's time budget
    turns = [e for e in wire.exchanges if e.generation]
    assert turns, f"{agent} sent no request for an answer:\n{result.tail()}"
    assert all(e.route == DRIVERS[agent].speaks for e in turns), describe(turns)
    refused = [e for e in wire.exchanges if not e.answered]
    assert not refused, f"{agent}: requests not answered:\n{describe(refused)}\n{result.tail()}"
    assert refusals(agent_gateway) == refused_before  # the gateway's own count agrees
    assert result.ok, result.tail()
    assert set(os.listdir(Path.home())) == home_before  # its folders went to its scratch HOME, not ours
    assert (tmp_path / "home").is_dir() and any((tmp_path / "home").iterdir())


def test_the_bench_scores_a_task_and_keeps_its_transcript(agent_gateway, tmp_path):
    """`tandem bench agents --quick` against this gateway: one HumanEval task, one CLI (aider, the quickest), the
    table and the transcript written, no request refused (the model's answer may or may not solve it)."""
    out = tmp_path / "out"
    code = agents_bench.main(["--quick", "--agents", "aider", "--gateway", agent_gateway.url, "--out", str(out)])
    report = (out / "agents.md").read_text()
    assert code == 0, report
    row = next(line for line in report.splitlines() if line.startswith("| aider | as-served |"))
    assert row.split("|")[3].strip() in ("0/1", "1/1")
    [task] = (out / "transcripts" / "as-served" / "aider").iterdir()
    assert (task / "record.json").is_file() and (task / agents_bench.MODULE).is_file()
    assert any(p.name.endswith("request-v1-chat-completions.json") for p in (task / "wire").iterdir())
