"""`tandem bench jupiter --quick` runs end to end on SmolLM2-135M: one process (1 and 2 threads) and a real 2-stage
worker (gloo on loopback) with no, equal, DP and the paper's-rule sub-sequences; every configuration gets a prefill
time per length, the staged ones each stage's compute time, and (i), (ii), (v) a decode throughput; the plans cover
each prompt."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli import main as tandem
from tests.integration.hf_fixtures import SMOL, gguf_or_skip


def test_bench_jupiter_quick(tmp_path: Path, capsys) -> None:
    gguf_or_skip(SMOL)
    out = tmp_path / "jupiter.md"
    assert tandem(["bench", "jupiter", "--quick", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["model"] == SMOL and data["lengths"] == [64, 128]
    (a0, b0), (a1, b1) = data["stage_layers"]
    assert a0 == 2 and b0 == a1 and b1 == 30
    results = data["results"]
    for name in ("i", "ii", "iii", "iv", "v", "vi"):
        for n in ("64", "128"):
            entry = results[name]["prefill"][n]
            assert entry["median"] > 0 and len(entry["all"]) == 1
            staged = name in ("iii", "iv", "v", "vi")
            assert (entry["stage_busy"] is not None) == staged
            if staged:
                assert len(entry["stage_busy"]) == 2 and all(v > 0 for v in entry["stage_busy"])
        assert (results[name]["decode_tps"] is not None) == (name in ("i", "ii", "v"))
    for name in ("iv", "v", "vi"):
        for n in (64, 128):
            lengths = data["plans"][name][str(n)]
            assert sum(lengths) == n and min(lengths) >= 16
    table = out.read_text()
    assert table.count("| (") == 6 and "Targets:" in table and "paper's rule (vi)" in table
    assert "Jupiter" in capsys.readouterr().out
