"""`tandem bench privacy --quick` runs end to end on SmolLM2-135M (m 1-2, a few thousand tokens, seconds): its
table has a row per m and per noise level, and at m = 1 the linear probe recovers far more than nearest-embedding."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli import main as tandem
from tests.integration.hf_fixtures import SMOL, gguf_or_skip


def test_bench_privacy_quick(tmp_path: Path, capsys) -> None:
    gguf_or_skip(SMOL)
    out, png = tmp_path / "privacy.md", tmp_path / "privacy.png"
    code = tandem(["bench", "privacy", "--quick", "--model", SMOL, "--out", str(out), "--plot", str(png)])
    assert code == 0
    results = json.loads(out.with_suffix(".json").read_text())
    rows = {r["m"]: r for r in results["by_m"]}
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        for attack in ("nearest", "linear", "inverter"):
            assert 0.0 <= r[attack]["all"] <= 1.0 and {"code", "prose"} <= set(r[attack])
        assert r["input_ms"] > 0 and r["adapter"] is None  # no adapter ships for SmolLM2
    assert rows[1]["linear"]["all"] > rows[1]["nearest"]["all"] + 0.5
    assert [n["noise"] for n in results["noise"]] == [0.0, 0.3]
    assert "live" not in results
    table = out.read_text()
    m_rows = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(m_rows) == 4 and all(line.count("|") == 7 for line in m_rows[:2])  # main table: 6 columns
    assert "no adapter" in table and "| 0.3 |" in table
    assert png.is_file() and png.stat().st_size > 1000
    assert "HAT privacy" in capsys.readouterr().out
