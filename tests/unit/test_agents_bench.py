"""`tandem bench agents`'s own logic: the tasks made from HumanEval problems (the visible half of the tests, the stub,
the hidden scoring), the gateway's settings per configuration, the CLIs' declared settings, the wire recorder's
record (a loopback upstream of a few lines: the CLIs themselves run in tests/integration/test_agent_clis.py), the
summary and the table. No model is loaded."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from app.config import embedded_default
from app.tools.bench import agent_runs, agents_bench, humaneval
from app.tools.bench.agent_runs import BRIEF_SCHEMA, BRIEF_STOP, DRIVERS, LEAN_PROMPT, AgentRun, run_agent
from app.tools.bench.agents_bench import (
    Task,
    choose_tasks,
    gateway_config,
    parse_setting,
    score,
    stub,
    summarize,
    table,
    to_toml,
    visible_test,
)
from app.tools.bench.sandbox import Limits
from app.tools.bench.wire_recorder import WireRecorder, shape_of
from deploy import agent_clis


@pytest.fixture(scope="module")
def problems() -> list[humaneval.Problem]:
    return humaneval.load()


def _candidate_asserts(source: str) -> int:
    check = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "check")
    return sum(1 for s in check.body if isinstance(s, ast.Assert) and "candidate" in ast.unparse(s))


def _run(folder: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (folder / name).write_text(text)
    return subprocess.run([sys.executable, "-E", "-s", agents_bench.TEST], cwd=folder, capture_output=True, timeout=60)


@pytest.mark.parametrize("number", [0, 12, 32, 38])  # 32 and 38: their tests call helpers the prompt defines
def test_a_task_is_its_stub_and_the_first_half_of_its_tests(problems, number, tmp_path):
    problem = problems[number]
    task = Task(problem)
    files = task.files()
    assert set(files) == {agents_bench.MODULE, agents_bench.TEST}
    assert files[agents_bench.MODULE].startswith(problem.prompt.rstrip())
    whole, seen = _candidate_asserts(problem.test), _candidate_asserts(visible_test(problem))
    # Asserts inside a loop (32, 38: no top-level ones) stay whole in both.
    assert seen == (max(1, (whole + 1) // 2) if whole else 0) and (seen < whole or whole < 2)
    assert problem.entry_point in task.instruction and agents_bench.TEST_COMMAND in task.instruction
    # The visible test fails on the stub and passes on the canonical solution, run as the agent would run it.
    failed = _run(tmp_path, files)
    assert failed.returncode != 0 and b"NotImplementedError" in failed.stderr, failed.stderr
    solved = {**files, agents_bench.MODULE: problem.prompt + problem.canonical_solution}
    result = _run(tmp_path, solved)
    assert result.returncode == 0 and b"all tests passed" in result.stdout, result.stderr


def test_the_hidden_tests_score_the_solution_left_not_the_visible_half(problems):
    problem = problems[12]
    assert score(problem, problem.prompt + problem.canonical_solution, Limits()) == (True, "passed")
    assert score(problem, stub(problem), Limits()) == (False, "NotImplementedError")
    # Passes what the agent sees (the first asserts) and fails the hidden rest: not solved.
    visible_only = problem.prompt + "    return None if not strings else strings[0]\n"
    assert score(problem, visible_only, Limits())[0] is False
    assert score(problem, "", Limits()) == (False, "no code (solution.py missing or does not parse)")


def test_the_tasks_are_a_fixed_sample_of_the_report_half():
    tasks = choose_tasks("report", 5, 0)
    assert [t.problem.task_id for t in tasks] == [t.problem.task_id for t in choose_tasks("report", 5, 0)]
    assert len(tasks) == 5 and all(t.problem.number not in humaneval.TUNE_HALF for t in tasks)


def test_each_configuration_is_the_embedded_default_with_its_policy_and_no_user_state():
    base = embedded_default().read_text()
    for name, policy in agents_bench.CONFIGURATIONS.items():
        tree = tomllib.loads(gateway_config(base, policy, ["device.n_ctx=8192", "gateway.stall_timeout=30"]))
        assert tree["gateway"]["policy"] == policy, name
        assert "state_file" not in tree["gateway"] and "port" not in tree["gateway"]
        assert all(c.get("kind") != "hat" for c in tree["clouds"].values())
        assert tree["clouds"]["cloud"]["embedded"]["port"] == 0
        assert tree["device"]["n_ctx"] == 8192 and tree["gateway"]["stall_timeout"] == 30
        original = tomllib.loads(base)
        assert tree["clouds"]["cloud"]["price"] == original["clouds"]["cloud"]["price"]
        assert tree["device"]["model"] == original["device"]["model"]


def test_the_config_it_writes_is_valid_settings(tmp_path):
    from app.config import load_settings

    path = tmp_path / "config.toml"
    path.write_text(gateway_config(embedded_default().read_text(), "quality", []))
    assert load_settings(path).gateway.policy == "quality"


def test_toml_round_trip_and_settings_syntax():
    tree = {"a": 1, "b": {"c": 'x"y', "d": [1.5, True], "e": {"f": False}}, "g": "h"}
    assert tomllib.loads(to_toml(tree)) == tree
    assert parse_setting("device.n_ctx=32768") == (["device", "n_ctx"], 32768)
    assert parse_setting("gateway.policy=quality") == (["gateway", "policy"], "quality")
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_setting("device.n_ctx")


def test_each_cli_is_pointed_at_the_base_url_in_its_own_way(tmp_path):
    run = AgentRun(tmp_path / "repo", tmp_path / "home", "http://127.0.0.1:9", "tandem", "do it", ("a.py",), "true")
    claude = DRIVERS["claude"]
    assert claude.environment(run)["ANTHROPIC_BASE_URL"] == run.base_url
    assert {claude.environment(run)[k] for k in claude.environment(run) if k.endswith("_MODEL")} == {"tandem"}
    DRIVERS["codex"].configure(run)
    codex = tomllib.loads((run.home / ".codex" / "config.toml").read_text())
    assert codex["model_providers"]["tandem"] == {
        "name": "Tandem",
        "base_url": "http://127.0.0.1:9/v1",
        "wire_api": "responses",
        "env_key": "TANDEM_API_KEY",
    }
    assert "TANDEM_API_KEY" in DRIVERS["codex"].environment(run)
    DRIVERS["opencode"].configure(run)
    opencode = json.loads((run.home / ".config" / "opencode" / "opencode.json").read_text())
    assert opencode["provider"]["tandem"]["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    assert opencode["model"] == "tandem/tandem"
    aider = DRIVERS["aider"].command(run)
    assert aider[aider.index("--openai-api-base") + 1] == "http://127.0.0.1:9/v1"
    assert aider[aider.index("--test-cmd") + 1] == "true" and aider[-1] == "a.py"
    assert not (run.workdir / "opencode.json").exists()  # settings go to the scratch HOME, never the task's repo


def test_lean_and_brief_runs_keep_each_clis_fields_and_bound_its_answers_through_its_own_settings(tmp_path):
    """`lean` cuts the prompt and tools through each CLI's settings; `brief` makes the answers of the CLIs that fail a
    cut turn end early: Claude Code's stop_sequences (its documented CLAUDE_CODE_EXTRA_BODY), Codex's --output-schema
    (a one-field JSON answer). As shipped, neither is set."""
    plain = AgentRun(tmp_path / "repo", tmp_path / "home", "http://127.0.0.1:9", "tandem", "do it")
    run = replace(plain, lean=True, brief=True)
    claude = DRIVERS["claude"]
    assert json.loads(claude.environment(run)["CLAUDE_CODE_EXTRA_BODY"]) == {"stop_sequences": BRIEF_STOP}
    assert "CLAUDE_CODE_EXTRA_BODY" not in claude.environment(plain) and "--system-prompt" not in claude.command(plain)
    command = claude.command(run)
    assert command[command.index("--system-prompt") + 1] == LEAN_PROMPT and command[command.index("--tools") + 1]
    codex = DRIVERS["codex"]
    codex.configure(run)
    command = codex.command(run)
    schema = Path(command[command.index("--output-schema") + 1])
    assert json.loads(schema.read_text()) == BRIEF_SCHEMA and schema.is_relative_to(run.home)
    assert command[-1] == "do it"  # the task stays the last argument
    settings = tomllib.loads((run.home / ".codex" / "config.toml").read_text())
    assert settings["features"] == {"goals": False} and settings["model_instructions_file"].endswith(".md")
    codex.configure(plain)
    assert "--output-schema" not in codex.command(plain)
    assert "features" not in tomllib.loads((plain.home / ".codex" / "config.toml").read_text())
    DRIVERS["opencode"].configure(run)
    opencode = json.loads((run.home / ".config" / "opencode" / "opencode.json").read_text())
    assert opencode["permission"]["bash"] == opencode["permission"]["read"] == "deny"
    assert opencode["permission"]["edit"] == "allow" and opencode["agent"]["build"]["prompt"] == LEAN_PROMPT


def test_a_cli_runs_in_its_tasks_folder_as_its_shell_would_say(tmp_path, monkeypatch):
    """opencode takes $PWD for its working directory: a run's PWD is the task's folder, not the bench's."""
    monkeypatch.setattr(agent_runs.agent_clis, "missing_message", lambda: "")
    monkeypatch.setattr(agent_runs.agent_clis, "seed_home", lambda home: None)
    monkeypatch.setitem(DRIVERS, "aider", _PrintWorkingFolder("aider", "test", "/"))
    run = AgentRun(tmp_path / "repo", tmp_path / "home", "http://127.0.0.1:9", "tandem", "do it")
    result = run_agent("aider", run, 30)
    assert result.ok and result.stdout.split() == [str(run.workdir)] * 2, result.tail()


