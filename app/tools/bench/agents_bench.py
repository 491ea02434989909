"""`tandem bench agents`: real coding-agent CLIs (Claude Code, Codex CLI, opencode, aider), unchanged, at the versions
deploy/agent_clis.py pins, driven headless against a gateway the bench starts, on small repositories made from
HumanEval problems.

A task is one problem as a repository: `solution.py` (the problem's stub: its signature and docstring, and any
helpers it comes with) and `test_solution.py`, a visible test the agent may run (the first half of the problem's own
asserts); the agent is told to make the tests pass. It is scored by the problem's whole test (hidden: the agent
never sees the second half) run against the `solution.py` it left, in the sandbox (app/tools/bench/sandbox.py). The
problems are bench quality's (app/tools/bench/humaneval.py) with its held-out split, fixed in code: `--half report`
(the default) reports on the half no threshold was tuned on.

The gateway: the embedded default (deploy/embedded.toml; `--config` for another) without its HAT cloud, its embedded
cloud on a free port, the budget state in a scratch folder; one gateway per configuration (`--configs`), each the
config's `gateway.policy` set to: device-only, cloud-only (`server-only`), disco, quality. `--set KEY=VALUE` changes
any setting (e.g. `--set device.n_ctx=32768`); `--gateway URL` runs against a gateway already serving instead (one
configuration, "as-served"). Between the CLI and the gateway sits a recording proxy (wire_recorder.py) that forwards
every byte unchanged and records each request: its shape, status, the gateway's request id (its trace).

Per CLI x configuration: tasks solved; turns (the requests for an answer the CLI sent); wall time; TTFT of the first
turn and of later turns (the gateway's own, from each request's trace); prompt, cached and answer tokens per endpoint
(the traces); the cloud bill (GET /v1/budget before and after each task); requests refused (4xx/5xx or an error
inside a stream: must be 0); the CLI's exits (non-zero, time cap). Each task's transcript (every request and answer
on the wire, the CLI's own output, the solution it left, its score) is kept under --out/transcripts/.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import statistics
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from app.tools import import_extra
from app.tools.bench import humaneval
from app.tools.bench.agent_runs import DRIVERS, AgentRun, run_agent
from app.tools.bench.humaneval import Problem
from app.tools.bench.output import cpu_name, publish, write_json
from app.tools.bench.sandbox import Limits, network_isolation
from app.tools.bench.sandbox import run as run_sandboxed
from app.tools.bench.wire_recorder import Exchange, WireRecorder

# The configurations: each a gateway whose `gateway.policy` is the value.
CONFIGURATIONS = {"device-only": "device-only", "cloud-only": "server-only", "disco": "disco", "quality": "quality"}
AS_SERVED = "as-served"  # --gateway URL: whatever that gateway's policy is
MODULE, TEST = "solution.py", "test_solution.py"
TEST_COMMAND = f"python3 {TEST}"
INSTRUCTION = (
    f"The tests in {TEST} fail. Make them pass by implementing `{{entry}}` in {MODULE}. Run them with `{TEST_COMMAND}`."
)
DEFAULT_SAMPLE = 5
TIME_CAP = 900.0  # seconds a CLI gets for one task


# -- tasks ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    problem: Problem

    @property
    def name(self) -> str:
        return self.problem.task_id.replace("/", "-")

    @property
    def instruction(self) -> str:
        return INSTRUCTION.format(entry=self.problem.entry_point)

    def files(self) -> dict[str, str]:
        return {MODULE: stub(self.problem), TEST: visible_test(self.problem)}


def stub(problem: Problem) -> str:
    """The problem's prompt (imports, helpers, the signature and docstring) with a body that says it is missing."""
    return problem.prompt.rstrip() + "\n    raise NotImplementedError\n"


def _calls_candidate(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(node))


