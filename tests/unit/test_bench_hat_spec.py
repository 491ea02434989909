"""`tandem bench hat`'s speculation sections (widths, eq7, defaults; app/tools/bench/hat_spec.py): their pure parts —
the shapes swept and their HATOptions, ARCA's pick from a profile, Ghidorah's decomposition, the within-5% verdict, and
the tables. The sections themselves run on real weights only in the manual runs recorded in BENCHMARKS.md (the
suite's time budget has no room for another real-weight bench run)."""

from __future__ import annotations

import pytest

from app.tools.bench import hat_spec as spec
from app.tools.bench.hat_setup import SD_ONLY, U_SHAPE
from clients.hat.profile import SCHEMA, VERSION, parse_profile


def _profile(chain_rate: float, tree_rate: float, tree: list[list[int]] | None = None) -> object:
    """A valid profile whose Table I makes the chain of width 4 or the tree of width 4 the fastest shape."""
    tree = tree or [[0], [1], [0, 0]]

    def row(width: int, chain: float, tr: float) -> dict:
        return {"width": width, "chain": {"tokens_per_s": chain, "ghidorah_speedup": chain / 3},
                "tree": {"tokens_per_s": tr, "ghidorah_speedup": tr / 3}}  # fmt: skip

    data = {
        "schema": SCHEMA,
        "version": VERSION,
        "model": "smollm2-135m-instruct",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "m": 2,
        "device": {"draft_step_ms": {"1": 4.0}, "head_ms": {"1": 3.0}},
        "worker": {"middle_ms": {"128": {"1": 20.0}}},
        "link": {"rtt_ms": 20.0, "up_bytes_per_s": None, "down_bytes_per_s": None},
        "acceptance": {
            "alpha": {"chain": 0.5},
            "table1": {
                "rows": [row(1, 3.0, 3.0), row(2, 4.0, 4.0), row(4, chain_rate, tree_rate)],
                "arca_width": {"chain": 4 if chain_rate > 4 else 2, "tree": 4 if tree_rate > 4 else 2},
                "trees": {"2": [[0]], "4": tree},
            },
        },
    }
    return parse_profile(data, "test.json")


def test_chains_are_fixed_lengths_and_width_one_is_u_shape() -> None:
    assert spec.chain_shape(1).variant == U_SHAPE and spec.chain_shape(1).kind == "u-shape"
    four = spec.chain_shape(4)
    assert (four.variant, four.width, four.options) == (SD_ONLY, 4, {"eta": 0.0, "max_draft": 3})
    with pytest.raises(ValueError, match="at least 1 position"):
        spec.chain_shape(0)


def test_trees_come_from_the_profile_when_it_has_the_width_else_from_the_prior() -> None:
    deep = [[0], [0, 0], *([0] * d for d in range(3, 11))]  # depth 10: the draft cap must reach it
    table1 = {"trees": {"8": [[0], [1], [0, 0]], "11": deep}}
    profiled = spec.tree_shape(8, table1)
    assert profiled.options == {"tree_paths": ((0,), (1,), (0, 0)), "max_draft": 8} and "profile" in profiled.name
    assert spec.tree_shape(11, table1).options["max_draft"] == 10
    prior = spec.tree_shape(16, table1)
    assert prior.options == {"tree_width": 16} and "prior" in prior.name
    assert spec.tree_shape(4, None).options == {"tree_width": 4}


def test_the_sweep_starts_with_u_shape_and_ends_with_todays_default() -> None:
    shapes = spec.swept_shapes([1, 2, 4, 8], [4, 8], None)
    assert [s.name for s in shapes] == [
        "U-shape", "chain w=2", "chain w=4", "chain w=8", "tree w=4 (prior)", "tree w=8 (prior)", spec.DEFAULT_NAME,
    ]  # fmt: skip
    assert shapes[-1].options == {} and shapes[-1].kind == "eta"


def test_arcas_row_is_the_live_configuration_a_user_gets() -> None:
    """The ARCA row runs `arca = true` with the profile (the device half applies the choice), not a shape the bench
    builds; its name is the choice's."""
    tree_wins = _profile(chain_rate=5.0, tree_rate=6.0, tree=[[0], [1], [0, 0]])
    choice = tree_wins.arca_choice()
    assert (choice.kind, choice.width, choice.tree_paths) == ("tree", 4, ((0,), (1,), (0, 0)))
    shape = spec.arca_shape(tree_wins)
    assert (shape.kind, shape.width, shape.name) == ("tree", 4, "ARCA: tree w=4")
    assert shape.options == {"profile": "test.json", "arca": True} and shape.variant == SD_ONLY
    chain_wins = _profile(chain_rate=6.0, tree_rate=5.0)
    assert chain_wins.arca_choice().draft_cap(8) == 3
    shape = spec.arca_shape(chain_wins)
    assert (shape.kind, shape.width, shape.options) == ("chain", 4, {"profile": "test.json", "arca": True})
    no_table = _profile(5.0, 6.0)
    del no_table.raw["acceptance"]["table1"]
    with pytest.raises(SystemExit, match="no Table I"):
        spec.arca_shape(no_table)


