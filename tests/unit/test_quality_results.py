"""The report half reports the shipped default (app/tools/bench/quality_configs.py), the oracle router's bound
(quality_scores.py), and the per-problem results committed under docs/bench/quality/ with `--rescore`
(quality_results.py): the shipped knobs read from deploy/embedded.toml, every other row labelled exploration, the
committed files' format, and a rescore of a committed-style fixture that starts no gateway."""

from __future__ import annotations

import gzip
import json
import tomllib
from pathlib import Path

import pytest

from app.config import embedded_default
from app.tools.bench import humaneval, quality_bench, quality_configs, quality_report, quality_results
from app.tools.bench.quality_configs import (
    BOUND,
    EXPLORATION,
    FORMER,
    ORACLE,
    REFERENCE,
    RESULT,
    expand,
    gateway_config,
    parse_configs,
    shipped,
    standing,
)
from app.tools.bench.quality_scores import Scored, oracle_router, summary
from policies.quality import DEFAULT_THRESHOLD

# -- the configuration as shipped ------------------------------------------------------------------------------------


def test_the_shipped_knobs_are_read_from_the_embedded_config_and_the_policies(tmp_path):
    data = tomllib.loads(embedded_default().read_text())
    ship = shipped()
    assert ship.quality_threshold == data["disco"].get("quality_threshold", DEFAULT_THRESHOLD)
    assert (ship.policy, ship.budget) == (data["gateway"]["policy"], data["disco"]["budget"])
    assert (ship.device_model, ship.cloud_model) == (data["device"]["model"], data["clouds"]["cloud"]["model"])
    # Another file's knobs are what it says; a τ it leaves out is the policy's own default.
    moved = tmp_path / "embedded.toml"
    moved.write_text(embedded_default().read_text().replace("quality_threshold = ", "quality_threshold = 0.7 #"))
    assert shipped(moved).quality_threshold == 0.7
    unset = tmp_path / "unset.toml"
    unset.write_text(
        "\n".join(line for line in moved.read_text().splitlines() if not line.startswith("quality_threshold"))
    )
    assert shipped(unset).quality_threshold == DEFAULT_THRESHOLD
    assert shipped(unset).threshold_source.startswith("policies/quality.py DEFAULT_THRESHOLD")


def test_the_bench_gateway_runs_the_shipped_config_with_only_what_the_bench_needs_changed():
    ship = shipped()
    asked = tomllib.loads(gateway_config(ship, ship.device_model, ship.cloud_model))
    expected = json.loads(json.dumps(ship.toml))
    expected["gateway"]["admin_keys"] = [quality_configs.ADMIN_KEY]
    expected["clouds"] = {ship.cloud: expected["clouds"][ship.cloud]}  # no HAT cloud: no row asks it
    expected["clouds"][ship.cloud]["embedded"]["port"] = 0
    expected["device"] |= {"prompt_cache_mb": 0, "prompt_cache_disk_mb": 0}  # each row's answers as a new prompt's
    assert asked == expected
    small = tomllib.loads(gateway_config(ship, "smollm2-135m", "smollm2-135m"))
    assert small["device"]["model"] == small["clouds"]["cloud"]["model"] == "smollm2-135m"
    assert small["device"]["n_ctx"] <= quality_configs.OVERRIDDEN_N_CTX
    assert small["disco"] == ship.toml["disco"]


def test_the_toml_writer_reads_back_equal():
    data = {"a": {"s": 'quote " and \\ and\nnewline', "f": 1e-5, "i": 3, "b": False, "l": ["x", "y"]},
            "t": {"u": {"k": 1.5}, "key with space": {"v": True}}}  # fmt: skip
    assert tomllib.loads(quality_configs.to_toml(data)) == data


def test_shipped_expands_to_the_endpoints_and_both_policies_in_both_modes():
    ship = shipped()
    names = [c.name for c in parse_configs(expand("shipped,random:matched", ship))]
    assert names == [*ship.tokens, "random-matched"]
    assert {c.streamed for c in parse_configs(expand("shipped", ship)) if c.kind == "policy"} == {True, False}
    assert {dict(c.options)["policy"] for c in parse_configs(expand("shipped", ship)) if c.kind == "policy"} == {
        ship.policy,
        "quality",
    }
    # The shipped rows carry no per-request knob: the gateway's own, as a user gets them.
    assert all(set(dict(c.options)) == {"policy"} for c in parse_configs(expand("shipped", ship)) if c.options)


