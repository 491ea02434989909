"""`tandem bench quality`'s parts: the sandbox that runs a model's program, HumanEval's scoring, the statistics, the
answer cache and the configurations, the scores and the report (app/tools/bench/: sandbox.py, humaneval.py,
quality_stats.py, quality_bench.py, quality_scores.py, quality_report.py)."""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import socket
from pathlib import Path

import pytest

from app.tools.bench import humaneval, quality_bench, quality_report, quality_scores
from app.tools.bench.quality_bench import AnswerCache, Config, collect, parse_configs
from app.tools.bench.quality_scores import random_router, score
from app.tools.bench.quality_stats import discordant, mcnemar_exact, paired_bootstrap, wilson
from app.tools.bench.sandbox import Limits, network_isolation, run

FAST = Limits(wall_s=20, cpu_s=2, memory_bytes=512 << 20, file_bytes=1 << 16)

# -- the sandbox -------------------------------------------------------------------------------------------------


def test_a_program_that_runs_to_its_end_passes_and_one_that_raises_fails():
    assert run("assert sum(range(4)) == 6", FAST).passed
    failed = run("assert 1 == 2, 'wrong'", FAST)
    assert (failed.passed, failed.verdict) == (False, "AssertionError")
    assert "wrong" in failed.detail


def test_a_program_that_loops_forever_is_stopped_by_its_cpu_limit():
    # A wall-clock limit far above the CPU limit: on a busy shared box one CPU second may take many.
    outcome = run("while True:\n    pass\n", Limits(wall_s=300, cpu_s=1))
    assert (outcome.passed, outcome.verdict) == (False, "CPU limit")  # the CPU limit stopped it, not the wall clock


def test_a_program_that_sleeps_forever_is_stopped_by_its_wall_clock_limit():
    outcome = run("import time\ntime.sleep(3600)\n", Limits(wall_s=1.5, cpu_s=2))
    assert (outcome.passed, outcome.verdict) == (False, "wall-clock limit")


def test_a_program_that_allocates_far_past_its_limit_fails_with_a_memory_error():
    outcome = run("blob = bytearray(16 << 30)\n", FAST)  # 16 GiB against a 512 MiB address space
    assert (outcome.passed, outcome.verdict) == (False, "MemoryError")


def test_a_program_cannot_write_outside_its_scratch_directory(tmp_path):
    outside = tmp_path / "outside.txt"
    moved = tmp_path / "kept.txt"
    moved.write_text("mine")
    for source in (
        f"open({str(outside)!r}, 'w').write('escaped')",
        f"import os\nos.close(os.open({str(outside)!r}, os.O_CREAT | os.O_WRONLY))",
        f"import os\nos.remove({str(moved)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
    ):
        outcome = run(source, FAST)
        assert (outcome.passed, outcome.verdict) == (False, "PermissionError"), source
    assert not outside.exists()
    assert moved.read_text() == "mine"
    # Its own directory is its to use.
    assert run("open('notes.txt', 'w').write('x')\nimport os\nos.remove('notes.txt')", FAST).passed


def test_a_program_cannot_reach_the_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        outcome = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)", FAST)
        assert not outcome.passed
        assert outcome.verdict in ("PermissionError", "OSError", "ConnectionRefusedError")
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()
    assert network_isolation() == "namespace"  # the namespace itself is tested in tests/unit/test_sandbox.py


def test_a_program_cannot_start_processes_or_fake_its_success():
    assert run("import subprocess\nsubprocess.run(['true'])", FAST).verdict == "PermissionError"
    assert run("import os\nos.system('true')", FAST).verdict == "PermissionError"
    # Ending early with status 0 is not running the tests to their end.
    assert run("import sys\nsys.exit(0)", FAST).verdict == "SystemExit"
    ended = run("import os\nos._exit(0)", FAST)
    assert not ended.passed and ended.verdict.startswith("ended without finishing")


def test_the_bench_process_is_unharmed_by_what_its_programs_do():
    before = (os.getcwd(), dict(os.environ))
    for source in ("while True: pass", "x = bytearray(16 << 30)", "import os\nos.chdir('/')\nos.environ.clear()"):
        run(source, FAST)
    assert (os.getcwd(), dict(os.environ)) == before
    assert run("assert True", FAST).passed


# -- HumanEval ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def problems() -> list[humaneval.Problem]:
    return humaneval.load()


def test_the_problems_are_the_pinned_164(problems, tmp_path):
    assert len(problems) == 164
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    changed = tmp_path / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.decompress(humaneval.data_path().read_bytes()).splitlines()]
    rows[0]["test"] = "def check(candidate):\n    pass\n"
    changed.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    with pytest.raises(SystemExit, match="expected " + humaneval.DATA_SHA256):
        humaneval.load(changed)


