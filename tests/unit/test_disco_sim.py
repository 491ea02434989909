"""The DiSCo trace simulator: race/delay/migration mechanics, realised budgets, trace I/O, CLI."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from app.tools.bench.disco_replay import SimConfig, primed_estimators, simulate
from app.tools.bench.disco_sim import main
from app.tools.bench.disco_timing import literal_alg2, literal_alg3, timing
from app.tools.bench.disco_trace import (
    SERVER_PRESETS,
    Trace,
    load_trace,
    mape_of_lognormal,
    sigma_from_mape,
    synthetic_trace,
)
from policies.cost import QWEN2_5_0_5B, CostModel, DeviceEnergy, TokenPrices, cloud_prices, usd_per_pflop
from policies.dispatch import DiscoD, DiscoS, DispatchPlan, DispatchPolicy, make_policy


def test_sigma_from_mape_inverts_the_closed_form_and_matches_monte_carlo():
    sigma = sigma_from_mape(0.2455)
    assert mape_of_lognormal(sigma) == pytest.approx(0.2455, abs=1e-9)
    assert sigma == pytest.approx(0.299, abs=0.002)
    # E|1 − m/X| for X log-normal with median m, by sampling.
    x = np.random.default_rng(0).lognormal(0.0, sigma, 400_000)
    assert np.mean(np.abs(1 - 1 / x)) == pytest.approx(0.2455, abs=0.003)
    assert SERVER_PRESETS["gpt"].median == pytest.approx(0.4053, abs=1e-3)


def test_synthetic_trace_is_seeded_and_capped():
    a = synthetic_trace(1000, seed=3)
    b = synthetic_trace(1000, seed=3)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens) and np.array_equal(a.server_ttft, b.server_ttft)
    assert len(a) == 1000 and a.prompt_tokens.min() >= 1 and a.output_tokens.max() <= 128
    assert np.all(np.diff(a.arrival) > 0)
    assert np.median(a.prompt_tokens) == pytest.approx(48, rel=0.1)
    assert np.median(a.server_ttft) == pytest.approx(0.405, rel=0.05)
    # Device TTFT is its line times the request's jitter.
    assert a.device_ttft[5] == pytest.approx(a.device_time(5, int(a.prompt_tokens[5])))


def _costs(lam: float) -> CostModel:
    return CostModel(cloud_prices("gpt-4o-mini"), DeviceEnergy.from_arch(QWEN2_5_0_5B), usd_per_pflop(lam))


@pytest.fixture(scope="module")
def trace_10k() -> tuple[Trace, Trace]:
    return synthetic_trace(10_000, seed=11), synthetic_trace(2000, seed=12)


@pytest.mark.parametrize("b", [0.2, 0.5, 0.8])
def test_realised_budget_ratio_over_10k_requests_within_3_percent(trace_10k, b):
    trace, calib = trace_10k
    cfg = SimConfig()
    est = primed_estimators(calib, cfg)
    for side, lam in (("server", 0.3), ("device", 5.0)):
        costs = _costs(lam)
        assert costs.constrained_side() == side
        res = simulate(
            trace, make_policy("disco"), budget=b, side=side, costs=costs, cfg=cfg, estimators=est, migration=False
        )
        assert res.budget_ratio == pytest.approx(b, abs=0.03), (side, b, res.budget_ratio)


class FixedPlan(DispatchPolicy):
    """Test double: the same plan for every request."""

    name = "fixed"

    def __init__(self, plan: DispatchPlan) -> None:
        super().__init__(random.Random(0))
        self.plan = plan

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        return self.plan


def _hand_trace(rows: list[tuple[int, float, float, int]]) -> Trace:
    """rows: (prompt tokens, server TTFT, device TTFT, output tokens); device line k=0.01, c=0."""
    n = len(rows)
    prompt = np.array([r[0] for r in rows])
    dev = np.array([r[2] for r in rows])
    return Trace(
        name="hand",
        arrival=np.arange(n, dtype=float),
        prompt_tokens=prompt,
        server_ttft=np.array([r[1] for r in rows]),
        device_ttft=dev,
        output_tokens=np.array([r[3] for r in rows]),
        server_ttft_migration=np.full(n, 0.5),
        u=np.full(n, 0.5),
        device_ratio=dev / (0.01 * prompt),
        device_k=0.01,
        device_c=0.0,
    )


SIMPLE = CostModel(TokenPrices(1.0, 2.0), DeviceEnergy(3.0, 4.0), 1.0)  # device prices 3 / 4 per token


def _run(trace: Trace, plan: DispatchPlan, side: str = "server", migration: bool = False, costs=SIMPLE):
    cfg = SimConfig(recompute_every=10_000)
    return simulate(
        trace,
        FixedPlan(plan),
        budget=0.5,
        side=side,
        costs=costs,
        cfg=cfg,
        estimators=primed_estimators(trace, cfg),
        migration=migration,
    )


def test_race_first_token_wins_and_both_prefills_are_booked():
    trace = _hand_trace([(10, 0.5, 0.3, 5), (100, 0.4, 1.3, 5)])
    res = _run(trace, DispatchPlan(True, True, 0.0, "race", ""))
    # Request 1: device first at 0.3 s. Cost: cloud prefill 10·1 + device prefill 10·3 + device decode 5·4 = 60.
    # Request 2: cloud first at 0.4 s. Cost: cloud 100·1 + device prefill 100·3 + cloud decode 5·2 = 410.
    assert res.mean_ttft == pytest.approx((0.3 + 0.4) / 2)
    assert res.cost_per_request == pytest.approx((60 + 410) / 2)
    assert res.budget_ratio == pytest.approx(1.0)  # the cloud saw every prompt token
    cloud = _run(trace, DispatchPlan(True, False, None, "c", ""))
    assert cloud.mean_ttft == pytest.approx(0.45) and cloud.cost_per_request == pytest.approx((20 + 110) / 2)
    dev = _run(trace, DispatchPlan(False, True, None, "d", ""), side="device")
    assert dev.mean_ttft == pytest.approx(0.8) and dev.budget_ratio == pytest.approx(1.0)


def test_delayed_device_start_only_when_the_cloud_is_late():
    # Device starts 0.2 s after the cloud unless the cloud's first token came first.
    trace = _hand_trace([(10, 0.5, 0.25, 1), (100, 0.4, 1.3, 1), (50, 0.1, 0.2, 1)])
    res = _run(trace, DispatchPlan(True, True, 0.2, "w", ""), side="device")
    # 1: cloud 0.5 > 0.2 → device starts, first token at 0.2 + 0.25 = 0.45 < 0.5: device wins.
    # 2: cloud 0.4 > 0.2 → device starts (booked) but finishes at 1.5: cloud wins at 0.4.
    # 3: cloud 0.1 < 0.2 → the device never starts.
    assert res.mean_ttft == pytest.approx((0.45 + 0.4 + 0.1) / 3)
    assert res.budget_ratio == pytest.approx((10 + 100) / 160)  # device prefill tokens / all prompt tokens
    # Costs: 1: 10 + 30 + device decode 4 = 44; 2: 100 + 300 + cloud decode 2 = 402; 3: 50 + 2 = 52.
    assert res.cost_per_request == pytest.approx((44 + 402 + 52) / 3)


def test_migration_moves_a_dear_stream_and_counts_its_tokens():
    # Cloud-only stream, cloud decode 2/token vs device 0.1: one 10-token prompt, 100-token answer.
    costs = CostModel(TokenPrices(0.0, 2.0), DeviceEnergy(0.01, 0.1), 1.0)
    trace = _hand_trace([(10, 0.2, 0.1, 100)] * 30)
    off = _run(trace, DispatchPlan(True, False, None, "c", ""), costs=costs)
    on = _run(trace, DispatchPlan(True, False, None, "c", ""), costs=costs, migration=True)
    assert off.migrated == 0 and on.migrated == 30
    assert on.mean_ttft == off.mean_ttft  # migration never changes the first token
    assert on.cost_per_request < 0.2 * off.cost_per_request
    assert on.delayed_per_migrated <= 1.0  # device prefill of ~11-15 tokens (≈0.15 s) hides under the buffer


def test_migration_into_a_race_losing_device_reuses_its_prompt_and_the_floor_bounds_it():
    # Races: the cloud wins (0.2 s vs the device's 0.5 s), so the device has prefilled the prompt and lost.
    # Cloud decode is dear (2/token), device decode cheap (0.1): migrate, re-prefilling only the delivered tokens.
    costs = CostModel(TokenPrices(0.0, 2.0), DeviceEnergy(1.0, 0.1), 1.0)
    trace = _hand_trace([(40, 0.2, 0.5, 100)] * 30)
    race = DispatchPlan(True, True, 0.0, "race", "")
    off = _run(trace, race, costs=costs)
    on = _run(trace, race, costs=costs, migration=True)
    assert on.migrated == 30
    # Without migration: device prefill 40 + cloud decode 100·2 = 240 per request. With it: device prefill 40
    # (the race) + k delivered tokens (no second prompt prefill) + cloud decode 2k + device decode 0.1·(100 − k).
    per_k = [40 + k + 2 * k + 0.1 * (100 - k) for k in range(1, 100)]
    assert any(on.cost_per_request == pytest.approx(c) for c in per_k)
    # Floor: the race's prefills + all 100 tokens decoded on the device = 40 + 10 = 50.
    assert off.floor_cost_per_request == pytest.approx(50.0) == on.floor_cost_per_request
    assert off.floor_cost_per_request <= on.cost_per_request <= off.cost_per_request == pytest.approx(240.0)


def test_migration_never_fires_when_it_does_not_pay():
    trace, calib = synthetic_trace(1500, seed=5), synthetic_trace(500, seed=6)
    cfg = SimConfig()
    est = primed_estimators(calib, cfg)
    energy = DeviceEnergy(1.0, 1.0)

    def run(costs: CostModel):
        return simulate(
            trace, make_policy("server-only"), budget=1.0, side="server", costs=costs, cfg=cfg, estimators=est,
            migration=True,
        )  # fmt: skip

    # Δc_decode = 1 per token but re-prefilling costs 200 per token: overhead ≥ 200·2 > 1·127 always.
    assert run(CostModel(TokenPrices(0.0, 2.0), DeviceEnergy(200.0, 1.0), 1.0)).migrated == 0
    # Same decode price on both sides: nothing to save.
    assert run(CostModel(TokenPrices(0.0, 1.0), energy, 1.0)).migrated == 0
    # Cheap re-prefill: it pays, so it fires.
    assert run(CostModel(TokenPrices(0.0, 2.0), DeviceEnergy(0.001, 1.0), 1.0)).migrated > 1000


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")


def test_load_recorded_trace_fills_missing_timings(tmp_path: Path):
    rows = [
        {"arrival": 3.0, "prompt_tokens": 40, "server_ttft": 0.5, "device_ttft": 0.45, "output_tokens": 20},
        {"arrival": 1.0, "prompt_tokens": 20, "server_ttft": None, "device_ttft": 0.25, "output_tokens": 30},
        {"arrival": 2.0, "prompt_tokens": 80, "server_ttft": 0.7, "device_ttft": None, "output_tokens": 10},
        {"arrival": 4.0, "prompt_tokens": 60, "server_ttft": 0.6, "device_ttft": 0.65, "output_tokens": 5},
    ]
    path = tmp_path / "t.jsonl"
    _write_jsonl(path, rows)
    tr = load_trace(path)
    assert tr.arrival.tolist() == [1.0, 2.0, 3.0, 4.0]  # sorted by arrival
    assert tr.prompt_tokens.tolist() == [20, 80, 40, 60]
    assert tr.server_ttft[0] in (0.5, 0.7, 0.6)  # drawn from the recorded cloud TTFTs
    # Recorded device TTFTs lie on 0.01·l + 0.05 exactly, so the missing one is 0.01·80 + 0.05.
    assert tr.device_k == pytest.approx(0.01) and tr.device_c == pytest.approx(0.05)
    assert tr.device_ttft[1] == pytest.approx(0.85)
    assert np.all(np.isfinite(tr.server_ttft_migration))

    bad = tmp_path / "bad.jsonl"
    _write_jsonl(bad, [{"arrival": 1.0, "server_ttft": 0.3}])
    with pytest.raises(ValueError, match=":1:"):
        load_trace(bad)


def test_cli_writes_tables_and_plots(tmp_path: Path, capsys):
    out = tmp_path / "bench"
    rc = main(["-n", "400", "--calibration", "300", "--budgets", "0,0.5,1", "--out", str(out), "-q"])
    assert rc == 0
    text = (out / "results.md").read_text()
    assert "## server-constrained" in text and "## device-constrained" in text
    assert "| 0.5 | disco-s |" in text and "| 0.5 | disco-d |" in text and "| — | server-only |" in text
    assert "P99 TTFT reduction" in text
    assert (out / "disco_server-constrained.png").stat().st_size > 10_000
    data = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in data["results"]} >= {"disco-s", "stoch-s", "disco-d", "stoch-d", "device-only"}
    assert "results.md" not in capsys.readouterr().err


def test_cli_replays_a_recorded_trace(tmp_path: Path):
    rng = np.random.default_rng(2)
    rows = [
        {
            "arrival": float(i),
            "prompt_tokens": int(x),
            "server_ttft": float(rng.lognormal(math.log(0.4), 0.3)),
            "device_ttft": 0.0125 * int(x) + 0.05,
            "output_tokens": 64,
        }
        for i, x in enumerate(rng.integers(5, 200, 300))
    ]
    path = tmp_path / "rec.jsonl"
    _write_jsonl(path, rows)
    assert main(["--trace", str(path), "--budgets", "0.5", "--out", str(tmp_path / "o"), "-q", "--no-plots"]) == 0
    assert "recorded" in (tmp_path / "o" / "results.md").read_text()
    assert main(["--trace", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o2"), "-q"]) == 1


def test_timing_table_has_a_row_per_policy_and_size():
    table = timing(sizes=(1000,))
    rows = [r for r in table.splitlines() if r.startswith("| disco")]
    assert [r.split("|")[1].strip() for r in rows] == ["disco-s", "disco-d"]
    assert all(float(r.split("|")[3]) > 0 for r in rows)


@pytest.mark.parametrize("b", [0.03, 0.05, 0.2, 0.5, 0.77, 1.0])
def test_policies_agree_with_the_literal_pseudocode(b):
    # The timing baseline is an independent, line-by-line transcription of Alg. 2 / Alg. 3.
    rng = np.random.default_rng(int(b * 1000))
    lengths = np.maximum(1, np.rint(rng.lognormal(np.log(48), 0.6, 3000))).astype(np.int64)
    ttft = rng.lognormal(np.log(0.4), 0.3, 3000)
    s = DiscoS()
    s.recompute(prompt_lengths=lengths, budget=b)
    plan_map, l_th = literal_alg3(lengths, b)
    if b < 1:  # at b = 1 ours races everything (threshold −1); the literal one puts l_th at the shortest length
        assert s.threshold == l_th
    assert all(s.decide(v, u=0.999 if v == l_th else 0.0).start_cloud == bool(ind[1]) for v, ind in plan_map.items())
    d = DiscoD()
    d.recompute(prompt_lengths=lengths, server_ttft=ttft, budget=b, alpha=0.05)
    waits = literal_alg2(lengths, ttft, b, 0.05)
    assert {v: d.wait(v) for v in waits} == pytest.approx(waits)
