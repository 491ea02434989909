"""`tandem profile`'s pure parts: the acceptance replay (chains, trees, rank statistics), the profile file's
validation, and how the controller and the worker's g start from a profile."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from app.tools.profiling import replay as rp
from app.tools.profiling.main import default_out, interp
from clients.hat.profile import SCHEMA, VERSION, ProfileError, load_profile, parse_profile
from policies import trees
from policies.drafting import (
    DelayPredictor,
    DraftLengthController,
    LinkState,
    MeasuredParts,
    argmax_draft_length,
    expected_tokens_per_verification,
)


def _text(ranks: list[int], prompt_len: int = 1, ties: set[int] = frozenset(), maxp: list[float] | None = None):
    """A RankedText whose decode-round positions (from the first answer token, which prefill produced) carry
    `ranks`, counted from 0; the LLM's argmax is the text's next token except at `ties` (same counting)."""
    n = prompt_len + len(ranks) + 1
    ids = list(range(100, 100 + n))
    top1 = [ids[q + 1] if q + 1 < n and q - prompt_len not in ties else -1 for q in range(n)]
    full = [0] * prompt_len + list(ranks) + [0]
    probs = [0.9] * n if maxp is None else [0.9] * prompt_len + list(maxp) + [0.9]
    return rp.RankedText(ids, prompt_len, top1, full, probs)


def test_chain_replay_accepts_the_leading_run_of_top1_ranks() -> None:
    t = _text([0, 0, 1, 0, 3, 0, 0, 0])
    # chain of 2: round at 0 accepts ranks[0..1] = 0,0 (2) -> next start 3: ranks[3]=0, ranks[4]=3 -> 1
    # -> start 5: 0,0 -> 2 -> start 8 = end. Rounds: 3, tokens 8.
    r = rp.replay([t], trees.chain(2))
    assert (r.rounds, r.accepted, r.tokens) == (3, 5, 8)
    assert rp.replay([t], trees.chain(0)).accept_length == 1.0  # no drafts: U-shape


def test_tree_replay_follows_rank_paths_and_ties_end_a_round() -> None:
    t = _text([1, 2, 0, 0])
    tree = trees.from_paths({(0,), (1,), (1, 2), (1, 2, 0)})
    r = rp.replay([t], tree)
    assert r.histogram[3] == 1  # (1, 2, 0) accepted, then ranks[3] opens the next round
    tied = rp.replay([_text([0, 0, 0, 0], ties={1})], trees.chain(4))
    assert tied.tie_breaks == 1 and tied.histogram[2] == 1  # accepted up to the tie, then the text differs


def test_best_trees_are_valid_and_their_acceptance_does_not_fall_with_width() -> None:
    texts = [_text([0, 1, 0, 0, 2, 0, 1, 1, 0, 0, 0, 3, 0, 1, 0, 0, 5, 0, 0, 1])]
    answers = [t.answer() for t in texts]
    counts, starts = trees.path_counts(answers, max_depth=4, max_rank=4)
    assert counts[(0,)] == sum(1 for r in texts[0].ranks[1:-1] if r == 0)  # each start counts its first rank
    assert starts == len(texts[0].ranks) - 2
    probabilities = trees.path_probabilities(answers, max_depth=4, max_rank=4)
    previous = 1.0
    for w in (1, 2, 4, 8, 16, 32):
        tree = trees.best_tree(w, probabilities)  # a DraftTree: validated when built
        assert tree.width == w
        est = trees.expected_tokens(tree, probabilities)
        assert est >= previous - 1e-12
        previous = est
        refined = trees.refine_tree(tree, answers)
        assert refined.width == w
        assert trees.replay_accept_length(refined, answers) >= trees.replay_accept_length(tree, answers)
    assert trees.best_tree(2, probabilities).path(1) == (0,)


def test_rank_cdf_is_conditional_on_the_path() -> None:
    t = _text([0, 1, 0, 2])  # starts at every answer position
    cdf = rp.rank_cdf([t], depth=2, top_k=3)
    chain = {row["depth"]: row for row in cdf["chain"]}
    assert chain[1]["samples"] == 4 and chain[1]["p_rank_le"][0] == 0.5
    # depth 2 only after a right depth-1 draft (rank 0 at starts 0 and 2): next ranks are 1 and 2
    assert chain[2]["samples"] == 2 and chain[2]["p_rank_le"] == [0.0, 0.5, 1.0]
    tree = {row["depth"]: row for row in cdf["tree"]}
    assert tree[2]["samples"] == 3  # depth 2 after any depth-1 rank below 3 (starts 0, 1, 2)


def test_eta_replay_measures_what_the_controller_plans_with() -> None:
    # confident drafts accepted, one unconfident draft rejected each round
    t = _text([0, 0, 1, 0, 0, 1, 0], maxp=[0.9, 0.9, 0.3, 0.9, 0.9, 0.3, 0.9])
    out = rp.replay_eta([t], eta=0.6, max_draft=8)
    # two rounds of 2 accepted + 1, then one token left: a last round with no room for a draft
    assert out["rounds"] == 3 and out["accept_length"] == pytest.approx(7 / 3, abs=1e-4)
    assert out["alpha"]["eta"] == pytest.approx(4 / 6, abs=1e-5)  # 4 accepted, 2 rejecting rounds
    assert out["alpha"]["confident"] == 1.0  # the rejected drafts were unconfident


def test_interp_is_linear_between_points_and_extends_the_ends() -> None:
    table = {"1": 10.0, "4": 16.0, "8": 24.0}
    assert interp(table, 2) == pytest.approx(12.0)
    assert interp(table, 16) == pytest.approx(40.0)
    assert interp({"2": 8.0}, 4) == 16.0


# --- policies: starting from measured parts -------------------------------------------------------------


def test_delay_predictor_primed_with_points_fits_them_and_yields_to_live_passes() -> None:
    g = DelayPredictor()
    g.prime([(1, 0.010), (2, 0.012), (4, 0.016), (8, 0.024)])
    slope, intercept = g.coefficients()
    assert slope == pytest.approx(0.002) and intercept == pytest.approx(0.008)
    g.update(8, 0.124)  # one live pass at 100 ms more: Eq. 2's weight 0.2 moves g(8) toward it
    assert 0.024 < g(8) < 0.124


def test_controller_seeded_from_a_profile_plans_with_its_parts() -> None:
    link = LinkState(token_bytes=3584, beta_up=7.5e6, beta_down=12.5e6, mu=0.0, g=(0.002, 0.030))
    parts = MeasuredParts(step=0.004, head_row=0.003, rtt=0.020, alpha_chain=0.6, alpha_eta=0.7, alpha_confident=0.9)
    ctl = DraftLengthController(mode="eq7", max_len=8)
    ctl.seed(parts)
    assert (ctl.step, ctl.head_row, ctl.rtt) == (0.004, 0.003, 0.020)
    assert ctl.alpha == pytest.approx(0.6)

    def round_time(n: int) -> float:  # T_round written out from the parts: draft, up, g(mu + rows), down, head, rtt
        rows = n + 1
        return (
            rows * 0.004
            + rows * 3584 / 7.5e6
            + 0.002 * rows
            + 0.030
            + rows * 3584 / 12.5e6
            + 0.003 * (1 + 0.6 * n)
            + 0.020
        )

    expected = argmax_draft_length(0.6, round_time, 8)
    assert ctl.plan(link) == expected
    assert expected_tokens_per_verification(0.8, expected) > 1
    confident = DraftLengthController(mode="eq7+eta", max_len=8)
    confident.seed(parts)
    assert confident.alpha == pytest.approx(0.9)
    unseeded = DraftLengthController(mode="eq7", max_len=8)
    assert unseeded.step is None and unseeded.alpha == pytest.approx(0.8)  # the 4:1 prior


# --- the profile file -------------------------------------------------------------------------------------------


def _profile() -> dict:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "model": "smollm2-135m-instruct",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "m": 2,
        "device": {"draft_step_ms": {"1": 4.0, "2": 5.0}, "head_ms": {"1": 3.0, "2": 4.0}},
        "worker": {"middle_ms": {"128": {"1": 20.0, "4": 26.0}, "512": {"1": 24.0, "4": 30.0}}},
        "link": {"rtt_ms": 20.0, "up_bytes_per_s": 7.5e6, "down_bytes_per_s": None},
        "acceptance": {"alpha": {"chain": 0.5, "eta": 0.6, "confident": 0.7}},
    }


def test_a_valid_profile_gives_the_controller_and_the_worker_their_parts(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    p = load_profile(path)
    parts = p.measured_parts()
    assert parts.step == pytest.approx(0.004) and parts.rtt == pytest.approx(0.020)
    assert parts.head_row == pytest.approx((1 * 3 + 2 * 4) / 5 / 1e3)  # least squares through the origin
    assert (parts.alpha_chain, parts.alpha_eta, parts.alpha_confident) == (0.5, 0.6, 0.7)
    assert sorted(p.delay_points()) == [(1.0, 0.020), (1.0, 0.024), (4.0, 0.026), (4.0, 0.030)]
    assert p.down_bytes_per_s is None and p.up_bytes_per_s == 7.5e6
    p.check_model({"smollm2-135m-instruct"}, 2)
    p.check_model({"hat:x", "SmolLM2-135M-Instruct.Q4_1.gguf"}, 2)  # by GGUF file name
    with pytest.raises(ProfileError, match="is for model smollm2"):
        p.check_model({"qwen2.5-coder-0.5b-instruct"}, 2)
    with pytest.raises(ProfileError, match="m = 2, not m = 3"):
        p.check_model({"smollm2-135m-instruct"}, 3)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("schema",), "other", "field 'schema'"),
        (("version",), 99, "field 'version' 99 is not supported"),
        (("m",), 0, "field 'm'"),
        (("device", "draft_step_ms"), None, "missing field 'device.draft_step_ms'"),
        (("device", "head_ms"), {"one": 3.0}, "'device.head_ms' has a key 'one'"),
        (("device", "head_ms"), {"1": -3.0}, "'device.head_ms.1' must be a positive number"),
        (("worker", "middle_ms"), {}, "'worker.middle_ms' must be a non-empty object"),
        (("link", "rtt_ms"), "20", "'link.rtt_ms' must be a number >= 0"),
        (("acceptance", "alpha", "chain"), 1.5, "'acceptance.alpha.chain' must be in [0, 1]"),
    ],
)
def test_a_malformed_profile_is_an_error_naming_the_field(path: tuple, value: object, message: str) -> None:
    data = copy.deepcopy(_profile())
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    with pytest.raises(ProfileError) as err:
        parse_profile(data, "p.json")
    assert message in str(err.value) and "p.json" in str(err.value)


def test_an_unreadable_profile_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


def test_the_default_profile_path_keeps_a_bundled_models_whole_name() -> None:
    assert default_out("qwen2.5-coder-0.5b-instruct", 2) == Path("var/profile/qwen2.5-coder-0.5b-instruct-m2.json")
    assert default_out("/models/Foo-1.5B.Q4.gguf", 3, prefix="bench-") == Path("var/profile/bench-Foo-1.5B.Q4-m3.json")
