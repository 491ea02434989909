"""`tandem bench quality`: what the answers are worth. HumanEval's 164 problems answered through a real gateway.

A real `tandem serve` (the embedded default's device and cloud: Qwen2.5-Coder-0.5B on llama.cpp, the 1.5B behind a
loopback OpenAI-compatible server; no HAT) is asked with the `openai` SDK, greedy, `max_tokens` 512, EvalPlus's
instruct prompt with its response prefix, which the gateway continues as a prefill (app/tools/bench/humaneval.py).
Each answer's code runs against the problem's tests in a sandboxed process (app/tools/bench/sandbox.py).

Configurations (`--configs`):
- `device`, `cloud`: each endpoint alone (the request's model names the backend: no race, no migration);
- `disco:B`: DiSCo (`"policy": "disco"`) at budget b = B (set over PUT /v1/budget before its answers);
- `random:S`: a router that sends each request to the cloud with probability S, else to the device (seeded).
  Greedy answers do not depend on who chose the endpoint, so its answer to a problem is that endpoint's own row:
  it is read from the `device` and `cloud` rows, never asked again. `random:matched` adds one at each DiSCo or
  `policy:` row's measured cloud token share;
- `device>cloud@K`, `cloud>device@K`: the answer starts on one endpoint and is moved to the other after K answer
  tokens (`"tandem": {"migrate_after_tokens": K}`, migration reason `forced`): DiSCo's Appendix D (`--appendix-d`);
- `policy:NAME+KEY=VALUE...`: any policy with its per-request knobs (the request's `tandem` options), e.g. a
  quality-aware policy at several settings.

Per configuration: pass@1 with its Wilson 95 % interval; the paired difference against the cloud alone and the
device alone on the same problems (a paired bootstrap 95 % interval, McNemar's exact p); the cloud bill and the
unified cost (the device's energy at λ included) per answer, from the ledger (GET /v1/budget before and after each
answer); TTFT as the client saw it; tokens per endpoint; migrations and their reasons (the request's trace).

Answers are cached on disk by (configuration, problem, cut point) under a folder named by the set-up (models,
prompt, max_tokens, gateway config), so rescoring and re-plotting never ask the models again (`--offline` refuses
to). The held-out split is fixed in code (humaneval.TUNE_HALF); `--half report` reports on the half no threshold
was tuned on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from app.tools import import_extra, pyplot
from app.tools.bench import humaneval, quality_tune
from app.tools.bench.humaneval import Problem
from app.tools.bench.output import cpu_name, publish, write_json
from app.tools.bench.quality_stats import discordant, mcnemar_exact, paired_bootstrap, wilson
from app.tools.bench.sandbox import Limits, network_isolation
from app.tools.bench.sandbox import run as run_sandboxed
from deploy.models import resolve_model
from policies.quality import check_threshold

DEVICE_MODEL = "qwen2.5-coder-0.5b-instruct"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct"
MAX_TOKENS = 512
ADMIN_KEY = "quality-bench-admin"  # the bench's own gateway, on loopback: PUT /v1/budget sets DiSCo's b
DEFAULT_CONFIGS = "device,cloud,disco:0.25,disco:0.5,disco:0.75,random:matched"
APPENDIX_D_CUTS = (16, 32, 64, 128)
APPENDIX_D_SAMPLE = 40
ENDPOINTS = ("device", "cloud")


@dataclass(frozen=True)
class Config:
    """One way of answering: its name is its row and its folder in the cache."""

    name: str
    kind: str  # "endpoint" | "disco" | "random" | "forced" | "policy"
    endpoint: str | None = None  # endpoint: the one asked; forced: where the answer starts
    budget: float | None = None  # disco: b
    share: float | None = None  # random: the probability of the cloud
    cut: int = 0  # forced: the answer token after which it moves (0: none)
    options: tuple = ()  # policy: the request's `tandem` options, as (key, value) pairs

    @property
    def label(self) -> str:
        """Its row in the reports: the name, and the cut point where it has one."""
        return f"{self.name}@{self.cut}" if self.cut else self.name

    @property
    def asks(self) -> bool:
        """Whether its answers come from the gateway (a random router's come from the endpoints' rows)."""
        return self.kind != "random"


def parse_configs(text: str) -> list[Config]:
    configs = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        kind, _, value = token.partition(":")
        if token in ENDPOINTS:
            configs.append(Config(token, "endpoint", endpoint=token))
        elif kind == "disco" and value:
            budget = _unit(value, token)
            configs.append(Config(f"disco-b{budget:g}", "disco", budget=budget))
        elif kind == "random" and value == "matched":
            configs.append(Config("random-matched", "random"))
        elif kind == "random" and value:
            share = _unit(value, token)
            configs.append(Config(f"random-s{share:.2f}", "random", share=share))
        elif kind == "policy" and value:
            configs.append(Config(token, "policy", options=_policy_options(value, token)))
        elif ">" in token and "@" in token:
            route, _, cut = token.partition("@")
            source, _, target = route.partition(">")
            if {source, target} != set(ENDPOINTS) or not cut.isdigit() or int(cut) < 1:
                raise SystemExit(f"error: --configs: {token!r}: write device>cloud@K or cloud>device@K, K >= 1")
            configs.append(forced(source, int(cut)))
        else:
            raise SystemExit(
                f"error: --configs: unknown configuration {token!r} (device, cloud, disco:B, random:S, random:matched, "
                "device>cloud@K, cloud>device@K, policy:NAME[+KEY=VALUE...])"
            )
    return configs


def forced(source: str, cut: int) -> Config:
    target = "cloud" if source == "device" else "device"
    return Config(f"{source}>{target}", "forced", endpoint=source, cut=cut)


def _policy_options(value: str, token: str) -> tuple:
    """`NAME+KEY=VALUE+...`: the request's `tandem` options, the policy and its knobs (a VALUE that reads as JSON is
    that JSON, e.g. a number; otherwise the text), e.g. policy:quality+threshold=0.3 for a policy with a per-request
    knob."""
    name, *pairs = value.split("+")
    options = {"policy": name}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not (key and sep and raw):
            raise SystemExit(f"error: --configs: {token!r}: write policy:NAME+KEY=VALUE")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return tuple(options.items())


def _threshold(text: str) -> float:
    try:
        return check_threshold(float(text))
    except ValueError as exc:
        raise SystemExit(f"error: --tune-thresholds: {text!r}: {exc}") from None


def _unit(text: str, token: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise SystemExit(f"error: --configs: {token!r}: the value must be a number in [0, 1]")
    return value


# -- the gateway ------------------------------------------------------------------------------------------------


def gateway_config(device_model: str, cloud_model: str) -> str:
    """The embedded default's device and cloud (deploy/embedded.toml) without its HAT cloud, the bench's admin key,
    the embedded cloud on a free port, and a stall timeout for a busy shared CPU."""
    return f"""