def test_ghidorah_decomposition_and_the_five_percent_verdict() -> None:
    d = spec.decomposition(accept_length=2.0, round_ms_1=100.0, round_ms_w=125.0)
    assert d["step_ratio"] == pytest.approx(0.8) and d["speedup"] == pytest.approx(1.6)
    assert spec.within(105.0, 100.0) and spec.within(99.0, 100.0)
    assert not spec.within(105.01, 100.0)


def _row(name: str, kind: str, width: int, tbt: float, accept: float, round_ms: float) -> dict:
    return {"name": name, "kind": kind, "width": width, "tbt_ms_median": tbt, "accept_length": accept,
            "ms_per_round": round_ms, "rounds": 10, "tree_rounds": 10 if kind == "tree" else 0,
            "arca": name.startswith("ARCA")}  # fmt: skip


def test_widths_summary_finds_the_best_swept_shape_and_judges_arca_against_it() -> None:
    rows = [
        _row("U-shape", "u-shape", 1, 250.0, 1.0, 250.0),
        _row("chain w=4", "chain", 4, 160.0, 2.0, 320.0),
        _row("tree w=8 (profile)", "tree", 8, 150.0, 2.4, 360.0),
        _row(spec.DEFAULT_NAME, "eta", 0, 140.0, 2.1, 294.0),  # faster, but not a swept width
        _row("ARCA: tree w=8", "tree", 8, 156.0, 2.4, 374.4),
    ]
    modelled = {8: {"tree": {"ghidorah_speedup": 1.9}}}
    out = spec.summarize_widths(rows, modelled)
    assert out["best_swept"] == "tree w=8 (profile)" and out["arca"] == "ARCA: tree w=8"
    assert out["arca_over_best"] == pytest.approx(1.04) and out["arca_within_5pct"]
    chain = out["rows"][1]
    assert chain["speedup"] == pytest.approx(250 / 160)
    assert chain["decomposition"]["speedup"] == pytest.approx(2.0 * 250 / 320) and chain["modelled_speedup"] is None
    assert out["rows"][2]["modelled_speedup"] == 1.9
    rows[-1]["tbt_ms_median"] = 120.0  # ARCA's row is never the best swept shape it is judged against
    fastest = spec.summarize_widths(rows, modelled)
    assert fastest["best_swept"] == "tree w=8 (profile)" and fastest["arca_within_5pct"]
    rows[-1]["tbt_ms_median"] = 160.0
    late = spec.summarize_widths(rows, modelled)
    assert not late["arca_within_5pct"]
    text = "\n".join(spec.report_widths({**late, "prompts": 8, "tokens": 64}))
    assert "NOT within 5%" in text and "| tree w=8 (profile) | 2.40 | 150.0 | 1.67x |" in text


def test_eq7_rows_compare_every_rule_with_the_default() -> None:
    configs = spec.eq7_configs([1, 2])
    assert [n for n, _ in configs] == ["eta (default)", "eq7", "eq7+eta", "fixed 1", "fixed 2"]
    assert dict(configs)["fixed 2"] == {"eta": 0.0, "max_draft": 2} and dict(configs)["eq7"] == {"draft_length": "eq7"}
    cell = {"accepted_per_round": 1.0}
    rows = [{"rtt_ms": 200.0, "cells": {"eta (default)": {**cell, "tbt_ms_median": 300.0},
                                        "eq7+eta": {**cell, "tbt_ms_median": 270.0},
                                        "fixed 2": {**cell, "tbt_ms_median": 330.0}}}]  # fmt: skip
    out = spec.summarize_eq7(rows)
    assert out[0]["fastest"] == "eq7+eta" and out[0]["cells"]["eq7+eta"]["ratio_to_default"] == pytest.approx(0.9)
    text = "\n".join(spec.report_eq7({"rows": out, "prompts": 3, "tokens": 32, "profile": "p.json"}))
    assert "| 200 | 300.0 / 1.00 / 1.00x | 270.0 / 1.00 / 0.90x | 330.0 / 1.00 / 1.10x | eq7+eta |" in text


