"""The coding-agent CLIs, unchanged, against one real gateway: Claude Code (the Anthropic Messages API), Codex CLI (the
Responses API), opencode (chat completions with tools) and aider (chat completions, edits as text), each run once,
headless.

The binaries are the pinned ones deploy/agent_clis.py installs into its cache (`make agents`, part of the set-up);
where they are missing each test fails with the command that installs them. Each runs with a scratch HOME (its
config, data, cache and state folders under it) and is pointed at the gateway the way its documentation says
(app/tools/bench/agent_runs.py). Between the CLI and the gateway, the bench's recording proxy forwards every byte as
it is and records each request's shape, status, the gateway's message and its `x-tandem-*` headers.

The gateway is the embedded default's shape on the small SmolLM2-135M (device and embedded cloud): the point is the
wire, not the task. Whatever the model writes, every request the CLI sends must be answered (no 4xx/5xx, no error
inside a stream: the proxy's record and the gateway's own request counters both say so) and the CLI must exit 0.
What keeps it cheap and bounded:
- the gateway's `max_answer_tokens` caps every answer (SmolLM2 at the CLIs' temperature 1 rarely stops on its own):
  Claude Code's and opencode's `max_tokens: 32000` is clamped to it end to end and said so (`x-tandem-max-tokens-
  clamped`, the trace); Codex and aider name no limit and are cut silently;
- each CLI's own long system prompt and most of its tools cut through its own settings (`lean`: the same fields,
  headers and tool kinds, a few thousand tokens instead of 10-20k; prefill runs ~100 tokens/s on one thread here);
- Claude Code and Codex fail a turn whose answer was cut at a limit (Claude Code resumes three times, then exits 1;
  Codex exits 1 on `incomplete`), so their answers are made to end through their own settings (`brief`: Claude
  Code's stop_sequences, Codex's --output-schema); opencode and aider take a cut answer as the end of their turn.
aider runs through `tandem bench agents --quick` (one HumanEval task), which this module covers too. The slow, real
agent runs (solving tasks, per configuration, the CLIs as shipped) are `tandem bench agents`'s. Prompts longer than
the device's window and device-pinned refusals: tests/integration/test_context_windows.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from app.tools.bench import agents_bench
from app.tools.bench.agent_runs import DRIVERS, AgentRun, run_agent
from app.tools.bench.wire_recorder import Exchange, WireRecorder
from deploy import agent_clis

MODEL = "tandem"
ANSWER_CAP = 48  # [gateway] max_answer_tokens: every answer at most this many tokens
GATEWAY_CONFIG = f"""
[gateway]
model_name = "{MODEL}"
policy = "disco"
default_max_tokens = 0
max_answer_tokens = {ANSWER_CAP}
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
flash_attn = true
logits_all = false
"""
TASK = "Create a file add.py with a Python function add(a, b) that returns a + b."
TIME_CAP = 150.0  # seconds a CLI gets; each run here takes well under a minute


def _shipped_claude(turn: Exchange) -> list[str]:
    shape = turn.shape
    return [
        *({"thinking", "context_management", "output_config", "metadata"} - set(shape["extra_fields"])),
        *(["?beta=true"] if not turn.path.endswith("?beta=true") else []),
        *(["anthropic-beta"] if not shape.get("anthropic_beta") else []),
        *(["a system message inside messages"] if "system" not in shape.get("roles", ()) else []),
    ]


def _shipped_codex(turn: Exchange) -> list[str]:
    shape = turn.shape
    wanted = {"include", "reasoning", "store", "prompt_cache_key", "client_metadata", "parallel_tool_calls", "text"}
    kinds = {"function", "namespace", "web_search"}
    return [*(wanted - set(shape["extra_fields"])), *(kinds - set(shape["tool_kinds"]))]


def _shipped_opencode(turn: Exchange) -> list[str]:
    return list({"stream_options"} - set(turn.shape["extra_fields"]))


# Per CLI: what its first request for an answer must carry on the wire (the fields the CLI ships with, which the lean
# settings keep), read from the recorded shape; each returns what is missing.
SHIPPED = {"claude": _shipped_claude, "codex": _shipped_codex, "opencode": _shipped_opencode}
# ... and what of it the gateway must report ignored (x-tandem-ignored-fields) on the device that answers it; Claude
# Code's attribution block in `system` among them (its per-request fingerprint is no prompt).
REPORTED = {
    "claude": {"context_management", "tools.defer_loading", "anthropic-beta", "system.x-anthropic-billing-header"},
    "codex": {"include", "reasoning.summary", "tools.web_search", "client_metadata"},
    "opencode": set(),
}


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


def trace(gw: GatewayProcess, exchange: Exchange) -> dict:
    return httpx.get(f"{gw.v1}/requests/{exchange.request_id}", timeout=10).json()


def assert_bounded(gw: GatewayProcess, turns: list[Exchange]) -> None:
    """Every answer within the gateway's cap; a limit the CLI named above it clamped and said so (header and
    trace), a limit never named cut silently."""
    for turn in turns:
        t = trace(gw, turn)
        assert t["completion_tokens"] <= ANSWER_CAP, t
        asked = turn.shape.get("max_tokens")
        if asked is not None and asked > ANSWER_CAP:
            assert turn.tandem_headers.get("x-tandem-max-tokens-clamped") == f"{asked}->{ANSWER_CAP}", turn
            assert t["max_tokens_clamped"] == {"asked": asked, "given": ANSWER_CAP, "endpoint": "gateway"}
        else:
            assert "x-tandem-max-tokens-clamped" not in turn.tandem_headers and "max_tokens_clamped" not in t


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_an_agent_cli_runs_against_the_gateway_with_every_request_answered(agent, agent_gateway, tmp_path):
    home_before = set(os.listdir(Path.home()))
    refused_before = refusals(agent_gateway)
    started = time.monotonic()
    with WireRecorder(agent_gateway.url) as wire:
        run = AgentRun(tmp_path / "repo", tmp_path / "home", wire.url, MODEL, TASK, transcript=tmp_path, lean=True,
                       brief=True)  # fmt: skip
        result = run_agent(agent, run, TIME_CAP)
        wire.settle(0)
    print(f"{agent}: {time.monotonic() - started:.1f} s, {len(wire.exchanges)} requests")  # the module's time budget
    turns = [e for e in wire.exchanges if e.generation]
    assert turns, f"{agent} sent no request for an answer:\n{result.tail()}"
    assert all(e.route == DRIVERS[agent].speaks for e in turns), describe(turns)
    refused = [e for e in wire.exchanges if not e.answered]
    assert not refused, f"{agent}: requests not answered:\n{describe(refused)}\n{result.tail()}"
    assert refusals(agent_gateway) == refused_before  # the gateway's own count agrees
    assert result.ok, result.tail()
    assert not SHIPPED[agent](turns[-1]), f"{agent}'s wire lacks {SHIPPED[agent](turns[-1])}: {turns[-1].shape}"
    reported = turns[-1].tandem_headers.get("x-tandem-ignored-fields", "").split(", ")
    assert REPORTED[agent] <= set(reported), reported
    assert_bounded(agent_gateway, turns)
    assert set(os.listdir(Path.home())) == home_before  # its folders went to its scratch HOME, not ours
    assert (tmp_path / "home").is_dir() and any((tmp_path / "home").iterdir())


def test_the_bench_runs_aider_on_a_task_with_every_request_answered(agent_gateway, tmp_path):
    """`tandem bench agents --quick` against this gateway: one HumanEval task, aider (its edits as text, no tools,
    temperature 0, no limit named), the table and the transcript written; aider exits 0 and every request it sent
    is answered (the model's answer may or may not solve the task)."""
    refused_before = refusals(agent_gateway)
    out = tmp_path / "out"
    code = agents_bench.main(["--quick", "--agents", "aider", "--gateway", agent_gateway.url, "--out", str(out)])
    report = (out / "agents.md").read_text()
    assert code == 0, report
    row = next(line for line in report.splitlines() if line.startswith("| aider | as-served |"))
    assert row.split("|")[3].strip() in ("0/1", "1/1")
    [task] = (out / "transcripts" / "as-served" / "aider").iterdir()
    record = json.loads((task / "record.json").read_text())
    assert record["turns"] and not record["refused"] and not record["unanswered"], record
    assert record["exit_code"] == 0 and not record["timed_out"], (task / "stderr.txt").read_text()[-1500:]
    assert refusals(agent_gateway) == refused_before
    for turn in record["turns"]:  # aider names no limit: cut at the cap, silently
        assert turn["route"] == "/v1/chat/completions" and turn["answer_tokens"] <= ANSWER_CAP, turn
        assert "x-tandem-max-tokens-clamped" not in turn["tandem_headers"], turn
    assert (task / agents_bench.MODULE).is_file()
    assert any(p.name.endswith("request-v1-chat-completions.json") for p in (task / "wire").iterdir())