[gateway]
policy = "disco"
cloud = "cloud"
fallback = true
default_max_tokens = {MAX_TOKENS}
admin_keys = ["{ADMIN_KEY}"]
stall_timeout = 30
[disco]
budget = 0.5
alpha = 0.05
exchange_rate = 0.3
consumption_rate = 4.8
side = "auto"
migration = true
[device]
kind = "llamacpp"
model = "{device_model}"
n_ctx = 4096
n_threads = 2
[clouds.cloud]
model = "{cloud_model}"
tokenizer = "device"
continuation = "completions"
read_timeout = 120
price = {{ prefill_per_million = 0.15, decode_per_million = 0.60 }}
[clouds.cloud.embedded]
model = "{cloud_model}"
port = 0
n_ctx = 4096
n_threads = 2
"""


class Gateway:
    """The bench's `tandem serve`, started at the first answer the cache does not hold (a run that finds every answer
    cached starts nothing), asked one answer at a time."""

    def __init__(self, config: str):
        self.config = config
        self.process = None
        self.budget: float | None = None

    def __call__(self, config: Config, problem: Problem) -> dict:
        if self.process is None:
            self._start()
        if config.kind == "disco" and config.budget != self.budget:
            self._put_budget({"budget": config.budget})
            self.budget = config.budget
        return self._answer(config, problem)

    def _start(self) -> None:
        from app.launcher import start_gateway

        print("starting the gateway (device and cloud models)...", file=sys.stderr, flush=True)
        self.process = start_gateway(self.config)
        openai = import_extra("openai")
        self.client = openai.OpenAI(base_url=self.process.v1, api_key="unused", max_retries=0, timeout=900)

    def close(self) -> None:
        if self.process is not None:
            from app.launcher import stop_gateway

            stop_gateway(self.process)
            self.process = None

    def _admin(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.request(method, self.process.v1 + path, json=body, headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def _put_budget(self, patch: dict) -> None:
        self._admin("PUT", "/budget", patch)

    def _spend(self) -> dict[str, float]:
        endpoints = self._admin("GET", "/budget")["spend"]["endpoints"]
        return {role: endpoints.get(role, {}).get("cost_usd", 0.0) for role in ENDPOINTS}

    def _answer(self, config: Config, problem: Problem) -> dict:
        model, options = "tandem", {}
        if config.kind == "endpoint":
            model = config.endpoint
        elif config.kind == "disco":
            options = {"policy": "disco"}
        elif config.kind == "forced":
            options = {"policy": config.endpoint, "migrate_after_tokens": config.cut}
        elif config.kind == "policy":
            options = dict(config.options)
        before = self._spend()
        started = time.perf_counter()
        raw = self.client.chat.completions.with_raw_response.create(
            model=model,
            messages=humaneval.messages(problem),
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stop=list(humaneval.STOP),
            extra_body={"tandem": options} if options else None,
        )
        request_id = raw.headers["x-request-id"]
        pieces, ttft, finish = [], None, None
        for chunk in raw.parse():
            if not chunk.choices:
                continue
            piece = chunk.choices[0].delta.content
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - started
                pieces.append(piece)
            finish = chunk.choices[0].finish_reason or finish
        seconds = time.perf_counter() - started
        after = self._spend()
        trace = self._admin("GET", f"/requests/{request_id}")
        return {
            "config": config.name,
            "task_id": problem.task_id,
            "cut": config.cut,
            "answer": "".join(pieces),
            "finish_reason": finish,
            "ttft_s": ttft,
            "seconds": seconds,
            "cost_usd": {role: after[role] - before[role] for role in ENDPOINTS},
            "request_id": request_id,
            "trace": trace,
        }


# -- the cache --------------------------------------------------------------------------------------------------


class AnswerCache:
    """Raw answers on disk, one JSON file per (configuration, problem, cut point), under a folder named by the
    set-up's fingerprint: answers from other models, prompts or token limits are never mixed in."""

    def __init__(self, root: Path, setup: dict):
        digest = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "setup.json").write_text(json.dumps(setup, indent=1, sort_keys=True) + "\n")

    def _path(self, config: Config, task_id: str) -> Path:
        folder = config.name.replace(">", "-to-").replace("/", "-")
        return self.dir / folder / f"{task_id.replace('/', '-')}@{config.cut}.json"

    def get(self, config: Config, task_id: str) -> dict | None:
        path = self._path(config, task_id)
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, config: Config, record: dict) -> None:
        path = self._path(config, record["task_id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(path)  # whole or absent: an interrupted run leaves no half-written answer


def setup_of(device_model: str, cloud_model: str) -> dict:
    return {
        "device_model": device_model,
        "cloud_model": cloud_model,
        "max_tokens": MAX_TOKENS,
        "instruction": humaneval.INSTRUCTION,
        "response_prefix": humaneval.RESPONSE_PREFIX,
        "stop": list(humaneval.STOP),
        "data_sha256": humaneval.DATA_SHA256,
        "gateway": gateway_config(device_model, cloud_model),
    }


def collect(
    config: Config, problems: list[Problem], cache: AnswerCache, ask: Callable[[Config, Problem], dict] | None
) -> list[dict]:
    """Each problem's answer under `config`: from the cache, else asked (and cached at once). `ask` None: offline, a
    missing answer is an error."""
    records = []
    for i, problem in enumerate(problems):
        record = cache.get(config, problem.task_id)
        if record is None:
            if ask is None:
                raise SystemExit(f"error: --offline: no cached answer for {config.label} on {problem.task_id}")
            record = ask(config, problem)
            cache.put(config, record)
            print(
                f"[{config.label} {i + 1}/{len(problems)}] {problem.task_id}: {record['seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        records.append(record)
    return records


# -- scoring ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    task_id: str
    passed: bool
    verdict: str
    cost_cloud: float
    cost_device: float
    ttft_s: float | None
    seconds: float
    decode: dict  # answer tokens per endpoint role
    prefill: dict  # prompt tokens computed per endpoint role
    migrations: list  # (at_token, from, to, reason) of each completed migration
    finish_reason: str | None
    routed_to: str | None = None  # a random router's choice


def score(record: dict, problem: Problem, limits: Limits) -> Scored:
    code = humaneval.extract_code(record["answer"])
    outcome = run_sandboxed(humaneval.program(problem, code), limits) if code else None
    trace = record["trace"]
    decode, prefill = Counter(), Counter()
    for e in trace["endpoints"]:
        decode[e["endpoint"]] += e["decode_tokens"]
        prefill[e["endpoint"]] += e["prefill_tokens"]
    migrations = [(m["at_token"], m["from"], m["to"], m["reason"]) for m in trace["migrations"] if "error" not in m]
    return Scored(
        task_id=record["task_id"],
        passed=bool(outcome and outcome.passed),
        verdict=outcome.verdict if outcome else "no code",
        cost_cloud=record["cost_usd"]["cloud"],
        cost_device=record["cost_usd"]["device"],
        ttft_s=record["ttft_s"],
        seconds=record["seconds"],
        decode=dict(decode),
        prefill=dict(prefill),
        migrations=migrations,
        finish_reason=record["finish_reason"],
    )


def random_router(share: float, device: list[Scored], cloud: list[Scored], seed: int) -> list[Scored]:
    """Each problem sent to the cloud with probability `share` (seeded by seed and share), else to the device: the
    chosen endpoint's own row."""
    rng = random.Random(f"{seed}:{share:.6f}")
    rows = []
    for d, c in zip(device, cloud, strict=True):
        chosen = c if rng.random() < share else d
        rows.append(replace(chosen, routed_to="cloud" if chosen is c else "device"))
    return rows


def cloud_share(rows: Iterable[Scored]) -> float:
    rows = list(rows)
    cloud = sum(r.decode.get("cloud", 0) for r in rows)
    total = sum(sum(r.decode.values()) for r in rows)
    return cloud / total if total else 0.0


def summary(name: str, rows: list[Scored], references: dict[str, list[Scored]], seed: int) -> dict:
    n = len(rows)
    passed = sum(r.passed for r in rows)
    low, high = wilson(passed, n)
    ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
    reasons = Counter(m[3] for r in rows for m in r.migrations)
    out = {
        "config": name,
        "problems": n,
        "passed": passed,
        "pass_at_1": passed / n if n else 0.0,
        "wilson_95": [low, high],
        "cloud_cost_usd_per_answer": statistics.fmean(r.cost_cloud for r in rows) if n else 0.0,
        "unified_cost_usd_per_answer": statistics.fmean(r.cost_cloud + r.cost_device for r in rows) if n else 0.0,
        "ttft_s_median": statistics.median(ttfts) if ttfts else None,
        "decode_tokens": {role: sum(r.decode.get(role, 0) for r in rows) for role in ENDPOINTS},
        "prefill_tokens": {role: sum(r.prefill.get(role, 0) for r in rows) for role in ENDPOINTS},
        "cloud_token_share": cloud_share(rows),
        "answers_migrated": sum(bool(r.migrations) for r in rows),
        "migrations_by_reason": dict(reasons),
        "answer_seconds_total": sum(r.seconds for r in rows),
        "decode_tokens_per_s_median": _median_rate(rows),
        "finish_reasons": dict(Counter(r.finish_reason for r in rows)),
        "verdicts": dict(Counter(r.verdict for r in rows)),
        "paired": {},
    }
    for ref_name, ref in references.items():
        if ref is rows or [r.task_id for r in ref] != [r.task_id for r in rows]:
            continue
        mine, theirs = [r.passed for r in rows], [r.passed for r in ref]
        only_mine, only_theirs = discordant(mine, theirs)
        out["paired"][ref_name] = {
            "difference": (sum(mine) - sum(theirs)) / n if n else 0.0,
            "bootstrap_95": list(paired_bootstrap(mine, theirs, seed=seed)),
            "only_this": only_mine,
            "only_reference": only_theirs,
            "mcnemar_p": mcnemar_exact(only_mine, only_theirs),
        }
    return out


# -- reports ----------------------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(summaries: list[dict]) -> list[str]:
    lines = [
        "| configuration | pass@1 % [95 % CI] | vs cloud: Δ points [95 % CI], McNemar p | vs device: Δ points "
        "[95 % CI] | cloud bill µUSD/answer | unified cost µUSD/answer | median TTFT s | cloud token share | "
        "answers migrated (reasons) | a random router at the same cloud bill (expected pass@1 %) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        low, high = s["wilson_95"]
        paired = []
        for ref in ENDPOINTS:
            p = s["paired"].get(ref)
            if p is None:
                paired.append("—")
                continue
            b_low, b_high = p["bootstrap_95"]
            text = f"{100 * p['difference']:+.1f} [{100 * b_low:+.1f}, {100 * b_high:+.1f}]"
            paired.append(text + (f", p = {p['mcnemar_p']:.3g}" if ref == "cloud" else ""))
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["migrations_by_reason"].items()))
        ttft = "—" if s["ttft_s_median"] is None else f"{s['ttft_s_median']:.2f}"
        expected = "—" if s.get("random_at_same_bill") is None else _pct(s["random_at_same_bill"])
        lines.append(
            f"| {s['config']} | {_pct(s['pass_at_1'])} ({s['passed']}/{s['problems']}) [{_pct(low)}, {_pct(high)}] | "
            f"{paired[1]} | {paired[0]} | {1e6 * s['cloud_cost_usd_per_answer']:.1f} | "
            f"{1e6 * s['unified_cost_usd_per_answer']:.1f} | {ttft} | {s['cloud_token_share']:.2f} | "
            f"{s['answers_migrated']}{f' ({reasons})' if reasons else ''} | {expected} |"
        )
    return lines


def _median_rate(rows: list[Scored]) -> float | None:
    """The median answer's decode rate as the client saw it: its tokens after the first over the time after it."""
    rates = [
        (sum(r.decode.values()) - 1) / (r.seconds - r.ttft_s)
        for r in rows
        if r.ttft_s is not None and r.seconds > r.ttft_s and sum(r.decode.values()) > 1
    ]
    return statistics.median(rates) if rates else None


def model_time(summaries: list[dict]) -> str:
    """How long the models took over each asked configuration's answers (as measured when they were asked, maybe
    in an earlier run: the cache keeps it); a random router's answers are the endpoints' own and took none."""
    parts = [
        f"{s['config']} {s['answer_seconds_total']:.0f} s ({s['answer_seconds_total'] / s['problems']:.1f} s an answer"
        + (f", {s['decode_tokens_per_s_median']:.1f} tokens/s" if s["decode_tokens_per_s_median"] else "")
        + ")"
        for s in summaries
        if s["problems"] and not s["config"].startswith("random")
    ]
    return "Model time, as the answers were asked: " + "; ".join(parts) + "."


def _short(name: str) -> str:
    """A row's name on the plot: `policy:quality+quality_threshold=0.8` as `quality τ=0.8`."""
    if not name.startswith("policy:"):
        return name
    return name.removeprefix("policy:").replace("+quality_threshold=", " τ=").replace("+", " ")


def plot_frontier(summaries: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, label in (
        (axes[0], "cloud_cost_usd_per_answer", "cloud bill per answer (µUSD)"),
        (axes[1], "unified_cost_usd_per_answer", "unified cost per answer (µUSD, device energy at λ)"),
    ):
        for s in summaries:
            x, y = 1e6 * s[key], 100 * s["pass_at_1"]
            low, high = (100 * v for v in s["wilson_95"])
            marker = {"device": "s", "cloud": "D"}.get(s["config"], "o" if s["config"].startswith("disco") else "^")
            ax.errorbar(x, y, yerr=[[y - low], [high - y]], fmt=marker, capsize=3)
            ax.annotate(_short(s["config"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ends = {s["config"]: s for s in summaries if s["config"] in ENDPOINTS}
        if len(ends) == 2:  # a random router, in expectation: the straight line between the endpoints
            line = [ends["device"], ends["cloud"]]
            ax.plot([1e6 * e[key] for e in line], [100 * e["pass_at_1"] for e in line], "--", color="grey", lw=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("HumanEval pass@1 (%) [Wilson 95 %]")
    fig.suptitle("tandem bench quality: pass@1 against cost")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def appendix_d(rows: dict[str, list[Scored]], cuts: tuple[int, ...]) -> tuple[list[str], dict]:
    """Pass@1 against the cut point k, both directions, beside both endpoints alone on the same problems; the bound
    check (min ≤ migrated ≤ max) per row, and the problems where a migrated answer leaves the endpoints' own range
    (passes where both fail, or fails where both pass)."""
    device, cloud = rows["device"], rows["cloud"]
    n = len(device)
    d_pass, c_pass = sum(r.passed for r in device), sum(r.passed for r in cloud)
    lo, hi = min(d_pass, c_pass), max(d_pass, c_pass)
    lines = [
        f"Endpoints alone on the same {n} problems: device {d_pass}/{n} ({_pct(d_pass / n)} %), cloud {c_pass}/{n} "
        f"({_pct(c_pass / n)} %).",
        "",
        "| k | direction | pass@1 % | answers moved at k | bound min ≤ x ≤ max | above both (problems) | below both "
        "(problems) | model s/answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks, data = [], {"device": d_pass, "cloud": c_pass, "problems": n, "rows": []}
    for k in cuts:
        for source in ENDPOINTS:
            name = f"{source}>{'cloud' if source == 'device' else 'device'}@{k}"
            moved = rows[name]
            passed = sum(r.passed for r in moved)
            above = [
                m.task_id
                for m, d, c in zip(moved, device, cloud, strict=True)
                if m.passed and not (d.passed or c.passed)
            ]
            below = [
                m.task_id
                for m, d, c in zip(moved, device, cloud, strict=True)
                if not m.passed and d.passed and c.passed
            ]
            migrated = sum(bool(r.migrations) for r in moved)
            holds = lo <= passed <= hi
            lines.append(
                f"| {k} | {name.split('@')[0].replace('>', ' → ')} | {_pct(passed / n)} ({passed}/{n}) | "
                f"{migrated}/{n} | {'holds' if holds else 'OUTSIDE'} | {len(above)}{_ids(above)} | "
                f"{len(below)}{_ids(below)} | {statistics.fmean(r.seconds for r in moved):.1f} |"
            )
            checks.append(f"bound check {name}: {lo} <= {passed} <= {hi}: {'holds' if holds else 'does not hold'}")
            data["rows"].append(
                {"config": name, "k": k, "passed": passed, "migrated": migrated, "bound_holds": holds,
                 "above_both": above, "below_both": below}
            )  # fmt: skip
    return [*lines, "", *checks], data


def _ids(task_ids: list[str]) -> str:
    return f" ({', '.join(t.split('/')[1] for t in task_ids)})" if task_ids else ""


def plot_appendix_d(data: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = data["problems"]
    for source, marker in (("device", "o"), ("cloud", "s")):
        points = [(r["k"], 100 * r["passed"] / n) for r in data["rows"] if r["config"].startswith(source + ">")]
        ax.plot(*zip(*points, strict=True), marker=marker, label=f"{source} first, moved at k")
    for endpoint, style in (("device", ":"), ("cloud", "--")):
        ax.axhline(100 * data[endpoint] / n, linestyle=style, color="grey", label=f"{endpoint} alone")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (answer tokens before the forced migration)")
    ax.set_ylabel("HumanEval pass@1 (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -- the run ----------------------------------------------------------------------------------------------------


def _rows(
    config: Config,
    problems: list[Problem],
    cache: AnswerCache,
    ask,
    limits: Limits,
    scored: dict[tuple[str, int], list[Scored]],
) -> list[Scored]:
    key = (config.name, config.cut)
    if key not in scored:
        records = collect(config, problems, cache, ask)
        scored[key] = [score(r, p, limits) for r, p in zip(records, problems, strict=True)]
    return scored[key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench quality", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help=f'comma-separated (default: {DEFAULT_CONFIGS}; "": none)'
    )
    parser.add_argument("--sample", type=int, default=None, help="a fixed, seeded sample of N problems")
    parser.add_argument("--seed", type=int, default=0, help="the sample's and the random router's seed")
    parser.add_argument("--half", choices=humaneval.HALVES, default="all", help="the held-out split's half")
    parser.add_argument("--appendix-d", action="store_true", help="forced migrations at k, both directions")
    parser.add_argument("--appendix-d-sample", type=int, default=APPENDIX_D_SAMPLE, help="its fixed sample's size")
    parser.add_argument("--cuts", default=",".join(map(str, APPENDIX_D_CUTS)), help="Appendix D's k values")
    parser.add_argument("--device-model", default=DEVICE_MODEL, help="bundled model name or GGUF path")
    parser.add_argument("--cloud-model", default=CLOUD_MODEL, help="bundled model name or GGUF path")
    parser.add_argument("--cache", default="var/bench/quality-cache", help="the answers' cache folder")
    parser.add_argument("--offline", action="store_true", help="score cached answers only; never start the gateway")
    parser.add_argument("--out", default="var/bench/quality", help="folder for the JSON, markdown and PNG")
    parser.add_argument(
        "--tune-thresholds", default="", help="quality-policy τ values read off the device's answers (--half tune)"
    )
    args = parser.parse_args(argv)

    configs = parse_configs(args.configs)
    cuts = tuple(int(k) for k in args.cuts.split(","))
    thresholds = tuple(_threshold(t) for t in args.tune_thresholds.split(",") if t.strip())
    if thresholds and args.half != "tune":
        raise SystemExit("error: --tune-thresholds reads the tune half only (--half tune): never the half reported")
    problems = humaneval.load()
    chosen = humaneval.sample(humaneval.half(problems, args.half), args.sample, args.seed)
    cache = AnswerCache(Path(args.cache), setup_of(args.device_model, args.cloud_model))
    gateway = None if args.offline else Gateway(gateway_config(args.device_model, args.cloud_model))
    limits = Limits()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scored: dict[tuple[str, int], list[Scored]] = {}
    started = time.perf_counter()
    try:
        summaries = _frontier(configs, chosen, cache, gateway, limits, scored, args.seed)
        header = (
            f"tandem bench quality {shlex.join(argv or [])}  ({time.strftime('%Y-%m-%d')}; {cpu_name()}; device "
            f"{args.device_model}, cloud {args.cloud_model}; greedy, max_tokens {MAX_TOKENS}, EvalPlus's instruct "
            f"prompt with its response prefix; sandbox network isolation: {network_isolation()})"
        )
        report = [header]
        results = {"setup": setup_of(args.device_model, args.cloud_model), "problems": [p.task_id for p in chosen]}
        results["summaries"] = summaries
        if summaries:  # none with --configs "" (Appendix D alone)
            title = f"{len(chosen)} HumanEval problems (half: {args.half}" + (
                f"; a sample of {args.sample}, seed {args.seed})" if args.sample else ")"
            )
            report += ["", title, "", *table(summaries), "", model_time(summaries)]
            plot_frontier(summaries, out / "quality.png")
        if thresholds:
            lines, results["tune"] = _tune(chosen, cache, gateway, limits, scored, thresholds, args.device_model)
            report += ["", "The quality policy's threshold, read off the device's answers (the tune half)", "", *lines]
        if args.appendix_d:
            sample = humaneval.sample(problems, args.appendix_d_sample, args.seed)
            on_sample: dict[tuple[str, int], list[Scored]] = {}  # other problems than the frontier's
            rows = {
                e: _rows(Config(e, "endpoint", endpoint=e), sample, cache, gateway, limits, on_sample)
                for e in ENDPOINTS
            }
            for k in cuts:
                for source in ENDPOINTS:
                    config = forced(source, k)
                    rows[config.label] = _rows(config, sample, cache, gateway, limits, on_sample)
            lines, data = appendix_d(rows, cuts)
            report += [
                "",
                f"Appendix D: forced migrations at k on a fixed sample of {len(sample)} problems",
                "",
                *lines,
            ]
            results["appendix_d"] = data
            plot_appendix_d(data, out / "appendix-d.png")
    finally:
        if gateway is not None:
            gateway.close()
    report += ["", f"(this run: {time.perf_counter() - started:.0f} s)"]
    publish("\n".join(report), out / "quality.md")
    write_json(results, out / "quality.json")
    return 0


def _tune(problems, cache: AnswerCache, gateway, limits: Limits, scored, thresholds, device_model: str):
    rows = {e: _rows(Config(e, "endpoint", endpoint=e), problems, cache, gateway, limits, scored) for e in ENDPOINTS}
    answers = [r["answer"] for r in collect(Config("device", "endpoint", endpoint="device"), problems, cache, None)]
    tops = quality_tune.top_probabilities(resolve_model(device_model), problems, answers)
    return quality_tune.tune(
        [p.task_id for p in problems],
        [r.passed for r in rows["device"]],
        [r.passed for r in rows["cloud"]],
        tops,
        thresholds,
    )


def _frontier(
    configs: list[Config], problems: list[Problem], cache: AnswerCache, gateway, limits: Limits, scored, seed: int
) -> list[dict]:
    """Every configuration's summary; a random router's rows need both endpoints' rows (asked if missing)."""
    rows: dict[str, list[Scored]] = {}
    for config in configs:
        if config.asks:
            rows[config.label] = _rows(config, problems, cache, gateway, limits, scored)
    randoms = [c for c in configs if not c.asks]
    if randoms:
        for endpoint in ENDPOINTS:
            if endpoint not in rows:
                rows[endpoint] = _rows(
                    Config(endpoint, "endpoint", endpoint=endpoint), problems, cache, gateway, limits, scored
                )
        shares = []
        for config in randoms:
            if config.share is not None:
                shares.append(config.share)
            else:  # matched: one at each routing row's measured cloud token share (DiSCo's, a policy's)
                shares += [cloud_share(rows[c.label]) for c in configs if c.kind in ("disco", "policy")]
        for share in shares:
            rows[f"random-s{share:.2f}"] = random_router(share, rows["device"], rows["cloud"], seed)
    references = {e: rows[e] for e in ENDPOINTS if e in rows}
    summaries = [summary(name, r, references, seed) for name, r in rows.items()]
    by_name = {s["config"]: s for s in summaries}
    if set(ENDPOINTS) <= set(by_name):
        for s in summaries:
            s["random_at_same_bill"] = random_at_same_bill(s, by_name["device"], by_name["cloud"])
    return summaries


def random_at_same_bill(row: dict, device: dict, cloud: dict) -> float | None:
    """The pass@1 a random router scores, in expectation, for the row's cloud bill: it sends each request to the
    cloud with probability s = the row's bill / cloud-only's, so it scores the device's pass@1 plus s times the
    cloud's lead on the same problems (None when the cloud costs nothing)."""
    full = cloud["cloud_cost_usd_per_answer"]
    if full <= 0:
        return None
    share = min(1.0, row["cloud_cost_usd_per_answer"] / full)
    return device["pass_at_1"] + share * (cloud["pass_at_1"] - device["pass_at_1"])


if __name__ == "__main__":
    sys.exit(main())
