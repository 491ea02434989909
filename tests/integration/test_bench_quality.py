"""`tandem bench quality` end to end on SmolLM2-135M (device and stand-in cloud alike: seconds an answer): a real
gateway asked with the openai SDK, one HumanEval problem of the tune half answered by the device alone, the cloud
alone and the cloud moved to the device after 8 tokens, scored in the sandbox, written as JSON, markdown and PNG; a
second run finds every answer in its cache and starts no gateway, and reads the quality policy's thresholds off the
device's answer through the device model; each row's per-problem results are written, and `--rescore` grades them
again with the cache gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from app.cli import main as tandem
from tests.integration.hf_fixtures import SMOL, gguf_or_skip


def test_bench_quality_answers_scores_and_rescores_from_its_cache(tmp_path: Path, capsys) -> None:
    gguf_or_skip(SMOL)
    cache, out = tmp_path / "cache", tmp_path / "out"
    args = ["bench", "quality", "--half", "tune", "--sample", "1", "--configs", "device,cloud,cloud>device@8"]
    args += [
        "--device-model",
        SMOL,
        "--cloud-model",
        SMOL,
        "--cache",
        str(cache),
        "--results",
        str(tmp_path / "results"),
    ]
    assert tandem([*args, "--out", str(out)]) == 0
    assert "starting the gateway" in capsys.readouterr().err

    results = json.loads((out / "quality.json").read_text())
    rows = {s["config"]: s for s in results["summaries"]}
    assert list(rows) == ["device", "cloud", "cloud>device@8", "oracle router"] and len(results["problems"]) == 1
    device, moved = rows["device"], rows["cloud>device@8"]
    assert device["problems"] == moved["problems"] == 1
    assert device["decode_tokens"]["cloud"] == 0 and device["decode_tokens"]["device"] > 0
    assert device["cloud_cost_usd_per_answer"] == 0 and device["unified_cost_usd_per_answer"] > 0  # the ledger's
    assert moved["answers_migrated"] == 1 and moved["migrations_by_reason"] == {"forced": 1}
    assert moved["decode_tokens"]["cloud"] == 8 and moved["cloud_cost_usd_per_answer"] > 0
    assert sum(device["verdicts"].values()) == 1 and device["ttft_s_median"] > 0
    task = results["problems"][0].replace("/", "-")
    [setup] = [p for p in cache.iterdir() if p.is_dir()]
    record = json.loads((setup / "cloud-to-device" / f"{task}@8.json").read_text())
    [migration] = record["trace"]["migrations"]
    assert (migration["at_token"], migration["from"], migration["to"], migration["reason"]) == (
        8,
        "cloud",
        "device",
        "forced",
    )
    assert (setup / "device" / f"{task}@0.json").is_file()
    assert "| device |" in (out / "quality.md").read_text()
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"

    again = tmp_path / "again"
    assert tandem([*args, "--tune-thresholds", "0,1", "--out", str(again)]) == 0  # all cached: no gateway
    assert "starting the gateway" not in capsys.readouterr().err
    tuned = json.loads((again / "quality.json").read_text())["tune"]
    never, at_once = tuned["rows"]
    assert tuned["problems"] == results["problems"] and 0 < tuned["lowest_window_mean"][0] < 1
    assert (never["escalated"], at_once["escalated"], at_once["median_token"]) == (0, 1, 4)  # τ = 1: after warmup
    assert never["estimated_passed"] == device["passed"] and at_once["estimated_passed"] == rows["cloud"]["passed"]
    rescored = json.loads((again / "quality.json").read_text())["summaries"]
    assert [(s["passed"], s["verdicts"], s["decode_tokens"]) for s in rescored] == [
        (s["passed"], s["verdicts"], s["decode_tokens"]) for s in results["summaries"]
    ]

    # Each asked row's per-problem results, and --rescore grading them again from those files alone.
    committed = tmp_path / "results" / "tune-sample1-seed0"
    assert sorted(p.name for p in committed.iterdir()) == ["cloud-to-device@8.json", "cloud.json", "device.json"]
    [answer] = json.loads((committed / "cloud-to-device@8.json").read_text())["answers"]
    assert answer["tokens"]["cloud"]["decode"] == 8 and answer["migrations"][0]["reason"] == "forced"
    assert answer["task_id"] == results["problems"][0] and answer["cost_usd"]["cloud"] > 0
    shutil.rmtree(cache)
    assert tandem([*args, "--rescore", "--out", str(tmp_path / "rescored")]) == 0
    assert "starting the gateway" not in capsys.readouterr().err and not cache.exists()
    again = json.loads((tmp_path / "rescored" / "quality.json").read_text())
    assert again["rescore"] == {"device": [], "cloud": [], "cloud>device@8": []}
    assert [(s["passed"], s["verdicts"], s["decode_tokens"]) for s in again["summaries"]] == [
        (s["passed"], s["verdicts"], s["decode_tokens"]) for s in results["summaries"]
    ]
