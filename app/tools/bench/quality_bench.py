"""`tandem bench quality`: what the answers are worth. HumanEval's 164 problems answered through a real gateway.

A real `tandem serve` running the shipped config (deploy/embedded.toml: the device, Qwen2.5-Coder-0.5B on llama.cpp,
and the cloud, the 1.5B behind a loopback OpenAI-compatible server; its HAT cloud and the device's prompt cache left
out, an admin key added: quality_configs.gateway_config) is asked with the `openai` SDK, greedy, `max_tokens` 512,
EvalPlus's instruct prompt with its response prefix, which the gateway continues as a prefill
(app/tools/bench/humaneval.py). Each answer's code runs against the problem's tests in the sandbox
(app/tools/bench/sandbox.py).

Configurations (`--configs`):
- `shipped` (the default): what a user gets, read from deploy/embedded.toml and policies/ — the endpoints alone, the
  embedded default's policy (DiSCo at the config's b) and the `quality` policy at the config's τ, each policy
  streamed and unstreamed (quality_configs.Shipped);
- `device`, `cloud`: each endpoint alone (the request's model names the backend: no race, no migration);
- `disco:B`: DiSCo (`"policy": "disco"`) at budget b = B (set over PUT /v1/budget for its answers only);
- `random:S`: a router that sends each request to the cloud with probability S, else to the device (seeded).
  Greedy answers do not depend on who chose the endpoint, so its answer to a problem is that endpoint's own row:
  it is read from the `device` and `cloud` rows, never asked again. `random:matched` adds one at each DiSCo or
  `policy:` row's measured cloud token share;
- `device>cloud@K`, `cloud>device@K`: the answer starts on one endpoint and is moved to the other after K answer
  tokens (`"tandem": {"migrate_after_tokens": K}`, migration reason `forced`): DiSCo's Appendix D (`--appendix-d`);
- `policy:NAME+KEY=VALUE...`: any policy with its per-request knobs (the request's `tandem` options), e.g. a
  quality-aware policy at several settings; `+stream=false` asks it unstreamed.
Where both endpoints are asked, the oracle router (a problem passes if either endpoint's answer does; the cloud's
bill on the problems only the cloud solves) is added as the bound no router can pass.

On the report half only the shipped rows are results; any other row is labelled "exploration (in-sample)" in the
tables, the JSON, the per-problem files and the plot: choosing a new default is a tune-half decision
(`--half tune --tune-thresholds`, which refuses the report half), committed before the report half is run.

Per configuration: pass@1 with its Wilson 95 % interval; the paired difference against the cloud alone and the
device alone on the same problems (a paired bootstrap 95 % interval, McNemar's exact p); the cloud bill and the
unified cost (the device's energy at λ included) per answer, from the ledger (GET /v1/budget before and after each
answer), and both as multiples of cloud-only's; the pass@1 a coin-flip router paying the same bill scores; TTFT as
the client saw it; tokens per endpoint; migrations and their reasons (the request's trace).

Answers are cached on disk by (configuration, problem, cut point) under a folder named by the set-up (models,
prompt, max_tokens, gateway config), so rescoring and re-plotting never ask the models again (`--offline` refuses
to). Every asked row's per-problem results go to `--results` (docs/bench/quality/<half>/, quality_results.py), to be
committed; `--rescore` grades those committed answers again in the sandbox and prints the table from them, starting
no gateway and reading no cache. The held-out split is fixed in code (humaneval.TUNE_HALF).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.tools import import_extra
from app.tools.bench import humaneval, quality_results, quality_tune
from app.tools.bench.humaneval import Problem
from app.tools.bench.output import cpu_name, publish, write_json
from app.tools.bench.quality_configs import (
    ADMIN_KEY,
    APPENDIX_D,
    EXPLORATION,
    FORMER,
    ORACLE,
    Config,
    Shipped,
    committed_standing,
    expand,
    forced,
    gateway_config,
    parse_configs,
    shipped,
    standing,
    threshold,
)
from app.tools.bench.quality_report import appendix_d, model_time, plot_appendix_d, plot_frontier, table
from app.tools.bench.quality_results import CommittedAnswers
from app.tools.bench.quality_scores import (
    ENDPOINTS,
    Scored,
    against_cloud,
    cloud_share,
    oracle_router,
    random_at_same_bill,
    random_router,
    score,
    summary,
)
from app.tools.bench.sandbox import Limits, mechanism
from deploy.models import resolve_model

__all__ = ["AnswerCache", "Config", "collect", "forced", "main", "parse_configs", "setup_of"]

MAX_TOKENS = 512  # EvalPlus's protocol (and the shipped default_max_tokens)
DEFAULT_CONFIGS = "shipped"
APPENDIX_D_CUTS = (16, 32, 64, 128)
APPENDIX_D_SAMPLE = 40
RESULTS = "docs/bench/quality"


# -- the gateway ------------------------------------------------------------------------------------------------


class Gateway:
    """The bench's `tandem serve`, started at the first answer the cache does not hold (a run that finds every answer
    cached starts nothing), asked one answer at a time."""

    def __init__(self, config: str, budget: float):
        self.config = config
        self.process = None
        self.shipped_budget = self.budget = budget  # the config's b: what every row but a `disco:B` one runs at

    def __call__(self, config: Config, problem: Problem) -> dict:
        if self.process is None:
            self._start()
        wanted = config.budget if config.kind == "disco" else self.shipped_budget
        if wanted != self.budget:  # a `disco:B` row's b never outlives its row
            self._put_budget({"budget": wanted})
            self.budget = wanted
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
            stream=config.streamed,
            stop=list(humaneval.STOP),
            extra_body={"tandem": options} if options else None,
        )
        request_id = raw.headers["x-request-id"]
        pieces, ttft, finish = [], None, None
        if config.streamed:
            for chunk in raw.parse():
                if not chunk.choices:
                    continue
                piece = chunk.choices[0].delta.content
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    pieces.append(piece)
                finish = chunk.choices[0].finish_reason or finish
        else:  # no first token before the whole answer: no TTFT (its time is `seconds`)
            choice = raw.parse().choices[0]
            pieces, finish = [choice.message.content or ""], choice.finish_reason
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

    kind = "cached"

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


def setup_of(device_model: str, cloud_model: str, ship: Shipped | None = None) -> dict:
    ship = ship or shipped()
    return {
        "device_model": device_model,
        "cloud_model": cloud_model,
        "max_tokens": MAX_TOKENS,
        "instruction": humaneval.INSTRUCTION,
        "response_prefix": humaneval.RESPONSE_PREFIX,
        "stop": list(humaneval.STOP),
        "data_sha256": humaneval.DATA_SHA256,
        "gateway": gateway_config(ship, device_model, cloud_model),
    }


def collect(
    config: Config, problems: list[Problem], source, ask: Callable[[Config, Problem], dict] | None
) -> list[dict]:
    """Each problem's answer under `config`: from `source` (the answer cache, or the committed results), else asked
    (and cached at once). `ask` None: offline, a missing answer is an error."""
    records = []
    for i, problem in enumerate(problems):
        record = source.get(config, problem.task_id)
        if record is None:
            if ask is None:
                raise SystemExit(
                    f"error: no {source.kind} answer for {config.label} on {problem.task_id} (in {source.dir})"
                )
            record = ask(config, problem)
            source.put(config, record)
            print(
                f"[{config.label} {i + 1}/{len(problems)}] {problem.task_id}: {record['seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        records.append(record)
    return records


class Answered:
    """The run's rows on one set of problems: each configuration answered once (from `source`, else asked) and
    scored once in the sandbox, its records kept for the per-problem results."""

    def __init__(self, ask, limits: Limits):
        self.ask, self.limits = ask, limits
        self.rows: dict[str, tuple[list[dict], list[Scored]]] = {}  # by row label, on one set of problems

    def __call__(self, config: Config, problems: list[Problem], source) -> list[Scored]:
        return self.records(config, problems, source)[1]

    def records(self, config: Config, problems: list[Problem], source) -> tuple[list[dict], list[Scored]]:
        if config.label not in self.rows:
            records = collect(config, problems, source, self.ask)
            self.rows[config.label] = (
                records,
                [score(r, p, self.limits) for r, p in zip(records, problems, strict=True)],
            )
        return self.rows[config.label]


# -- the run ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ship = shipped()
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
    parser.add_argument("--device-model", default=ship.device_model, help="bundled model name or GGUF path")
    parser.add_argument("--cloud-model", default=ship.cloud_model, help="bundled model name or GGUF path")
    parser.add_argument("--cache", default="var/bench/quality-cache", help="the answers' cache folder")
    parser.add_argument("--offline", action="store_true", help="score cached answers only; never start the gateway")
    parser.add_argument(
        "--results", default=RESULTS, help=f"per-problem results, by half (default: {RESULTS}, to be committed)"
    )
    parser.add_argument(
        "--rescore", action="store_true", help="grade the committed per-problem answers again; no gateway, no cache"
    )
    parser.add_argument("--out", default="var/bench/quality", help="folder for the JSON, markdown and PNG")
    parser.add_argument(
        "--tune-thresholds", default="", help="quality-policy τ values read off the device's answers (--half tune)"
    )
    args = parser.parse_args(argv)

    configs = parse_configs(expand(args.configs, ship))
    cuts = tuple(int(k) for k in args.cuts.split(","))
    thresholds = tuple(threshold(t) for t in args.tune_thresholds.split(",") if t.strip())
    if thresholds and args.half != "tune":
        raise SystemExit("error: --tune-thresholds reads the tune half only (--half tune): never the half reported")
    problems = humaneval.load()
    chosen = humaneval.sample(humaneval.half(problems, args.half), args.sample, args.seed)
    models_shipped = (args.device_model, args.cloud_model) == (ship.device_model, ship.cloud_model)
    setup = setup_of(args.device_model, args.cloud_model, ship)
    results_dir = quality_results.folder(Path(args.results), args.half, args.sample, args.seed)
    appendix_dir = quality_results.folder(Path(args.results), "appendix-d", args.appendix_d_sample, args.seed)
    if args.rescore:
        source, appendix_source, gateway = CommittedAnswers(results_dir), CommittedAnswers(appendix_dir), None
    else:
        source = appendix_source = AnswerCache(Path(args.cache), setup)
        gateway = None if args.offline else Gateway(setup["gateway"], ship.budget)
    answered = Answered(gateway, Limits())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    written, changes = [], {}
    try:
        summaries = _frontier(configs, lambda c: answered(c, chosen, source), args.seed)

        def committed(label: str) -> str | None:  # --rescore: what the committed files earn, not today's config
            return committed_standing(label, source.row(label), ship, setup["gateway"])

        for s in summaries:
            s["standing"] = standing(
                s["config"], args.half, ship, models_shipped, s.get("matched_to"), committed if args.rescore else None
            )
            row = source.row(s["config"]) if args.rescore else None
            s["description"] = (row or {}).get("description") or _describe(s["config"], ship, models_shipped)
        header = (
            f"tandem bench quality {shlex.join(argv or [])}  ({time.strftime('%Y-%m-%d')}; {cpu_name()}; device "
            f"{args.device_model}, cloud {args.cloud_model}; greedy, max_tokens {MAX_TOKENS}, EvalPlus's instruct "
            f"prompt with its response prefix; sandbox: {mechanism()})"
        )
        report = [header]
        if args.rescore:
            report.append(f"Rescored from the committed answers in {results_dir} (no gateway, no cache).")
            former = [s["config"] for s in summaries if s["standing"] == FORMER]
            if former:
                report.append(f"Asked with another gateway config than today's shipped one: {', '.join(former)}.")
        results = {"setup": setup, "problems": [p.task_id for p in chosen], "shipped": _shipped_json(ship)}
        results["summaries"] = summaries
        if summaries:  # none with --configs "" (Appendix D alone)
            title = f"{len(chosen)} HumanEval problems (half: {args.half}" + (
                f"; a sample of {args.sample}, seed {args.seed})" if args.sample else ")"
            )
            report += ["", title, "", _shipped_line(ship, models_shipped), "", *_tables(summaries)]
            report += ["", model_time(summaries)]
            plot_frontier(summaries, out / "quality.png")
        if thresholds:
            lines, results["tune"] = _tune(chosen, source, answered, thresholds, args.device_model)
            report += ["", "The quality policy's threshold, read off the device's answers (the tune half)", "", *lines]
        by_label = {s["config"]: s for s in summaries}
        for label, (records, scored) in answered.rows.items():
            if args.rescore:
                changes[label] = source.changes(label, scored)
                continue
            s = by_label.get(label) or {
                "standing": standing(label, args.half, ship, models_shipped),
                "description": _describe(label, ship, models_shipped),
            }
            head = {"half": args.half, "sample": args.sample, "seed": args.seed, "setup": setup}
            head |= {"standing": s["standing"], "description": s["description"]}
            written.append(quality_results.write_row(results_dir, label, head, records, scored))
        if args.appendix_d:
            sample = humaneval.sample(problems, args.appendix_d_sample, args.seed)
            asked = [Config(e, "endpoint", endpoint=e) for e in ENDPOINTS]
            asked += [forced(source_end, k) for k in cuts for source_end in ENDPOINTS]
            on_sample = Answered(gateway, answered.limits)  # other problems than the frontier's
            rows = {c.label: on_sample(c, sample, appendix_source) for c in asked}
            lines, data = appendix_d(rows, cuts)
            report += [
                "",
                f"Appendix D: forced migrations at k on a fixed sample of {len(sample)} problems",
                "",
                *lines,
            ]
            results["appendix_d"] = data
            plot_appendix_d(data, out / "appendix-d.png")
            for label, (records, scored) in on_sample.rows.items():
                if args.rescore:
                    changes[f"appendix-d {label}"] = appendix_source.changes(label, scored)
                else:
                    head = {"sample": args.appendix_d_sample, "seed": args.seed, "setup": setup}
                    head |= {"standing": APPENDIX_D, "description": label}
                    written.append(quality_results.write_row(appendix_dir, label, head, records, scored))
    finally:
        if gateway is not None:
            gateway.close()
    if written:
        folders = sorted({str(p.parent) for p in written})
        report += ["", f"Per-problem results: {len(written)} rows in {', '.join(folders)}."]
    if args.rescore:
        results["rescore"] = changes
        report += ["", *_rescore_lines(changes)]
    report += ["", f"(this run: {time.perf_counter() - started:.0f} s)"]
    publish("\n".join(report), out / "quality.md")
    write_json(results, out / "quality.json")
    return 1 if any(changes.values()) else 0


def _describe(name: str, ship: Shipped, models_shipped: bool) -> str:
    if name == ORACLE:
        return "oracle router (the cloud only where its answer alone passes)"
    return ship.describe(name) if models_shipped else name


def _shipped_json(ship: Shipped) -> dict:
    return {
        "config": ship.where,
        "policy": ship.policy,
        "budget": ship.budget,
        "quality_threshold": ship.quality_threshold,
        "quality_threshold_from": ship.threshold_source,
        "device_model": ship.device_model,
        "cloud_model": ship.cloud_model,
        "rows": list(ship.tokens),
    }


def _shipped_line(ship: Shipped, models_shipped: bool) -> str:
    line = (
        f"The shipped default, read from {ship.where} and policies/: the embedded default's policy "
        f"`{ship.policy}` (b = {ship.budget:g}), the `quality` policy at τ = {ship.quality_threshold:g} "
        f"({ship.threshold_source}); its rows: {', '.join(ship.tokens)}."
    )
    line += (
        " The bench's gateway is that config with an admin key, its cloud on a free port, no HAT cloud and no device "
        "prompt cache (each prompt is asked once a row: a user's new prompt is in no cache)."
    )
    if not models_shipped:
        line += " This run asked other models than the shipped ones: none of its rows is the shipped default."
    return line


def _tables(summaries: list[dict]) -> list[str]:
    """The results (and the bound and the references), then, apart, any exploration row with its label."""
    shown = [s for s in summaries if s["standing"] != EXPLORATION]
    explored = [s for s in summaries if s["standing"] == EXPLORATION]
    lines = table(shown) if shown else []
    if explored:
        lines += [
            "",
            f"**{EXPLORATION[0].upper()}{EXPLORATION[1:]}**: asked on the report half but not the configuration a "
            "user gets, so not results (a new default is chosen on the tune half and committed before a report run):",
            "",
            *table(explored),
        ]
    return lines


def _rescore_lines(changes: dict[str, list[str]]) -> list[str]:
    changed = {label: c for label, c in changes.items() if c}
    if not changed:
        return [f"Rescored: every committed verdict reproduced ({len(changes)} rows)."]
    lines = [f"Rescored: verdicts that differ from the committed ones in {len(changed)} of {len(changes)} rows:"]
    return lines + [f"- {label}: {'; '.join(c)}" for label, c in changed.items()]


def _tune(problems, source, answered: Answered, thresholds, device_model: str):
    rows = {e: answered(Config(e, "endpoint", endpoint=e), problems, source) for e in ENDPOINTS}
    records, _ = answered.records(Config("device", "endpoint", endpoint="device"), problems, source)
    tops = quality_tune.top_probabilities(resolve_model(device_model), problems, [r["answer"] for r in records])
    return quality_tune.tune(
        [p.task_id for p in problems],
        [r.passed for r in rows["device"]],
        [r.passed for r in rows["cloud"]],
        tops,
        thresholds,
    )


def _frontier(configs: list[Config], rows_of: Callable[[Config], list[Scored]], seed: int) -> list[dict]:
    """Every configuration's summary, and the oracle router's where both endpoints are asked; a random router's rows
    need both endpoints' rows (asked if missing)."""
    rows: dict[str, list[Scored]] = {}
    for config in configs:
        if config.asks:
            rows[config.label] = rows_of(config)
    randoms = [c for c in configs if not c.asks]
    if randoms:
        for endpoint in ENDPOINTS:
            if endpoint not in rows:
                rows[endpoint] = rows_of(Config(endpoint, "endpoint", endpoint=endpoint))
    if set(ENDPOINTS) <= set(rows):
        rows[ORACLE] = oracle_router(rows["device"], rows["cloud"])
    matched: dict[str, str | None] = {}
    for config in randoms:
        if config.share is not None:
            shares = [(config.share, None)]
        else:  # matched: one at each routing row's measured cloud token share (DiSCo's, a policy's)
            shares = [(cloud_share(rows[c.label]), c.label) for c in configs if c.kind in ("disco", "policy")]
        for share, to in shares:
            name = f"random-s{share:.2f}"
            rows[name], matched[name] = random_router(share, rows["device"], rows["cloud"], seed), to
    references = {e: rows[e] for e in ENDPOINTS if e in rows}
    summaries = [summary(name, r, references, seed) for name, r in rows.items()]
    by_name = {s["config"]: s for s in summaries}
    for s in summaries:
        if matched.get(s["config"]) is not None:
            s["matched_to"] = matched[s["config"]]
        if set(ENDPOINTS) <= set(by_name):
            s["random_at_same_bill"] = random_at_same_bill(s, by_name["device"], by_name["cloud"])
            against_cloud(s, by_name["cloud"])
    return summaries


if __name__ == "__main__":
    sys.exit(main())