class _PrintWorkingFolder(agent_runs.AgentDriver):
    def command(self, run: AgentRun) -> list[str]:
        return [sys.executable, "-c", "import os; print(os.environ['PWD'], os.getcwd())"]


def test_the_run_environment_is_the_scratch_home_without_the_users_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-user")
    monkeypatch.setenv("OPENAI_BASE_URL", "https://example.invalid")
    env = agent_clis.run_env(tmp_path)
    for name in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "CODEX_HOME",
                 "CLAUDE_CONFIG_DIR", "TMPDIR"):  # fmt: skip
        assert Path(env[name]).is_relative_to(tmp_path) and Path(env[name]).is_dir(), name
    assert "ANTHROPIC_API_KEY" not in env and "OPENAI_BASE_URL" not in env
    assert env["DISABLE_TELEMETRY"] == "1" and env["OPENCODE_DISABLE_AUTOUPDATE"] == "1"


def test_missing_clis_name_the_command_that_installs_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_AGENTS_DIR", str(tmp_path / "empty"))
    message = agent_clis.missing_message()
    assert agent_clis.INSTALL_COMMAND in message
    for agent in agent_clis.AGENTS.values():
        assert f"{agent.package} {agent.version}" in message
    assert agent_clis.main(["check"]) == 1
    assert agent_clis.executable("claude").is_relative_to(tmp_path / "empty")


