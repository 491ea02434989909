"""The threshold read off the device's answers (app/tools/bench/quality_tune.py): the policy's own rule, token by
token, and the tune table built from it."""

from __future__ import annotations

import pytest

from app.tools.bench.quality_bench import main as bench_quality
from app.tools.bench.quality_tune import auroc, escalation_point, lowest_window_mean, tune

SURE, UNSURE = 0.99, 0.3


def test_an_answer_escalates_where_the_policys_window_mean_first_falls_below_tau():
    tops = [SURE] * 20 + [UNSURE] * 8 + [SURE] * 10
    assert escalation_point(tops, 0.5) is None  # 16-token window: 8 unsure tokens bring it to 0.77 at lowest
    assert lowest_window_mean(tops) == pytest.approx((8 * SURE + 8 * UNSURE) / 16)
    tau = 0.9
    point = escalation_point(tops, tau)
    assert point is not None and 20 < point <= 28  # within the unsure stretch, never before it
    window = tops[max(0, point - 16) : point]
    assert sum(window) / len(window) < tau <= sum(tops[point - 17 : point - 1]) / 16  # the first token below τ
    assert escalation_point(tops, 0.0) is None and escalation_point([UNSURE] * 10, 1.0) == 4  # warmup: 4 tokens


def test_the_tune_table_counts_escalations_and_scores_them_as_the_clouds_answers():
    tops = [[SURE] * 30, [SURE] * 10 + [UNSURE] * 20, [UNSURE] * 30]
    device, cloud = [True, False, False], [True, True, False]
    lines, data = tune(["a", "b", "c"], device, cloud, tops, [0.2, 0.5])
    assert data["auroc"] == 1.0 == auroc([0.1, 0.2], [0.9])
    low, high = data["rows"]
    assert (low["escalated"], low["estimated_passed"]) == (0, 1)  # nothing moves: the device's own 1/3
    assert (high["escalated"], high["failures_escalated"], high["estimated_passed"]) == (2, 2, 2)  # b is rescued
    assert lines[-1].startswith("| 0.5 | 2/3 | 2/2 |") and lines[-1].endswith("2/3 (66.7 %) |")


def test_thresholds_are_tuned_on_the_tune_half_only(tmp_path):
    with pytest.raises(SystemExit, match="tune half only"):
        bench_quality(["--half", "report", "--tune-thresholds", "0.8", "--offline", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--tune-thresholds: '1\.5': must be a number in"):
        bench_quality(["--half", "tune", "--tune-thresholds", "1.5", "--offline", "--out", str(tmp_path)])