def test_defaults_summary_takes_the_median_speedup_over_runs() -> None:
    def t4(u: float, d: float, p: float) -> dict:
        stats = {"tree_rounds": 0, "rounds": 10, "mean_draft_cap": 8.0}
        return {
            "U-shape": {"tbt_ms_median": u, "accept_length": 1.0, "stats": stats},
            spec.DEFAULT_NAME: {"tbt_ms_median": d, "accept_length": 2.1, "stats": stats},
            spec.PROFILED_NAME: {"tbt_ms_median": p, "accept_length": 2.5, "stats": {**stats, "tree_rounds": 6}},
            "prompts": 8,
        }

    t5 = [{"prompt_tokens": 128, "variant": n, "ttft_ms": 1000.0, "tbt_ms": tbt, "accept_length": 1.5}
          for n, tbt in (("U-shape", 250.0), (spec.DEFAULT_NAME, 200.0), (spec.PROFILED_NAME, 150.0))]  # fmt: skip
    t5[2]["differs_from_u_shape"] = True
    out = spec.summarize_defaults([t4(250, 160, 100), t4(250, 150, 125), t4(250, 170, 110)], t5)
    profiled = out["table4"][spec.PROFILED_NAME]
    assert profiled["speedup_per_run"] == pytest.approx([2.5, 2.0, 250 / 110])
    assert profiled["speedup_median"] == pytest.approx(250 / 110) and profiled["tree_rounds"] == 18
    row = out["table5"][0]
    assert row[spec.PROFILED_NAME]["tbt_ratio"] == pytest.approx(0.6) and not row[spec.PROFILED_NAME]["same_as_u_shape"]
    assert row[spec.DEFAULT_NAME]["same_as_u_shape"]
    text = "\n".join(spec.report_defaults({**out, "prompts": 8, "tokens": 64}))
    assert f"| {spec.PROFILED_NAME} | 2.50 | 110.0 | 2.27x | 2.50x, 2.00x, 2.27x | 18/30 | 8.00 |" in text


class _CharTokenizer:
    """One token per character (pure logic: the prompt slicer needs only a tokenizer's two calls)."""

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return f"<user>{messages[0]['content']}</user><assistant>"

    def __call__(self, text: str, add_special_tokens: bool) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_tables_4_and_5_run_on_24_prompts_by_default_each_table5_prompt_its_own_slice() -> None:
    from app.tools.bench.hat import build_parser
    from app.tools.bench.hat_setup import code_prompt

    args = build_parser().parse_args([])
    assert args.table4_prompts >= 24  # the first 8 held-out prompts were an easy sample (issue 30)
    assert args.table5_prompts * len(args.lengths) >= 24
    tok = _CharTokenizer()
    for length in (128, 2048):
        prompts = [code_prompt(tok, length, i) for i in range(args.table5_prompts)]
        assert all(len(p) == length for p in prompts)
        assert len({tuple(p) for p in prompts}) == len(prompts)  # every prompt a different slice of the code
    assert code_prompt(tok, 300, 0) == code_prompt(tok, 300)


def test_table5_prompts_read_the_pinned_code_not_the_working_tree(tmp_path) -> None:
    """Table 5's prompts explain code shipped in deploy/ at one commit, so editing the repository's files does not
    move the published table; a changed pinned file is refused."""
    import gzip
    import json

    from app.tools.bench.hat_setup import TABLE5_CODE, table5_code

    pinned = json.loads(gzip.decompress(TABLE5_CODE.read_bytes()))
    assert len(pinned["commit"]) == 40
    names = [name for name, _ in pinned["files"]]
    assert "app/serving/orchestrator.py" in names and "clients/hat/device.py" in names
    code = table5_code()
    assert code == "\n".join(text for _, text in pinned["files"])
    assert len(code) > 50_000  # room for 6 slices of 2048 tokens
    tampered = tmp_path / "table5_code.json.gz"
    tampered.write_bytes(gzip.compress(json.dumps({**pinned, "files": pinned["files"][:1]}).encode()))
    with pytest.raises(SystemExit, match="sha256"):
        table5_code(tampered)


def test_table5_rows_are_medians_over_the_prompts_and_flag_any_prompt_that_differs() -> None:
    from app.tools.bench.hat_sections import summarize_table5

    def run(ttft: float, tbt: float, accept: float, ids: list[int]) -> dict:
        return {"ttft_ms": ttft, "tbt_ms": tbt, "accept_length": accept, "tokens": len(ids), "ids": ids}

    runs = {
        "U-shape": [run(100, 50, 1.0, [1, 2]), run(300, 70, 1.0, [3, 4]), run(200, 60, 1.0, [5, 6])],
        "SD": [run(90, 30, 2.0, [1, 2]), run(250, 20, 1.5, [3, 4]), run(80, 40, 2.5, [5, 6])],
        "SD+PC": [run(90, 30, 2.0, [1, 2]), run(250, 20, 1.5, [3, 9]), run(80, 40, 2.5, [5, 6])],
    }
    variants = [(U_SHAPE.name, U_SHAPE), (SD_ONLY.name, SD_ONLY), ("SD+PC", SD_ONLY)]
    rows = summarize_table5(512, variants, runs)
    assert [r["variant"] for r in rows] == ["U-shape", "SD", "SD+PC"]
    sd = rows[1]
    assert (sd["ttft_ms"], sd["tbt_ms"], sd["accept_length"], sd["prompts"]) == (90, 30, 2.0, 3)
    assert [p["tbt_ms"] for p in sd["per_prompt"]] == [30, 20, 40] and sd["prompt_tokens"] == 512
    assert "differs_from_u_shape" not in sd and rows[2]["differs_from_u_shape"] is True
