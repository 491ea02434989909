"""`tandem bench worker-compute`: the random-weight build, the passes it times, and the Tables 4/5 projection."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from app.tools.bench import worker_compute as wc
from clients.hat.split import split_model

TINY = {
    "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_random_model_has_the_configs_architecture_and_its_seed_decides_the_weights(config) -> None:
    a = wc.random_model(config, torch.float32, torch.device("cpu"), seed=0)
    b = wc.random_model(config, torch.float32, torch.device("cpu"), seed=0)
    c = wc.random_model(config, torch.float32, torch.device("cpu"), seed=1)
    assert a.config.model_type == "qwen2" and len(a.model.layers) == 4 and a.config.num_key_value_heads == 2
    w = [m.model.layers[2].mlp.up_proj.weight for m in (a, b, c)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])


def test_timed_pieces_leave_every_session_at_its_context(config) -> None:
    split = split_model(wc.random_model(config, torch.float32, torch.device("cpu")), 1)
    bench = wc.StackBench(split.middle.stack, 32, 4, seed=0)
    cache = bench.session(40, fill=16)
    assert len(cache) == 40
    assert len(bench.piece(cache, 5, repeats=3)) == 3 and len(cache) == 40
    points = bench.tau_points([4, 8], [0, 20], repeats=2)
    assert [(x, y) for x, y, _ in points] == [(4, 0), (8, 0), (4, 20), (8, 20)] and all(s > 0 for *_, s in points)


def test_measure_checks_the_ragged_forward_and_reports_every_shape(config) -> None:
    args = wc.build_parser().parse_args(
        ["--config", str(config), "--device", "cpu", "--m", "1", "--rows", "1", "2", "8", "--contexts", "0", "24",
         "--tau-x", "4", "16", "32", "--tau-y", "0", "24", "--sessions", "1", "3", "--batch-context", "8",
         "--repeats", "2", "--device-half"]
    )  # fmt: skip
    res = wc.measure(args)
    assert res["setup"]["middle_layers"] == 3 and res["self_check_relative_difference"] < 1e-3
    assert list(res["middle_ms"]) == ["0", "24"] and list(res["middle_ms"]["24"]) == ["1", "2", "8"]
    assert [b["sessions"] for b in res["batched"]] == [1, 3]
    assert len(res["middle_tau"]["points"]) == 6 and set(res["input_tau"]["fit"]) == {"a", "b", "c", "d"}
    assert "| 24 |" in wc.report_measure(res)


def _run(name: str, ms: dict[int, float], tau: dict[str, float]) -> dict:
    return {
        "setup": {"device_name": name},
        "middle_ms": {"128": {str(r): t for r, t in ms.items()}, "2048": {str(r): 10 * t for r, t in ms.items()}},
        "middle_tau": {"fit": tau},
        "input_tau": {"fit": {"a": 0.01, "b": 0.0007, "c": 0.0, "d": 0.0}},
    }


HAT = {
    "setup": {"link_parsed": {"latency": 0.01, "up_bandwidth": 7.5e6}},
    "components": {
        "worker_ms": {"middle_1_tokens": 170.0, "middle_2_tokens": 170.0, "middle_4_tokens": 170.0},
        "token_bytes": 3584,
        "link_ms": {"1_tokens": {"download": 10.0}},
        "device_ms": {"lm_head_1_rows": 40.0, "lm_head_argmax_1_rows": 15.0},
    },
    "table4": {
        "U-shape": {"tbt_ms_median": 250.0, "stats": {
            "ms_per_round": 250.0, "drafted_per_round": 0.0, "accept_length": 1.0,
            "profile_ms_per_round": {"input": 14.0, "drafts": 1.0, "head": 40.0, "link": 20.5, "worker": 170.0,
                                     "other": 4.5, "device": 59.5, "ahead": 0.0, "bottleneck": "worker"}}},
        "SD": {"tbt_ms_median": 150.0, "stats": {
            "ms_per_round": 320.0, "drafted_per_round": 2.0, "accept_length": 2.0,
            "profile_ms_per_round": {"input": 42.0, "drafts": 6.0, "head": 70.0, "link": 21.5, "worker": 175.0,
                                     "other": 5.5, "device": 123.5, "ahead": 0.0, "bottleneck": "worker"}}},
        "decode_speedup": 1.67,
    },
}  # fmt: skip


def test_rows_ms_interpolates_at_the_nearest_measured_context() -> None:
    run = _run("x", {1: 100.0, 2: 110.0, 4: 150.0}, {})
    assert wc.rows_ms(run, 3, 100) == pytest.approx(130.0)
    assert wc.rows_ms(run, 1, 4000) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="outside"):
        wc.rows_ms(run, 5, 128)


def test_tbt_projection_swaps_only_the_workers_share_of_the_runs_own_rounds() -> None:
    """Out: the worker's share of the hat run's own rounds (its profile); in: the other worker's pass for the
    round's rows. The accept length and the device's and link's shares are that run's, unchanged."""
    gpu = _run("gpu", {1: 10.0, 2: 12.0, 4: 14.0}, {})
    rows = {r["method"]: r for r in wc.project_tbt(HAT, gpu, context=128)}
    assert set(rows) == {"U-shape", "SD"}
    assert rows["U-shape"]["model_tbt_ms_cpu_worker"] == 250.0
    assert rows["U-shape"]["model_tbt_ms_other_worker"] == pytest.approx(250 - 170 + 10)
    assert rows["SD"]["rows_per_round"] == 3.0 and rows["SD"]["accept_length"] == 2.0
    assert rows["SD"]["model_tbt_ms_other_worker"] == pytest.approx((320 - 175 + 13) / 2)
    other = rows["SD"]["other_profile_ms_per_round"]
    assert other == {"input": 42.0, "drafts": 6.0, "head": 70.0, "link": 21.5, "other": 5.5, "worker": 13.0}
    assert rows["SD"]["other_bottleneck"] == "head"  # with a fast worker the device's head is what a round waits on
    assert rows["SD"]["measured_profile_ms_per_round"]["bottleneck"] == "worker"


def test_drafting_ahead_that_outlasts_the_other_workers_wait_is_charged_to_the_round() -> None:
    """A run that drafted 120 ms a round inside a 196.5 ms wait: with a 13 ms pass the wait is 34.5 ms, so 85.5 ms of
    that drafting no longer hides; it is charged to the round, as drafts. With a pass long enough, nothing is."""
    ahead = json.loads(json.dumps(HAT))
    ahead["table4"]["SD"]["stats"]["profile_ms_per_round"]["ahead"] = 120.0
    gpu = _run("gpu", {1: 10.0, 2: 12.0, 4: 14.0}, {})
    sd = {r["method"]: r for r in wc.project_tbt(ahead, gpu, context=128)}["SD"]
    assert sd["ahead_unfit_ms_per_round"] == pytest.approx(120 - (21.5 + 13))
    assert sd["model_tbt_ms_other_worker"] == pytest.approx((320 - 175 + 13 + 85.5) / 2, abs=0.05)
    assert sd["other_profile_ms_per_round"]["drafts"] == pytest.approx(6 + 85.5)
    slow = _run("slow", {1: 150.0, 2: 160.0, 4: 170.0}, {})
    sd = {r["method"]: r for r in wc.project_tbt(ahead, slow, context=128)}["SD"]
    assert sd["ahead_unfit_ms_per_round"] == 0  # a 3-row pass of 165 ms: the wait holds the 120 ms
    assert sd["model_tbt_ms_other_worker"] == pytest.approx((320 - 175 + 165) / 2, abs=0.05)


def test_projection_refuses_a_run_without_the_rounds_profile(tmp_path) -> None:
    """A run from before the profile cannot separate its device's costs from its worker's: refused, not guessed."""
    old = json.loads(json.dumps(HAT))
    del old["table4"]["SD"]["stats"]["profile_ms_per_round"]
    gpu = _run("gpu", {1: 10.0, 2: 12.0, 4: 14.0}, {})
    with pytest.raises(ValueError, match="SD has no rounds' profile"):
        wc.project_tbt(old, gpu, context=128)
    with pytest.raises(ValueError, match="no table4"):
        wc.project_tbt({"setup": {}}, gpu, context=128)
    device, worker = tmp_path / "device.json", tmp_path / "worker.json"
    device.write_text(json.dumps(_run("cpu", {1: 100.0, 4: 150.0}, {})))
    worker.write_text(json.dumps(gpu))
    args = wc.build_parser().parse_args(["--project", str(device), str(worker)])
    with pytest.raises(SystemExit, match="needs --hat"):  # no default to an older run's file
        wc.project(args)


def test_ttft_projection_a_faster_worker_shortens_one_frame_and_chunking_never_loses() -> None:
    slow = _run("cpu", {}, {"a": 0.16, "b": 0.0085, "c": 2e-6, "d": 1e-6})
    fast = _run("gpu", {}, {"a": 0.02, "b": 5e-6, "c": 0.0, "d": 0.0})
    rows = wc.project_ttft(HAT, slow, {"cpu": slow, "gpu": fast}, [128, 1024])
    by = {(r["worker"], r["prompt"]): r for r in rows}
    assert by["gpu", 1024]["one_frame_ms"] < by["cpu", 1024]["one_frame_ms"]
    assert all(r["planned_ms"] <= r["one_frame_ms"] + 1e-6 for r in rows)
    # one frame = the device's input layers, the upload and the worker in sequence, plus the reply's tail: the link's
    # download and the greedy first token's head (the argmax head's time; the fp32 head's in a run without it)
    device = 0.01 + 0.0007 * 1024
    upload = 1024 * 3584 / 7.5e6
    assert by["gpu", 1024]["one_frame_ms"] == pytest.approx(
        1000 * (device + upload + 0.02 + 0.00512 + 0.01 + 0.010 + 0.015), 1e-3
    )
    older = {**HAT, "components": {**HAT["components"], "device_ms": {"lm_head_1_rows": 40.0}}}
    [row] = [r for r in wc.project_ttft(older, slow, {"gpu": fast}, [1024])]
    assert row["one_frame_ms"] == pytest.approx(by["gpu", 1024]["one_frame_ms"] + 25.0, 1e-3)


def test_project_refuses_a_device_run_without_the_input_layers(tmp_path) -> None:
    for name, run in (("cpu.json", {"setup": {}}), ("gpu.json", {"setup": {}}), ("hat.json", HAT)):
        (tmp_path / name).write_text(json.dumps(run))
    args = argparse.Namespace(project=[tmp_path / "cpu.json", tmp_path / "gpu.json"], hat=tmp_path / "hat.json")
    with pytest.raises(SystemExit, match="--device-half"):
        wc.project(args)


def _project(tmp_path, hat: dict, *flags: str) -> dict:
    """`--project` over a CPU device run, a GPU worker run and `hat`, written to tmp_path."""
    files = {"device.json": _run("cpu", {1: 100.0, 4: 150.0}, {"a": 0.16, "b": 0.0085, "c": 2e-6, "d": 1e-6}),
             "gpu.json": _run("gpu", {1: 10.0, 2: 12.0, 4: 14.0}, {"a": 0.02, "b": 5e-6, "c": 0.0, "d": 0.0}),
             "hat.json": hat}  # fmt: skip
    for name, run in files.items():
        (tmp_path / name).write_text(json.dumps(run))
    paths = [str(tmp_path / name) for name in files]
    return wc.project(wc.build_parser().parse_args(["--project", *paths[:2], "--hat", paths[2], *flags]))


def test_project_reports_the_runs_profile_beside_the_projection(tmp_path) -> None:
    hat = json.loads(json.dumps(HAT))
    hat["setup"].update({"created": "2026-11-27T11:00:00+00:00", "cpu": "x", "link": "latency=10ms"})
    res = _project(tmp_path, hat, "--lengths", "128")
    assert res["hat_run"]["created"] == "2026-11-27T11:00:00+00:00"
    text = wc.report_project(res)
    assert "created 2026-11-27T11:00:00+00:00" in text
    assert (
        "| SD | 42.0 → 42.0 | 6.0 → 6.0 | 70.0 → 70.0 | 21.5 → 21.5 | 175.0 → 13.0 | 5.5 → 5.5 | worker → head |"
        in text
    )


def test_a_table4_run_alone_projects_tbt_and_says_ttft_needs_the_components(tmp_path) -> None:
    res = _project(tmp_path, {k: v for k, v in json.loads(json.dumps(HAT)).items() if k != "components"})
    assert res["ttft"] == []
    assert [r["method"] for r in res["tbt"]] == [m for m, row in HAT["table4"].items() if isinstance(row, dict)]
    text = wc.report_project(res)
    assert "| SD |" in text and text.endswith("(no TTFT projection: the hat run has no components section)")