def test_the_held_out_split_is_the_seeded_half_fixed_in_code(problems):
    assert humaneval.TUNE_HALF == set(random.Random(38).sample(range(164), 82))
    tune, report = humaneval.half(problems, "tune"), humaneval.half(problems, "report")
    assert len(tune) == len(report) == 82
    assert {p.task_id for p in tune}.isdisjoint(p.task_id for p in report)
    assert humaneval.sample(problems, 10, seed=3) == humaneval.sample(problems, 10, seed=3)
    assert len(humaneval.sample(problems, 10, seed=3)) == 10
    assert humaneval.sample(problems, 10, seed=3) != humaneval.sample(problems, 10, seed=4)


def test_the_prompt_is_evalplus_instruct_prompt_with_its_response_prefix(problems):
    user, assistant = humaneval.messages(problems[0])
    assert user["content"].startswith(humaneval.INSTRUCTION + "\n```\nfrom typing import List\n")
    assert user["content"].endswith('"""\n```\n')
    assert assistant == {
        "role": "assistant",
        "content": "Below is a Python script with a self-contained function that solves the problem and passes "
        "corresponding tests:\n```python\n",
        "prefix": True,
    }


def _record(task_id: str, answer: str) -> dict:
    return {
        "task_id": task_id,
        "answer": answer,
        "finish_reason": "stop",
        "ttft_s": 0.5,
        "seconds": 3.0,
        "cost_usd": {"device": 1e-5, "cloud": 0.0},
        "trace": {
            "endpoints": [{"endpoint": "device", "decode_tokens": 40, "prefill_tokens": 120}],
            "migrations": [],
        },
    }


CORRECT_0 = """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1 :]:
            if abs(a - b) < threshold:
                return True
    return False
```

This function compares every pair of numbers.
"""

WRONG_0 = """def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for a, b in zip(numbers, numbers[1:]))


print(has_close_elements([1.0, 2.0], 0.5))
assert has_close_elements([1.0, 2.0], 0.5) is True
"""


def test_a_known_correct_and_a_known_wrong_answer_to_humaneval_0(problems):
    correct = score(_record("HumanEval/0", CORRECT_0), problems[0], FAST)
    assert (correct.passed, correct.verdict) == (True, "passed")
    # Only adjacent pairs: wrong on the tests' unsorted lists. The answer's own failing assert is not part of the
    # program (only its imports, functions, classes and assignments are), so the verdict is the tests'.
    wrong = score(_record("HumanEval/0", WRONG_0), problems[0], FAST)
    assert (wrong.passed, wrong.verdict) == (False, "AssertionError")
    assert (correct.decode, correct.prefill, correct.cost_device) == ({"device": 40}, {"device": 120}, 1e-5)


def test_the_extractor_tolerates_the_small_models_quirks(problems):
    body = "def f(x):\n    return x + 1\n"
    assert humaneval.extract_code(body + "```\nprose after the block\n") == "def f(x):\n    return x + 1"
    assert humaneval.extract_code("```\npython\n" + body) == "def f(x):\n    return x + 1"  # the 0.5B's fence
    cut_off = body + "\ndef g(y):\n    return [y,\n"  # max_tokens ended it mid-expression
    assert humaneval.extract_code(cut_off) == "def f(x):\n    return x + 1"
    assert humaneval.extract_code("Sorry, I cannot help with that.") == ""
    # An empty answer leaves the problem's stub, which returns None: a failure, never a crash of the bench.
    assert not score(_record("HumanEval/2", ""), problems[2], FAST).passed


# -- statistics ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("passed", "n", "low", "high"),
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (Wilson score, no continuity correction).
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_interval_on_published_examples(passed, n, low, high):
    got = wilson(passed, n)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_wilson_interval_edges():
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(10, 10)
    assert high == pytest.approx(1.0) and low == pytest.approx(10 / (10 + 1.959963984540054**2))


def test_mcnemar_exact_by_hand():
    # 1 against 9 discordant: P(X <= 1 | n = 10, 1/2) = 11/1024, two-sided 22/1024.
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact(9, 1) == pytest.approx(22 / 1024)
    # 0 against 5: 2 / 32.
    assert mcnemar_exact(0, 5) == pytest.approx(1 / 16)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    # The 43 problems only the cloud solves against 11 only the device does.
    assert mcnemar_exact(11, 43) == pytest.approx(2 * sum(math.comb(54, i) for i in range(12)) / 2**54)
    assert mcnemar_exact(11, 43) < 1e-4


def test_paired_results_count_discordant_problems_and_bootstrap_the_difference():
    a = [True, True, False, True, False, True, True, False]
    b = [True, False, False, False, True, True, False, False]
    assert discordant(a, b) == (3, 1)
    low, high = paired_bootstrap(a, b, seed=1)
    assert -1 <= low <= 2 / 8 <= high <= 1
    assert paired_bootstrap(a, b, seed=1) == (low, high)
    assert paired_bootstrap([True] * 5, [False] * 5) == (1.0, 1.0)
    assert paired_bootstrap(a, a) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same problems"):
        discordant(a, b[:-1])


