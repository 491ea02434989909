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
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.tools import import_extra
from app.tools.bench import humaneval, quality_tune
from app.tools.bench.humaneval import Problem
from app.tools.bench.output import cpu_name, publish, write_json
from app.tools.bench.quality_report import appendix_d, model_time, plot_appendix_d, plot_frontier, table
from app.tools.bench.quality_scores import (
    ENDPOINTS,
    Scored,
    cloud_share,
    random_at_same_bill,
    random_router,
    score,
    summary,
)
from app.tools.bench.sandbox import Limits, network_isolation
from deploy.models import resolve_model
from policies.quality import check_threshold

DEVICE_MODEL = "qwen2.5-coder-0.5b-instruct"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct"
MAX_TOKENS = 512
ADMIN_KEY = "quality-bench-admin"  # the bench's own gateway, on loopback: PUT /v1/budget sets DiSCo's b
DEFAULT_CONFIGS = "device,cloud,disco:0.25,disco:0.5,disco:0.75,random:matched"
APPENDIX_D_CUTS = (16, 32, 64, 128)
APPENDIX_D_SAMPLE = 40


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
    streamed: bool = True  # policy: asked streamed (False: the client gets the answer whole; `+stream=false`)

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
            options = dict(_policy_options(value, token))
            streamed = options.pop("stream", True)
            if not isinstance(streamed, bool):
                raise SystemExit(f"error: --configs: {token!r}: stream=true or stream=false")
            configs.append(Config(token, "policy", options=tuple(options.items()), streamed=streamed))
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
    that JSON, e.g. a number; otherwise the text), e.g. policy:quality+quality_threshold=0.8 for a policy with a
    per-request knob; `stream=false` (the request's own field, not a `tandem` option) asks it unstreamed."""
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


if __name__ == "__main__":
    sys.exit(main())