def visible_test(problem: Problem) -> str:
    """The test the agent sees: the problem's `check` with the first half (at least one) of its asserts on the
    candidate, the rest dropped (the hidden half); runnable as a script and by pytest."""
    tree = ast.parse(problem.test)
    check = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    real = [s for s in check.body if isinstance(s, ast.Assert) and _calls_candidate(s)]
    kept = {id(s) for s in real[: max(1, (len(real) + 1) // 2)]}
    check.body = [s for s in check.body if not (isinstance(s, ast.Assert) and _calls_candidate(s)) or id(s) in kept]
    entry = problem.entry_point
    return (
        f"from solution import *  # noqa: F403 (the helpers the tests call)\nfrom solution import {entry}\n\n"
        f"{ast.unparse(tree)}\n\n\ndef test_{entry}():\n    check({entry})\n\n\n"
        f'if __name__ == "__main__":\n    test_{entry}()\n    print("all tests passed")\n'
    )


def score(problem: Problem, source: str, limits: Limits) -> tuple[bool, str]:
    """The problem's whole test against the solution the agent left (its definitions only), in the sandbox."""
    code = humaneval.extract_code(source)
    if not code:
        return False, "no code (solution.py missing or does not parse)"
    outcome = run_sandboxed(humaneval.program(problem, code), limits)
    return outcome.passed, outcome.verdict


def choose_tasks(half: str, sample: int | None, seed: int) -> list[Task]:
    return [Task(p) for p in humaneval.sample(humaneval.half(humaneval.load(), half), sample, seed)]


# -- the gateway ------------------------------------------------------------------------------------------------


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(tree: dict, prefix: str = "") -> str:
    """A settings tree as TOML: each table's values, then its sub-tables as [a.b] headers."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in tree.items() if not isinstance(v, dict)]
    out = [f"[{prefix}]", *lines] if prefix and lines else lines
    for key, value in tree.items():
        if isinstance(value, dict):
            sub = to_toml(value, f"{prefix}.{key}" if prefix else key)
            if sub:
                out += ["", sub]
    return "\n".join(out)


def parse_setting(text: str) -> tuple[list[str], object]:
    """`a.b.c=VALUE`: the path and the value (a TOML value when it reads as one, else the text)."""
    key, sep, raw = text.partition("=")
    if not (key.strip() and sep):
        raise SystemExit(f"error: --set {text!r}: write KEY=VALUE, e.g. device.n_ctx=32768")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().split("."), value


def gateway_config(base: str, policy: str, settings: list[str]) -> str:
    """The base config (TOML text) for one configuration: its policy, no HAT cloud (the bench routes between the
    device and the cloud; a HAT worker would only share the cores), every embedded server on a free port, no state
    file of the user's (the launcher puts it in the gateway's scratch folder), then the --set changes."""
    tree = tomllib.loads(base)
    gateway = tree.setdefault("gateway", {})
    gateway["policy"] = policy
    gateway.pop("state_file", None)
    gateway.pop("port", None)
    clouds = tree.get("clouds", {})
    for name in [n for n, c in clouds.items() if c.get("kind") == "hat"]:
        del clouds[name]
    for cloud in clouds.values():
        if isinstance(cloud.get("embedded"), dict):
            cloud["embedded"]["port"] = 0
    for setting in settings:
        path, value = parse_setting(setting)
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return to_toml(tree) + "\n"


class Gateway:
    """The gateway a configuration runs on: started here (and stopped), or one already serving (--gateway)."""

    def __init__(self, model: str, config: str | None = None, url: str | None = None):
        self.process = None
        self.model = model  # the name the CLIs ask for (the gateway's routed model)
        if url is None:
            from app.launcher import start_gateway

            print("starting the gateway...", file=sys.stderr, flush=True)
            self.process = start_gateway(config or "")
            url = self.process.url
        self.url = url.rstrip("/")
        import httpx

        self.http = httpx.Client(timeout=60, trust_env=False)

    def cloud_spend(self) -> float:
        spend = self.http.get(self.url + "/v1/budget").json()["spend"]["endpoints"]
        return sum(v.get("cost_usd", 0.0) for role, v in spend.items() if role != "device")

    def trace(self, request_id: str) -> dict | None:
        r = self.http.get(f"{self.url}/v1/requests/{request_id}")
        return r.json() if r.status_code == 200 else None

    def log_tail(self, chars: int = 3000) -> str:
        return self.process.log()[-chars:] if self.process is not None else ""

    def close(self) -> None:
        self.http.close()
        if self.process is not None:
            from app.launcher import stop_gateway

            stop_gateway(self.process)


# -- one task ---------------------------------------------------------------------------------------------------


def run_task(
    agent: str,
    task: Task,
    gateway: Gateway,
    wire: WireRecorder,
    folder: Path,
    time_cap: float,
    limits: Limits,
    lean: bool = False,
) -> dict:
    """One CLI on one task: its repository in a scratch folder, the run, the hidden tests; the record and the
    transcript (folder: the wire, the CLI's output, the solution it left)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-agent-task-") as scratch:
        repo, home = Path(scratch) / "repo", Path(scratch) / "home"
        repo.mkdir()
        for name, text in task.files().items():
            (repo / name).write_text(text)
        mark = len(wire.exchanges)
        wire.transcripts = folder / "wire"
        before = gateway.cloud_spend()
        files = (MODULE, TEST)
        run = AgentRun(repo, home, wire.url, gateway.model, task.instruction, files, TEST_COMMAND, folder, lean)
        result = run_agent(agent, run, time_cap)
        wire.settle(mark)
        after = gateway.cloud_spend()
        wire.transcripts = None
        exchanges = wire.since(mark)
        solution = (repo / MODULE).read_text() if (repo / MODULE).is_file() else ""
    (folder / "stdout.txt").write_text(result.stdout)
    (folder / "stderr.txt").write_text(result.stderr)
    (folder / MODULE).write_text(solution)
    passed, verdict = score(task.problem, solution, limits)
    turns = [_turn(e, gateway) for e in exchanges if e.generation]
    record = {
        "agent": agent,
        "task_id": task.problem.task_id,
        "solved": passed,
        "verdict": verdict,
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "seconds": round(result.seconds, 3),
        "cloud_usd": after - before,
        "turns": turns,
        "other_requests": [_brief(e) for e in exchanges if not e.generation],
        "refused": [_brief(e) for e in exchanges if e.refused],
        "unanswered": [_brief(e) for e in exchanges if not e.refused and not e.answered],  # cut off (time cap)
    }
    (folder / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _brief(e: Exchange) -> dict:
    return {"method": e.method, "path": e.path, "status": e.status, "message": e.message,
            "stream_error": e.stream_error, "shape": e.shape, "request_bytes": e.request_bytes}  # fmt: skip


def _turn(e: Exchange, gateway: Gateway) -> dict:
    """One request for an answer: what it asked, how it was answered, and what each endpoint did (its trace)."""
    trace = gateway.trace(e.request_id) if e.request_id and not e.refused else None
    endpoints: dict[str, dict[str, int]] = {}
    for a in (trace or {}).get("endpoints", []):
        tally = endpoints.setdefault(a["endpoint"], {"prompt": 0, "cached": 0, "answer": 0})
        billed = a.get("billed", {})
        tally["prompt"] += billed.get("prompt_tokens", 0)
        tally["cached"] += billed.get("cached_tokens", 0)
        tally["answer"] += billed.get("completion_tokens", 0)
    trace = trace or {}
    return {
        **_brief(e),
        "route": e.route,
        "request_id": e.request_id,
        "tandem_headers": e.tandem_headers,
        "first_byte_s": e.first_byte_s,
        "seconds": e.seconds,
        "ttft_s": None if trace.get("ttft_ms") is None else trace["ttft_ms"] / 1e3,
        "plan": trace.get("plan"),
        "migrations": len(trace.get("migrations") or []),
        "prompt_tokens": trace.get("prompt_tokens"),
        "answer_tokens": trace.get("completion_tokens"),
        "finish_reason": trace.get("finish_reason"),
        "max_tokens_clamped": trace.get("max_tokens_clamped"),
        "ignored_fields": trace.get("ignored_fields"),
        "endpoints": endpoints,
    }


# -- summaries and the report -----------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(agent: str, config: str, records: list[dict]) -> dict:
    """One row: a CLI under one configuration, over its tasks."""
    first = [r["turns"][0]["ttft_s"] for r in records if r["turns"] and r["turns"][0]["ttft_s"] is not None]
    later = [t["ttft_s"] for r in records for t in r["turns"][1:] if t["ttft_s"] is not None]
    tokens: dict[str, dict[str, int]] = {}
    for r in records:
        for t in r["turns"]:
            for role, tally in t["endpoints"].items():
                into = tokens.setdefault(role, {"prompt": 0, "cached": 0, "answer": 0})
                for k, v in tally.items():
                    into[k] += v
    n = len(records)
    return {
        "agent": agent,
        "config": config,
        "tasks": n,
        "solved": sum(r["solved"] for r in records),
        "turns": sum(len(r["turns"]) for r in records),
        "seconds": sum(r["seconds"] for r in records),
        # The first task's first turn: the only one that meets an empty prompt cache (a later task's first turn
        # shares the CLI's system prompt and tools with it).
        "ttft_cold_s": records[0]["turns"][0]["ttft_s"] if records and records[0]["turns"] else None,
        "ttft_first_s": _median(first),
        "ttft_later_s": _median(later),
        "tokens": tokens,
        "cloud_usd": sum(r["cloud_usd"] for r in records),
        "refused": sum(len(r["refused"]) for r in records),
        "unanswered": sum(len(r.get("unanswered", ())) for r in records),
        "nonzero_exits": sum(1 for r in records if r["exit_code"] != 0),
        "timed_out": sum(1 for r in records if r["timed_out"]),
    }


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _tokens(tally: dict[str, int] | None) -> str:
    if not tally:
        return "–"
    return f"{tally['prompt'] / 1e3:.1f}k ({tally['cached'] / 1e3:.1f}k cached) / {tally['answer']}"


def table(summaries: list[dict]) -> list[str]:
    head = (
        "| CLI | configuration | solved | turns | wall s / task | TTFT first turn s: cold / median "
        "| TTFT later turns s "
        "| device: prompt (cached) / answer tokens | cloud: prompt (cached) / answer tokens | cloud bill $ "
        "| refused (cut off) | exit != 0 (time cap) |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        n = max(s["tasks"], 1)
        clouds = {k: v for k, v in s["tokens"].items() if k != "device"}
        cloud = None
        if clouds:
            cloud = {k: sum(t[k] for t in clouds.values()) for k in ("prompt", "cached", "answer")}
        rows.append(
            f"| {s['agent']} | {s['config']} | {s['solved']}/{s['tasks']} | {s['turns'] / n:.1f} "
            f"| {s['seconds'] / n:.0f} | {_s(s.get('ttft_cold_s'))} / {_s(s['ttft_first_s'])} "
            f"| {_s(s['ttft_later_s'])} "
            f"| {_tokens(s['tokens'].get('device'))} | {_tokens(cloud)} | {s['cloud_usd']:.5f} "
            f"| {s['refused']} ({s['unanswered']}) "
            f"| {s['nonzero_exits']} ({s['timed_out']}) |"
        )
    return rows


def plot(summaries: list[dict], path: Path) -> None:
    """Tasks solved against the cloud bill, a marker per CLI, a colour per configuration."""
    matplotlib = import_extra("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(DRIVERS, "osD^", strict=True))
    configs = sorted({s["config"] for s in summaries})
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        colour = f"C{configs.index(s['config'])}"
        ax.scatter(s["cloud_usd"] / max(s["tasks"], 1), s["solved"] / max(s["tasks"], 1), color=colour,
                   marker=markers.get(s["agent"], "x"), label=f"{s['agent']} · {s['config']}")  # fmt: skip
    ax.set_xlabel("cloud bill per task (USD)")
    ax.set_ylabel("tasks solved (share)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the run ----------------------------------------------------------------------------------------------------


def _names(text: str, known, what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"error: --{what}: {unknown or text!r}: choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench agents", description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default=",".join(DRIVERS), help=f"comma-separated, of {', '.join(DRIVERS)}")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help=f"of {', '.join(CONFIGURATIONS)}")
    parser.add_argument("--half", choices=humaneval.HALVES, default="report", help="the held-out split's half")
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, help="a fixed, seeded sample of N problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-cap", type=float, default=TIME_CAP, help="seconds a CLI gets for one task")
    parser.add_argument("--config", default=None, help="the gateway's base settings (default: the embedded default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a setting")
    parser.add_argument("--gateway", default=None, help="a gateway already serving (its URL): one configuration")
    parser.add_argument("--model", default=None, help="the model the CLIs ask for (default: gateway.model_name)")
    parser.add_argument("--quick", action="store_true", help="one task, the first CLI, the first configuration")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="each CLI's system prompt and tools cut down through its own settings (agent_runs.py: not as shipped)",
    )
    parser.add_argument("--out", default="var/bench/agents", help="folder for the table, JSON, plot, transcripts")
    args = parser.parse_args(argv)

    agents = _names(args.agents, DRIVERS, "agents")
    configs = [AS_SERVED] if args.gateway else _names(args.configs, CONFIGURATIONS, "configs")
    sample = 1 if args.quick else args.sample
    if args.quick:
        agents, configs = agents[:1], configs[:1]
    tasks = choose_tasks(args.half, sample, args.seed)
    from app.config import embedded_default

    base = Path(args.config or embedded_default()).read_text()
    model = args.model or tomllib.loads(base).get("gateway", {}).get("model_name", "tandem")
    out = Path(args.out)
    limits = Limits()
    records: dict[tuple[str, str], list[dict]] = {}
    started = time.perf_counter()
    # The device's prompt cache on disk in a folder of this run's: a run starts cold, not on what an earlier run (or
    # the user's own gateway) left in ~/.cache/tandem/kv; within a configuration it works as served.
    kv = tempfile.TemporaryDirectory(prefix="tandem-bench-agents-kv-")
    own_kv = not any(s.split("=", 1)[0].strip() == "device.prompt_cache_dir" for s in args.set)
    settings = [f"device.prompt_cache_dir={json.dumps(kv.name)}"] * own_kv + args.set
    for config in configs:
        gateway = (
            Gateway(model, url=args.gateway)
            if args.gateway
            else Gateway(model, gateway_config(base, CONFIGURATIONS[config], settings))
        )
        try:
            with WireRecorder(gateway.url) as wire:
                for agent in agents:
                    rows = records.setdefault((agent, config), [])
                    for i, task in enumerate(tasks):
                        folder = out / "transcripts" / config / agent / task.name
                        record = run_task(agent, task, gateway, wire, folder, args.time_cap, limits, args.lean)
                        rows.append(record)
                        print(
                            f"[{config} {agent} {i + 1}/{len(tasks)}] {task.problem.task_id}: "
                            f"{'solved' if record['solved'] else record['verdict']}, {len(record['turns'])} turns, "
                            f"{record['seconds']:.0f} s, exit {record['exit_code']}, {len(record['refused'])} refused",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            if gateway.process is not None:
                (out / f"gateway-{config}.log").parent.mkdir(parents=True, exist_ok=True)
                (out / f"gateway-{config}.log").write_text(gateway.process.log())
            gateway.close()
    kv.cleanup()
    summaries = [summarize(agent, config, rows) for (agent, config), rows in records.items()]
    header = (
        f"tandem bench agents {shlex.join(argv if argv is not None else sys.argv[1:])}  ({time.strftime('%Y-%m-%d')}; "
        f"{cpu_name()}; gateway: {args.gateway or args.config or 'the embedded default'}"
        f"{' with ' + ', '.join(args.set) if args.set else ''}; {len(tasks)} HumanEval problems, half {args.half}; "
        f"{'lean CLI prompts (--lean); ' if args.lean else ''}"
        f"sandbox network isolation: {network_isolation()})"
    )
    report = [header, "", *table(summaries), "", f"(this run: {time.perf_counter() - started:.0f} s)"]
    publish("\n".join(report), out / "agents.md")
    write_json({"summaries": summaries, "records": {f"{a}/{c}": r for (a, c), r in records.items()}},
               out / "agents.json")  # fmt: skip
    if len(summaries) > 1:
        plot(summaries, out / "agents.png")
    refused = sum(s["refused"] for s in summaries)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