# -- the cache and the configurations ------------------------------------------------------------------------------


def test_a_second_scoring_run_never_asks_the_gateway(problems, tmp_path):
    chosen = problems[:3]
    setup = quality_bench.setup_of("device-model", "cloud-model")
    asked = []

    def ask(config: Config, problem: humaneval.Problem) -> dict:
        asked.append((config.name, config.cut, problem.task_id))
        return {**_record(problem.task_id, CORRECT_0), "config": config.name, "cut": config.cut}

    configs = [Config("device", "endpoint", endpoint="device"), quality_bench.forced("device", 16)]
    first = {c: collect(c, chosen, AnswerCache(tmp_path, setup), ask) for c in configs}
    assert len(asked) == 6

    def never(config, problem):
        raise AssertionError("the gateway was asked")

    cache = AnswerCache(tmp_path, setup)
    assert {c: collect(c, chosen, cache, never) for c in configs} == first
    assert {c: collect(c, chosen, cache, None) for c in configs} == first  # --offline
    # Another cut point, or another set-up (models, prompt, limits), is another answer.
    with pytest.raises(SystemExit, match="no cached answer for device>cloud@32 on HumanEval/0"):
        collect(quality_bench.forced("device", 32), chosen, cache, None)
    with pytest.raises(SystemExit, match="no cached answer"):
        collect(configs[0], chosen, AnswerCache(tmp_path, {**setup, "max_tokens": 256}), None)


def test_configurations_parse_and_refuse_what_they_do_not_know():
    names = [c.name for c in parse_configs("device,cloud,disco:0.25,random:0.5,random:matched,cloud>device@64")]
    assert names == ["device", "cloud", "disco-b0.25", "random-s0.50", "random-matched", "cloud>device"]
    assert parse_configs("device>cloud@16")[0].cut == 16
    [quality] = parse_configs("policy:quality+threshold=0.3+signal=entropy")
    assert (quality.name, quality.kind) == ("policy:quality+threshold=0.3+signal=entropy", "policy")
    assert dict(quality.options) == {"policy": "quality", "threshold": 0.3, "signal": "entropy"} and quality.streamed
    [whole] = parse_configs("policy:quality+quality_threshold=0.8+stream=false")  # the request's field, not tandem's
    assert dict(whole.options) == {"policy": "quality", "quality_threshold": 0.8} and not whole.streamed
    bad_configs = ("disco:1.5", "disco:half", "random:-0.1", "gpu", "device>device@16", "cloud>device@0", "policy:q+t")
    for bad in (*bad_configs, "policy:quality+stream=no"):
        with pytest.raises(SystemExit, match="--configs"):
            parse_configs(bad)


def test_the_random_router_answers_with_the_endpoint_it_chose(problems):
    device = [score(_record(p.task_id, WRONG_0), problems[0], FAST) for p in problems[:6]]
    cloud = [score(_record(p.task_id, CORRECT_0), problems[0], FAST) for p in problems[:6]]
    assert all(r.routed_to == "device" for r in random_router(0.0, device, cloud, seed=0))
    assert all(r.routed_to == "cloud" and r.passed for r in random_router(1.0, device, cloud, seed=0))
    half = random_router(0.5, device, cloud, seed=0)
    assert half == random_router(0.5, device, cloud, seed=0)
    assert all(r.passed == (r.routed_to == "cloud") for r in half)


def test_a_matched_random_router_follows_every_routing_rows_cloud_share(problems, tmp_path):
    chosen = problems[:4]
    cache = AnswerCache(tmp_path, quality_bench.setup_of("device-model", "cloud-model"))

    def ask(config: Config, problem: humaneval.Problem) -> dict:  # DiSCo's: 30 cloud tokens of 40; the policy's: 20
        record = {**_record(problem.task_id, CORRECT_0), "config": config.name, "cut": config.cut}
        if config.name == "cloud":
            record["cost_usd"] = {"device": 0.0, "cloud": 1e-4}
        if config.kind != "endpoint":
            on_cloud = 30 if config.kind == "disco" else 20
            record["cost_usd"] = {"device": 1e-5, "cloud": 1e-4 * on_cloud / 40}
            record["trace"] = {
                "endpoints": [
                    {"endpoint": "device", "decode_tokens": 40 - on_cloud, "prefill_tokens": 120},
                    {"endpoint": "cloud", "decode_tokens": on_cloud, "prefill_tokens": 130},
                ],
                "migrations": [{"at_token": 40 - on_cloud, "from": "device", "to": "cloud", "reason": "quality"}],
            }
        return record

    configs = parse_configs("device,cloud,disco:0.5,policy:quality+threshold=0.8")
    for config in configs:
        collect(config, chosen, cache, ask)
    matched = parse_configs("device,cloud,disco:0.5,policy:quality+threshold=0.8,random:matched")
    answered = quality_bench.Answered(None, FAST)
    summaries = quality_bench._frontier(matched, lambda c: answered(c, chosen, cache), seed=0)
    assert [s["config"] for s in summaries][-3:] == ["oracle router", "random-s0.75", "random-s0.50"]
    assert [s.get("matched_to") for s in summaries][-2:] == ["disco-b0.5", "policy:quality+threshold=0.8"]
    assert [s["random_at_same_bill"] for s in summaries] == [0.25] * len(summaries)  # both endpoints: 1 of 4
    assert [s["bill_ratio"] for s in summaries[:4]] == [0.0, 1.0, 0.75, 0.5]  # the bill against cloud-only's