def test_only_the_shipped_rows_are_results_on_the_report_half():
    ship = shipped()
    for name in ship.tokens:
        assert standing(name, "report", ship, models_shipped=True) == RESULT
        assert standing(name, "report", ship, models_shipped=False) == EXPLORATION  # other models
    tau = f"policy:quality+quality_threshold={ship.quality_threshold}"  # the same τ pinned per request: not shipped
    for name in (tau, "policy:quality+quality_threshold=0.8+stream=false", "disco-b0.5", "cloud>device@16"):
        assert standing(name, "report", ship, models_shipped=True) == EXPLORATION
    assert standing(ORACLE, "report", ship, True) == BOUND
    assert standing("random-s0.31", "report", ship, True, matched_to="policy:quality") == REFERENCE
    assert standing("random-s0.40", "report", ship, True, matched_to="disco-b0.25") == EXPLORATION
    assert standing("policy:quality+quality_threshold=0.8", "tune", ship, True) == "tune half"


def test_the_report_labels_exploration_in_its_table_and_plot(tmp_path):
    rows = [_scored("HumanEval/0", True, {"device": 10})]
    results = summary("policy:quality", rows, {}, seed=0) | {"standing": RESULT, "description": "quality"}
    explored = summary("policy:quality+quality_threshold=0.8", rows, {}, seed=0) | {"standing": EXPLORATION}
    lines = quality_bench._tables([results, explored])
    [explored_row] = [line for line in lines if "quality_threshold=0.8" in line]
    assert f"| {EXPLORATION} |" in explored_row
    assert lines.index(explored_row) > next(i for i, line in enumerate(lines) if "not results" in line)
    assert quality_report.plot_label(explored) == f"quality τ=0.8 ({EXPLORATION})"
    assert quality_report.plot_label(results) == "quality"
    quality_report.plot_frontier([results, explored], tmp_path / "quality.png")
    assert (tmp_path / "quality.png").read_bytes()[:4] == b"\x89PNG"


# -- the oracle router ---------------------------------------------------------------------------------------------


def _scored(task: str, passed: bool, decode: dict, cloud_usd: float = 0.0, device_usd: float = 1e-5) -> Scored:
    verdict = "passed" if passed else "AssertionError"
    return Scored(task, passed, verdict, cloud_usd, device_usd, 0.5, 2.0, decode, {}, [], "stop")


def test_the_oracle_router_passes_where_either_endpoint_does_and_pays_only_for_the_clouds_own_passes():
    outcomes = [(True, True), (True, False), (False, True), (False, False)]  # (device, cloud) per problem
    device = [_scored(f"HumanEval/{i}", d, {"device": 40}) for i, (d, _) in enumerate(outcomes)]
    cloud = [
        _scored(f"HumanEval/{i}", c, {"cloud": 50}, cloud_usd=8e-5, device_usd=0) for i, (_, c) in enumerate(outcomes)
    ]
    oracle = oracle_router(device, cloud)
    assert [r.passed for r in oracle] == [True, True, True, False]
    assert [r.routed_to for r in oracle] == ["device", "device", "cloud", "device"]
    s = summary(ORACLE, oracle, {"device": device, "cloud": cloud}, seed=0)
    assert s["cloud_cost_usd_per_answer"] == pytest.approx(8e-5 / 4)  # the cloud's bill on problem 2 alone
    assert s["paired"]["cloud"]["only_this"] == 1 and s["paired"]["cloud"]["only_reference"] == 0


# -- the committed per-problem results -----------------------------------------------------------------------------