def test_a_request_shape_names_fields_and_tool_kinds_never_texts():
    body = {
        "model": "tandem",
        "max_tokens": 32000,
        "stream": True,
        "thinking": {"type": "adaptive"},
        "system": [{"type": "text", "text": "SECRET SYSTEM PROMPT"}],
        "messages": [{"role": "user", "content": "SECRET QUESTION"}],
        "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}, {"name": "g", "input_schema": {}}],
    }
    shape = shape_of(json.dumps(body).encode(), {"anthropic-beta": "a,b"})
    assert shape["extra_fields"] == ["thinking"] and shape["max_tokens"] == 32000
    assert shape["tools"] == 3 and shape["tool_kinds"] == ["(none)", "function", "web_search"]
    assert shape["anthropic_beta"] == ["a", "b"] and shape["roles"] == ["user"]
    assert "SECRET" not in json.dumps(shape)


class _Upstream(BaseHTTPRequestHandler):
    """A few lines of gateway: a streamed answer, a refusal, and an answer that never comes (to see the CLI leave)."""

    protocol_version = "HTTP/1.1"
    closed = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/refused":
            body = b'{"error": {"message": "Invalid value for \'thinking\'"}}'
            self.send_response(400)
            self.send_header("content-length", str(len(body)))
            self.send_header("x-request-id", "req-refused")
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/v1/slow":
            while self.connection.recv(1):  # returns b"" when the proxy closes its connection
                pass
            _Upstream.closed.set()
        else:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("x-request-id", "req-1")
            self.send_header("x-tandem-max-tokens-clamped", "32000->48")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for piece in (b"data: {}\n\n", b"data: [DONE]\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_recorder_forwards_the_wire_and_records_each_exchange(upstream, tmp_path):
    with WireRecorder(upstream) as wire:
        wire.transcripts = tmp_path
        ok = httpx.post(wire.url + "/v1/messages?beta=true", json={"model": "m", "tools": []})
        refused = httpx.post(wire.url + "/v1/refused", json={})
    assert ok.status_code == 200 and ok.text == "data: {}\n\ndata: [DONE]\n\n"
    assert ok.headers["x-request-id"] == "req-1"
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("Invalid value")
    first, second = wire.exchanges
    assert first.generation and first.answered and first.request_id == "req-1" and first.first_byte_s is not None
    assert first.route == "/v1/messages" and first.shape["tools"] == 0
    assert first.tandem_headers == {"x-tandem-max-tokens-clamped": "32000->48"} and not second.tandem_headers
    assert second.refused and not second.answered and second.message == "Invalid value for 'thinking'"
    assert sorted(p.name for p in tmp_path.iterdir())[:2] == ["001-request-v1-messages.json", "001-response.txt"]


def test_a_cli_that_leaves_closes_its_request_to_the_gateway(upstream):
    """A CLI stopped at its time cap while the gateway still works on its answer: the gateway's connection is closed
    too (as the CLI's own would be), so the answer stops there instead of holding the gateway for the next task."""
    _Upstream.closed.clear()
    with WireRecorder(upstream) as wire:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(wire.url + "/v1/slow", json={}, timeout=0.5)
        assert _Upstream.closed.wait(5)
        deadline = time.monotonic() + 5
        while wire.exchanges[0].seconds is None and time.monotonic() < deadline:
            time.sleep(0.05)
    [exchange] = wire.exchanges
    assert exchange.status is None and not exchange.answered and not exchange.refused
    assert exchange.message == "the client closed the connection"


def _record(solved: bool, turns: list[tuple[float, dict]], cloud: float = 0.0, refused: int = 0) -> dict:
    return {
        "solved": solved,
        "seconds": 10.0,
        "cloud_usd": cloud,
        "exit_code": 0,
        "timed_out": False,
        "refused": [{}] * refused,
        "unanswered": [],
        "turns": [{"ttft_s": ttft, "endpoints": endpoints} for ttft, endpoints in turns],
    }


def test_a_row_sums_tasks_tokens_per_endpoint_and_splits_first_turn_ttft():
    device = {"device": {"prompt": 1000, "cached": 0, "answer": 10}}
    cloud = {"cloud": {"prompt": 2000, "cached": 1500, "answer": 20}}
    records = [_record(True, [(4.0, device), (1.0, cloud)], 0.002), _record(False, [(6.0, device)], refused=1)]
    row = summarize("claude", "disco", records)
    assert row["solved"] == 1 and row["tasks"] == 2 and row["turns"] == 3 and row["refused"] == 1
    assert row["ttft_cold_s"] == 4.0 and row["ttft_first_s"] == 5.0 and row["ttft_later_s"] == 1.0
    assert row["tokens"] == {"device": {"prompt": 2000, "cached": 0, "answer": 20}, **cloud}
    [head, rule, line] = table([row])
    assert head.count("|") == rule.count("|") == line.count("|")
    assert "| claude | disco | 1/2 | 1.5 | 10 | 4.0 / 5.0 | 1.0 |" in line and "0.00200" in line