def test_the_report_pairs_each_configuration_with_the_endpoints(problems, tmp_path):
    device = [score(_record(p.task_id, WRONG_0), problems[0], FAST) for p in problems[:4]]
    cloud = [score(_record(p.task_id, CORRECT_0), problems[0], FAST) for p in problems[:4]]
    summaries = [
        quality_scores.summary(name, rows, {"device": device, "cloud": cloud}, seed=0)
        for name, rows in (("device", device), ("cloud", cloud))
    ]
    assert summaries[0]["paired"]["cloud"]["difference"] == -1.0
    assert summaries[0]["paired"]["cloud"]["mcnemar_p"] == pytest.approx(2 / 16)
    assert summaries[1]["pass_at_1"] == 1.0 and "cloud" not in summaries[1]["paired"]
    lines = quality_report.table(summaries)
    assert lines[2].startswith("| device | — | 0.0 (0/4)") and lines[3].startswith("| cloud | — | 100.0 (4/4)")
    assert quality_report.model_time(summaries) == (
        "Model time, as the answers were asked: device 12 s (3.0 s an answer, 15.6 tokens/s); cloud 12 s (3.0 s an "
        "answer, 15.6 tokens/s)."
    )
    quality_report.plot_frontier(summaries, tmp_path / "quality.png")
    assert Path(tmp_path / "quality.png").read_bytes()[:4] == b"\x89PNG"


def test_a_random_router_at_the_same_cloud_bill_scores_between_the_endpoints_in_expectation():
    device = {"pass_at_1": 0.5, "cloud_cost_usd_per_answer": 0.0}
    cloud = {"pass_at_1": 0.7, "cloud_cost_usd_per_answer": 200e-6}
    routed = {"pass_at_1": 0.66, "cloud_cost_usd_per_answer": 50e-6}  # a quarter of cloud-only's bill
    assert quality_scores.random_at_same_bill(routed, device, cloud) == pytest.approx(0.55)
    assert quality_scores.random_at_same_bill(cloud, device, cloud) == pytest.approx(0.7)
    assert quality_scores.random_at_same_bill({**routed, "cloud_cost_usd_per_answer": 1.0}, device, cloud) == 0.7
    assert quality_scores.random_at_same_bill(routed, device, {**cloud, "cloud_cost_usd_per_answer": 0.0}) is None


def test_appendix_d_checks_the_bound_and_names_the_problems_outside_it(problems):
    ids = [p.task_id for p in problems[:4]]

    def rows(passes: str, migrated: bool = False) -> list:
        return [
            quality_scores.Scored(t, c == "1", "passed" if c == "1" else "AssertionError", 0.0, 0.0, 0.5, 1.0,
                                 {}, {}, [(16, "device", "cloud", "forced")] if migrated else [], "stop")
            for t, c in zip(ids, passes, strict=True)
        ]  # fmt: skip

    table = {"device": rows("1100"), "cloud": rows("1010")}  # device 2/4, cloud 2/4: both pass 0, neither 3
    table["device>cloud@16"] = rows("1001", migrated=True)  # 2/4: within; problem 3 passes where both fail
    table["cloud>device@16"] = rows("0110", migrated=True)  # 2/4: within; problem 0 fails where both pass
    lines, data = quality_report.appendix_d(table, (16,))
    assert [r["bound_holds"] for r in data["rows"]] == [True, True]
    assert data["rows"][0]["above_both"] == ["HumanEval/3"] and data["rows"][1]["below_both"] == ["HumanEval/0"]
    assert "bound check device>cloud@16: 2 <= 2 <= 2: holds" in lines
    table["device>cloud@16"] = rows("1111", migrated=True)
    lines, data = quality_report.appendix_d(table, (16,))
    assert not data["rows"][0]["bound_holds"]
    assert "bound check device>cloud@16: 2 <= 4 <= 2: does not hold" in lines
