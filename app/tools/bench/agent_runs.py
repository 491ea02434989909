"""One coding-agent CLI run, headless, against a gateway (`tandem bench agents`, tests/integration/test_agent_clis.py).

Each CLI is the pinned, unchanged binary deploy/agent_clis.py installed, pointed at the gateway's base URL the way
its own documentation says (an environment variable, a provider entry in its config file, a flag), in a folder of
its own (the task's repository), with a scratch HOME: every config, data, cache and state folder under it, the
user's own never read or written, telemetry and update checks off (deploy/agent_clis.py's run_env). A run has a time
cap; past it the CLI's whole process group is killed. What it printed is kept (its own transcript: Claude Code's
stream-json, Codex's and opencode's JSON events, aider's chat history).

Each CLI is one declared object (AgentDriver): the API it speaks, its command line, the files it reads its settings
from, the variables it takes; nothing here branches on a CLI's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from deploy import agent_clis

API_KEY = "tandem-bench"  # what each CLI sends as its key (the bench's gateway takes none; a CLI insists on one)


@dataclass(frozen=True)
class AgentRun:
    """What one run needs: where it works, its scratch HOME, the base URL (scheme, host, port: no /v1), the model
    name it asks for, the task, the files it is told about, the command that runs the visible tests."""

    workdir: Path
    home: Path
    base_url: str
    model: str
    task: str
    files: tuple[str, ...] = ()
    test_command: str | None = None
    transcript: Path | None = None  # where its own history goes (aider's), when the CLI writes one to a file
    # Its own long system prompt replaced by LEAN_PROMPT and its tools cut to a few, through its documented settings
    # (the suite's runs: the wire's fields and tool kinds are the same, the prompt a few thousand tokens, not 10-20k).
    lean: bool = False
    # Its answers made to end early, through its own documented settings, where the CLI fails a turn whose answer was
    # cut at a token limit (the suite's runs on a small model that need not stop on its own within the gateway's
    # max_answer_tokens): Claude Code (stop_reason max_tokens: it resumes 3 times, then exits 1) is given
    # stop_sequences (CLAUDE_CODE_EXTRA_BODY), Codex CLI (an `incomplete` response fails the turn) a one-field JSON
    # answer (--output-schema: `text.format`, which the gateway enforces with a grammar). opencode and aider take a
    # cut answer for the end of their turn. Every field each CLI sends is still sent.
    brief: bool = False


LEAN_PROMPT = "You are a coding agent. Use your tools to create and edit files in the current folder."
BRIEF_STOP = ["\n", " "]  # Claude Code's answers end at their first line break or blank (stop_reason stop_sequence)
BRIEF_SCHEMA = {  # Codex's final answer: {"done": true} or {"done": false}, nothing else
    "type": "object",
    "properties": {"done": {"type": "boolean"}},
    "required": ["done"],
    "additionalProperties": False,
}


@dataclass
class RunResult:
    agent: str
    exit_code: int | None  # None: killed at its time cap
    seconds: float
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def tail(self, chars: int = 1500) -> str:
        return f"exit {self.exit_code}{' (time cap)' if self.timed_out else ''}\nstdout: {self.stdout[-chars:]}\n" \
               f"stderr: {self.stderr[-chars:]}"  # fmt: skip


@dataclass(frozen=True)
class AgentDriver:
    """How one CLI is run headless against a base URL."""

    name: str
    api: str  # the route it speaks
    speaks: str  # the gateway route its turns go to

    def command(self, run: AgentRun) -> list[str]:
        raise NotImplementedError

    def environment(self, run: AgentRun) -> dict[str, str]:
        return {}

    def configure(self, run: AgentRun) -> None:
        """Write the CLI's settings files (under the scratch HOME, never into the task's repository)."""


@dataclass(frozen=True)
class ClaudeCode(AgentDriver):
    # Print mode; the tools a coding task needs allowed up front (there is nobody to ask), the rest refused.
    tools: str = "Bash,Read,Write,Edit,Glob,Grep"

    def command(self, run: AgentRun) -> list[str]:
        # Lean: the Write tool alone (with the deferred-tool placeholder Claude Code always sends).
        lean = ["--system-prompt", LEAN_PROMPT, "--tools", "Write"] if run.lean else []
        return [str(agent_clis.executable(self.name)), "-p", run.task, "--model", run.model, "--output-format",
                "stream-json", "--verbose", "--allowedTools", self.tools, *lean]  # fmt: skip

    def environment(self, run: AgentRun) -> dict[str, str]:
        # Its background model (titles, summaries) and its sub-agents' names: the same model, so every request it
        # sends names one the gateway serves.
        names = ("ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                 "ANTHROPIC_SMALL_FAST_MODEL")  # fmt: skip
        same = dict.fromkeys(names, run.model)
        brief = {"CLAUDE_CODE_EXTRA_BODY": json.dumps({"stop_sequences": BRIEF_STOP})} if run.brief else {}
        return {"ANTHROPIC_BASE_URL": run.base_url, "ANTHROPIC_API_KEY": API_KEY, **same, **brief}


@dataclass(frozen=True)
class CodexCli(AgentDriver):
    def configure(self, run: AgentRun) -> None:
        codex_home = run.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        lean = features = ""
        if run.lean:  # its instructions one line, its goal tools off (the namespace and web_search stay)
            (codex_home / "instructions.md").write_text(LEAN_PROMPT + "\n")
            lean = f'model_instructions_file = "{codex_home / "instructions.md"}"\n'
            features = "[features]\ngoals = false\n\n"
        if run.brief:
            (codex_home / "brief-schema.json").write_text(json.dumps(BRIEF_SCHEMA))
        (codex_home / "config.toml").write_text(
            f'model = "{run.model}"\nmodel_provider = "tandem"\ncheck_for_update_on_startup = false\n{lean}\n'
            f'{features}[model_providers.tandem]\nname = "Tandem"\nbase_url = "{run.base_url}/v1"\n'
            f'wire_api = "responses"\nenv_key = "TANDEM_API_KEY"\n'
        )

    def command(self, run: AgentRun) -> list[str]:
        # Its own sandbox cannot start as root in a container: the task's folder is the bench's scratch already.
        brief = ["--output-schema", str(run.home / ".codex" / "brief-schema.json")] if run.brief else []
        return [str(agent_clis.executable(self.name)), "exec", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "--json", "-C", str(run.workdir), *brief,
                run.task]  # fmt: skip

    def environment(self, run: AgentRun) -> dict[str, str]:
        return {"TANDEM_API_KEY": API_KEY}


@dataclass(frozen=True)
class OpenCode(AgentDriver):
    def configure(self, run: AgentRun) -> None:
        folder = run.home / ".config" / "opencode"
        folder.mkdir(parents=True, exist_ok=True)
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "tandem": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "Tandem",
                    "options": {"baseURL": f"{run.base_url}/v1", "apiKey": API_KEY},
                    "models": {run.model: {"name": run.model}},
                }
            },
            "model": f"tandem/{run.model}",
            "small_model": f"tandem/{run.model}",
            "autoupdate": False,
            "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        }
        if run.lean:  # its prompt one line; its tools write and edit (bash and read off through their permissions)
            config["agent"] = {"build": {"prompt": LEAN_PROMPT}}
            config["tools"] = dict.fromkeys(("bash", "glob", "grep", "webfetch", "todowrite", "task", "skill"), False)
            config["permission"] = {**config["permission"], "bash": "deny", "read": "deny"}
        (folder / "opencode.json").write_text(json.dumps(config, indent=1))

    def command(self, run: AgentRun) -> list[str]:
        return [str(agent_clis.executable(self.name)), "run", "--format", "json", run.task]


@dataclass(frozen=True)
class Aider(AgentDriver):
    def command(self, run: AgentRun) -> list[str]:
        history = run.transcript or run.home
        command = [
            str(agent_clis.executable(self.name)), "--model", f"openai/{run.model}", "--openai-api-base",
            f"{run.base_url}/v1", "--openai-api-key", API_KEY, "--no-git", "--yes-always", "--no-show-model-warnings",
            "--no-check-update", "--analytics-disable", "--no-pretty", "--no-fancy-input", "--no-show-release-notes",
            "--no-detect-urls", "--map-tokens", "0",
            "--chat-history-file", str(history / "aider.chat.history.md"),
            "--input-history-file", str(run.home / "aider.input.history"),
            "--llm-history-file", str(history / "aider.llm.history.txt"),
        ]  # fmt: skip
        if run.test_command:  # aider's own way to be told the tests: it runs them after its edits and reads why
            command += ["--test-cmd", run.test_command, "--auto-test"]
        return [*command, "--message", run.task, *run.files]


DRIVERS: dict[str, AgentDriver] = {
    d.name: d
    for d in (
        ClaudeCode("claude", "Anthropic Messages", "/v1/messages"),
        CodexCli("codex", "Responses", "/v1/responses"),
        OpenCode("opencode", "Chat Completions (tools)", "/v1/chat/completions"),
        Aider("aider", "Chat Completions (edits as text)", "/v1/chat/completions"),
    )
}
assert set(DRIVERS) == set(agent_clis.AGENTS), "one driver per installed CLI"


def run_agent(name: str, run: AgentRun, time_cap: float) -> RunResult:
    """Run the named CLI on `run` until it exits or `time_cap` seconds pass (then its process group is killed).
    RuntimeError with the install command when the CLIs are not installed."""
    missing = agent_clis.missing_message()
    if missing:
        raise RuntimeError(missing)
    driver = DRIVERS[name]
    run.workdir.mkdir(parents=True, exist_ok=True)
    env = agent_clis.run_env(run.home)
    agent_clis.seed_home(run.home)  # what they would fetch at their start, from the cache
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    # Its working folder as a shell would say it: opencode takes $PWD for its working directory, and with ours it
    # worked in the folder the bench was started from (the repository), not the task's.
    env["PWD"] = str(run.workdir)
    driver.configure(run)
    env.update(driver.environment(run))
    started = time.monotonic()
    process = subprocess.Popen(
        driver.command(run),
        cwd=run.workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: the time cap stops what it started (shells, test runs) too
    )
    timed_out = False
    try:
        stdout, stderr = process.communicate(timeout=time_cap)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):  # what it left running in its group (a shell's children)
            os.killpg(process.pid, signal.SIGKILL)
    return RunResult(
        name,
        None if timed_out else process.returncode,
        time.monotonic() - started,
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
        timed_out,
    )