def _committed(task_id: str, answer: str, verdict: str, on_cloud: int = 0) -> dict:
    """One problem as docs/bench/quality/<half>/<row>.json holds it, written out by hand."""
    tokens = {"device": {"prefill": 120, "decode": 40 - on_cloud}}
    migrations = []
    if on_cloud:
        tokens["cloud"] = {"prefill": 130, "decode": on_cloud}
        migrations = [{"at_token": 40 - on_cloud, "from": "device", "to": "cloud", "reason": "quality"}]
    return {
        "task_id": task_id,
        "answer": answer,
        "code": humaneval.extract_code(answer),
        "verdict": verdict,
        "passed": verdict == "passed",
        "finish_reason": "stop",
        "ttft_s": 0.5,
        "seconds": 3.0,
        "tokens": tokens,
        "cost_usd": {"cloud": on_cloud * 1e-6, "device": (40 - on_cloud) * 1e-7},
        "migrations": migrations,
    }


def _write(folder: Path, label: str, standing_: str, answers: list[dict], gateway: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ship = shipped()
    gateway = gateway or quality_bench.setup_of(ship.device_model, ship.cloud_model, ship)["gateway"]
    setup = {"gateway": gateway}  # the gateway config it was asked with: today's shipped one unless said
    data = {"configuration": label, "format": 1, "standing": standing_, "setup": setup, "answers": answers}
    (folder / f"{quality_results.slug(label)}.json").write_text(json.dumps(data, indent=1))


def _right(p: humaneval.Problem) -> str:
    return p.prompt + p.canonical_solution + "```\n"


def _wrong(p: humaneval.Problem) -> str:
    return f"def {p.entry_point}(*args, **kwargs):\n    raise ValueError('wrong')\n```\n"


@pytest.fixture()
def committed(tmp_path) -> tuple[Path, list[humaneval.Problem]]:
    """A committed-style report folder of two problems: the device solves the first, the cloud both, the quality
    policy (shipped, streamed) rescues the second by escalating it; an exploration row beside them whose file claims
    to be a result, and a disco row asked with an earlier config."""
    problems = humaneval.sample(humaneval.half(humaneval.load(), "report"), 2, 0)
    a, b = problems
    folder = quality_results.folder(tmp_path / "results", "report", 2, 0)
    _write(
        folder,
        "device",
        RESULT,
        [_committed(a.task_id, _right(a), "passed"), _committed(b.task_id, _wrong(b), "ValueError")],
    )
    _write(
        folder,
        "cloud",
        RESULT,
        [_committed(a.task_id, _right(a), "passed", 40), _committed(b.task_id, _right(b), "passed", 40)],
    )
    _write(
        folder,
        "policy:quality",
        RESULT,
        [_committed(a.task_id, _right(a), "passed"), _committed(b.task_id, _right(b), "passed", 20)],
    )
    explored = "policy:quality+quality_threshold=0.8"
    _write(folder, explored, RESULT, [_committed(p.task_id, _wrong(p), "ValueError") for p in problems])
    earlier = [_committed(p.task_id, _wrong(p), "ValueError") for p in problems]
    _write(folder, "policy:disco", RESULT, earlier, gateway="[disco]\nquality_threshold = 0.6\n")
    return tmp_path, problems


def _no_gateway(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("--rescore started a gateway")

    monkeypatch.setattr(quality_bench.Gateway, "_start", refuse)
    monkeypatch.setattr("app.launcher.start_gateway", refuse)


def test_rescore_reproduces_the_committed_verdicts_and_table_without_a_gateway(committed, monkeypatch, capsys):
    tmp_path, problems = committed
    _no_gateway(monkeypatch)
    out = tmp_path / "out"
    args = ["--half", "report", "--sample", "2", "--rescore", "--results", str(tmp_path / "results")]
    args += ["--cache", str(tmp_path / "no-cache"), "--out", str(out)]
    configs = "device,cloud,policy:quality,policy:quality+quality_threshold=0.8,policy:disco"
    assert quality_bench.main([*args, "--configs", configs]) == 0
    assert not (tmp_path / "no-cache").exists()  # read nothing but the committed answers
    report = (out / "quality.md").read_text()
    assert "every committed verdict reproduced (5 rows)" in report
    results = json.loads((out / "quality.json").read_text())
    rows = {s["config"]: s for s in results["summaries"]}
    assert [(rows[n]["passed"], rows[n]["standing"]) for n in ("device", "cloud", "policy:quality", ORACLE)] == [
        (1, RESULT), (2, RESULT), (2, RESULT), (2, BOUND)
    ]  # fmt: skip
    assert rows["policy:quality+quality_threshold=0.8"]["standing"] == EXPLORATION  # whatever its file says
    assert rows["policy:disco"]["standing"] == FORMER  # a shipped row, but of another config than today's
    assert "Asked with another gateway config than today's shipped one: policy:disco." in report
    quality = rows["policy:quality"]
    assert quality["bill_ratio"] == pytest.approx(20 / 80) and quality["migrations_by_reason"] == {"quality": 1}
    assert rows[ORACLE]["bill_ratio"] == pytest.approx(40 / 80)  # the cloud pays only for the problem it alone solves
    assert quality["random_at_same_bill"] == pytest.approx(0.5 + 0.25 * 0.5)
    assert results["rescore"] == {label: [] for label in configs.split(",")}
    assert f"τ = {shipped().quality_threshold:g}" in report  # the shipped τ, as read

    # A committed verdict the sandbox does not reproduce is named, and the run fails.
    folder = quality_results.folder(tmp_path / "results", "report", 2, 0)
    row = json.loads((folder / "device.json").read_text())
    row["answers"][1]["verdict"], row["answers"][1]["passed"] = "passed", True
    (folder / "device.json").write_text(json.dumps(row))
    assert quality_bench.main([*args, "--configs", "device"]) == 1
    assert f"device: {problems[1].task_id}: passed -> ValueError" in (out / "quality.md").read_text()
    with pytest.raises(SystemExit, match=r"no committed answer for policy:quality\+stream=false on HumanEval/\d+"):
        quality_bench.main([*args, "--configs", "policy:quality+stream=false"])
    capsys.readouterr()


def test_a_run_writes_each_rows_results_in_order_and_small_and_they_rescore_alike(committed, tmp_path):
    _, problems = committed
    source = quality_results.CommittedAnswers(quality_results.folder(tmp_path / "results", "report", 2, 0))
    answered = quality_bench.Answered(None, quality_bench.Limits())
    config = parse_configs("policy:quality")[0]
    records, scored = answered.records(config, list(reversed(problems)), source)
    header = {"standing": RESULT, "description": "quality"}
    path = quality_results.write_row(tmp_path / "again", config.label, header, records, scored)
    assert path.name == "policy-quality.json"
    data = json.loads(path.read_text())
    assert [a["task_id"] for a in data["answers"]] == [p.task_id for p in problems]  # HumanEval's order
    assert (data["passed"], data["standing"], data["configuration"]) == (2, RESULT, "policy:quality")
    escalated = {"cloud": {"prefill": 130, "decode": 20}, "device": {"prefill": 120, "decode": 20}}
    assert data["answers"][1]["tokens"] == escalated
    assert "prompt" not in json.dumps(data)  # a task id names the problem; no prompt is repeated
    first = path.read_bytes()
    assert quality_results.write_row(tmp_path / "again", config.label, header, records, scored).read_bytes() == first
    rescored = quality_results.CommittedAnswers(tmp_path / "again")
    again = quality_bench.Answered(None, quality_bench.Limits())
    assert rescored.changes(config.label, again(config, problems, rescored)) == []
    # Past the size limit the same row is written gzipped, and read back the same.
    records = [{**r, "answer": r["answer"] + "#" * quality_results.GZIP_ABOVE} for r in records]
    zipped = quality_results.write_row(tmp_path / "again", config.label, header, records, scored)
    assert zipped.name == "policy-quality.json.gz" and not path.exists()
    assert json.loads(gzip.decompress(zipped.read_bytes()))["answers"][0]["answer"] == records[1]["answer"]
    assert quality_results.read_row(tmp_path / "again", config.label)["passed"] == 2


def test_a_disco_b_rows_budget_never_outlives_its_row(monkeypatch):
    gateway = quality_bench.Gateway("unused", budget=0.5)
    gateway.process, puts = object(), []
    monkeypatch.setattr(gateway, "_put_budget", lambda patch: puts.append(patch["budget"]))
    monkeypatch.setattr(gateway, "_answer", lambda config, problem: {})
    for token in ("disco:0.25", "disco:0.25", "policy:disco", "disco:0.5", "device"):
        gateway(parse_configs(token)[0], None)
    assert puts == [0.25, 0.5]  # back to the shipped b for the shipped DiSCo row
