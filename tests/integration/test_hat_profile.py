"""`tandem profile` end to end on SmolLM2-135M (tiny grid, a real worker subprocess on loopback), and the profile
read back: the device half's draft-length controller and the worker's g start from it, and a profile for another
model or m is refused. And the profile's offline replay of acceptance against live greedy HAT runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cli import main as tandem
from app.tools.profiling import replay as rp
from app.worker.server import Worker
from app.worker.settings import WorkerSettings
from clients.hat.device import HATBackend
from clients.hat.options import HATOptions
from clients.hat.profile import ProfileError, load_profile
from clients.hat.split import split_model
from policies import trees
from policies.drafting import DEFAULT_ETA, DelayPredictor, LinkState, argmax_draft_length
from tests.integration.hf_fixtures import NEAR_TIE, SMOL, load, top2_gap
from tests.integration.test_hat import TOKEN, WorkerServer, collect, prompt_ids, token_ids

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    load(SMOL)  # skips when the model is not fetched
    out = tmp_path_factory.mktemp("profile") / "smol.json"
    code = tandem([
        "profile", "--quick", "--model", SMOL, "--worker-core", "-1", "--worker-device", "cpu", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    return out


def _backend(path: Path | str, mode: str = "eq7", m: int = 2, model_id: str = SMOL) -> HATBackend:
    model, tok = load(SMOL)
    options = HATOptions(worker_url="ws://127.0.0.1:1", m=m, draft_length=mode, profile=path)
    return HATBackend(options, model_id=model_id, model=model, tokenizer=tok)


def test_profile_measures_every_part_and_replays_acceptance(profile_path: Path) -> None:
    data = json.loads(profile_path.read_text())
    p = load_profile(profile_path)  # valid by the reader's own checks
    assert (p.model, p.m, data["hidden_size"]) == (SMOL, 2, 576)
    assert set(p.draft_step_ms) == {1, 2, 4} and set(p.head_ms) == {1, 2, 4}
    assert set(p.middle_ms) == {32} and set(p.middle_ms[32]) == {1, 2, 4}
    assert data["hosts"]["worker"]["compute_device"] == "cpu" and data["link"]["samples"] >= 3
    acc = data["acceptance"]
    assert acc["calibration"]["texts"] == 2 and acc["transfer"]["texts"] == 1
    assert all(0.0 <= a <= 1.0 for a in acc["alpha"].values())
    assert [r["width"] for r in acc["table1"]["rows"]] == [1, 2, 4]
    assert acc["table1"]["rows"][0]["chain"]["accept_replay_calibration"] == 1.0  # width 1: no drafts
    assert {row["depth"] for row in acc["rank_cdf"]["calibration"]["chain"]} == {1, 2, 3, 4}
    assert profile_path.with_suffix(".md").read_text().startswith("# HAT profile")


def test_the_device_half_plans_from_the_profile(profile_path: Path, tmp_path: Path) -> None:
    p = load_profile(profile_path)
    b = _backend(profile_path)
    ctl = b.controller
    parts = p.measured_parts()
    assert (ctl.step, ctl.head_row, ctl.rtt) == (parts.step, parts.head_row, parts.rtt)
    assert ctl.alpha == pytest.approx(parts.alpha_chain, abs=1e-9)
    # The worker's delay is the link's live estimate, not the profile's: a plausible one, fixed. The profile's own
    # points, fitted on a loaded box, can slope down (more rows "cheaper"), and every plan then drafts the most.
    g = (0.002, 0.05)  # seconds per row, seconds a pass
    up = p.up_bytes_per_s or b.options.beta_up
    down = p.down_bytes_per_s or b.options.beta_down
    link = LinkState(token_bytes=576 * 4, beta_up=up, beta_down=down, mu=0.0, g=g)

    def implied(alpha: float, step: float, head: float, rtt: float) -> int:
        def round_time(n: int) -> float:
            rows = n + 1
            worker = max(0.0, g[0] * rows + g[1])
            return rows * step + rows * 576 * 4 / up + worker + rows * 576 * 4 / down + head * (1 + alpha * n) + rtt

        return argmax_draft_length(alpha, round_time, 8)

    assert ctl.plan(link) == implied(parts.alpha_chain, parts.step, parts.head_row, parts.rtt)
    # The same device with a profile that measured near-perfect acceptance and a slow link: a long draft.
    data = json.loads(profile_path.read_text())
    data["acceptance"]["alpha"]["chain"] = 0.97
    data["link"]["rtt_ms"] = 200.0
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(data))
    long_plan = _backend(fast).controller.plan(link)
    assert long_plan == implied(0.97, parts.step, parts.head_row, 0.2) and long_plan > ctl.plan(link)
    # Without a profile: the warm-up priors.
    plain = _backend("").controller
    assert plain.step is None and plain.rtt is None


def test_a_profile_for_another_model_or_split_is_refused(profile_path: Path) -> None:
    with pytest.raises(ProfileError, match="is for m = 2, not m = 3"):
        _backend(profile_path, m=3)
    with pytest.raises(ProfileError, match="is for model smollm2"):
        _backend(profile_path, model_id="qwen2.5-coder-0.5b-instruct")


def test_the_worker_starts_g_from_the_profile(profile_path: Path) -> None:
    model, _ = load(SMOL)
    expected = DelayPredictor()
    expected.prime(load_profile(profile_path).delay_points())
    engine = Worker(WorkerSettings(model=SMOL, m=2, profile=str(profile_path), device="cpu"), model=model)._build()
    try:
        assert engine.info()["g"] == pytest.approx(list(expected.coefficients()))
        assert engine.info()["g"][0] > 0 or engine.info()["g"][1] > 0
    finally:
        engine.stop()
    with pytest.raises(ProfileError, match="m = 2, not m = 3"):
        Worker(WorkerSettings(model=SMOL, m=3, profile=str(profile_path), device="cpu"), model=model)._build()


def _arca_profile(profile_path: Path, out: Path, shape: str, width: int) -> Path:
    """The profile with its Table I rewritten so that `shape` ("chain" or "tree") of `width` is the fastest."""
    data = json.loads(profile_path.read_text())
    table = data["acceptance"]["table1"]
    table["rows"] = [r for r in table["rows"] if r["width"] != width] + [{**table["rows"][0], "width": width}]
    for row in table["rows"]:
        for s in ("chain", "tree"):
            row[s] = {**row[s], "tokens_per_s": 10.0 if (row["width"], s) == (width, shape) else 1.0}
    table["trees"][str(width)] = [[0], [1], [0, 0], [2], [0, 1], [0, 0, 0], [1, 0]][: width - 1]
    out.write_text(json.dumps(data))
    return out


def test_arca_runs_the_profiles_choice(profile_path: Path, tmp_path: Path) -> None:
    """`arca = true`: the shape the profile's Table I gives the most tokens per second is what the device half is
    set to run — a chain of width w caps the draft at w - 1 (max_draft 8 is replaced), a tree is verified."""
    model, tok = load(SMOL)

    def arca_backend(path: Path | str, **options: Any) -> HATBackend:
        options = HATOptions(worker_url="ws://127.0.0.1:1", m=2, profile=path, arca=True, tree_width=8, **options)
        return HATBackend(options, model_id=SMOL, model=model, tokenizer=tok)

    tree = arca_backend(_arca_profile(profile_path, tmp_path / "tree.json", "tree", 6))
    assert tree.tree is not None and tree.tree.width == 6 and tree.shape.startswith("ARCA: tree w=6")
    assert {tree.tree.path(i) for i in range(1, 6)} == {(0,), (1,), (0, 0), (2,), (0, 1)}
    assert tree.rule.max_draft == tree.controller.max_len == 8  # the cap reaches the tree's depth (2)
    for mode in ("eta", "eq7", "eq7+eta"):
        chain = arca_backend(_arca_profile(profile_path, tmp_path / "chain.json", "chain", 4), draft_length=mode)
        assert chain.tree is None and chain.shape == "ARCA: chain w=4 (draft cap 3)"
        assert chain.rule.max_draft == chain.controller.max_len == 3, mode
        # the fixed chain ARCA modelled under "eta" (no confidence stop); eq7+eta keeps its stop within the cap
        assert chain.rule.eta == {"eta": 0.0, "eq7": 0.0, "eq7+eta": DEFAULT_ETA}[mode], mode
    u_shape = arca_backend(_arca_profile(profile_path, tmp_path / "u.json", "chain", 1))
    assert not u_shape.speculative and u_shape.tree is None
    with pytest.raises(ValueError, match="arca chooses the verification tree from a profile"):
        arca_backend("")  # no profile


async def test_arcas_chain_caps_the_live_draft_and_its_tree_is_verified_live(
    profile_path: Path, tmp_path: Path, replay_worker: WorkerServer
) -> None:
    """Live rounds against a real worker: with ARCA's chain of width 4 (the default eta rule) rounds draft the fixed
    chain's 3 tokens, never more (without ARCA, at eta 0, rounds draft up to max_draft = 8), and with ARCA's tree the
    greedy rounds verify the tree."""
    model, tok = load(SMOL)
    ids = prompt_ids(tok, REPLAY_PROMPTS[0])
    runs = {"chain": ("chain", 4), "tree": ("tree", 4), "no arca": ("chain", 4)}
    stats = {}
    for name, (shape, width) in runs.items():
        path = _arca_profile(profile_path, tmp_path / f"{shape}.json", shape, width)
        eta = 0.0 if name == "no arca" else DEFAULT_ETA  # without ARCA, eta 0 lets every round draft max_draft
        options = HATOptions(worker_url=replay_worker.ws, auth_token=TOKEN, chunk_size=16, eta=eta, profile=path,
                             arca=name != "no arca")  # fmt: skip
        backend = HATBackend(options, model_id=SMOL, model=model, tokenizer=tok)
        await backend.start()
        try:
            assert len(token_ids(await collect(backend, ids, max_tokens=8))) == 8
        finally:
            await backend.close()
        stats[name] = backend.stats
    # no tree but lookup branches beside the chain (chain drafts still at most 3)
    assert stats["chain"].longest_draft == 3 and stats["chain"].tree_rounds == stats["chain"].lookup_rounds
    assert stats["chain"].draft_cap_sum == 3 * stats["chain"].rounds
    assert stats["no arca"].longest_draft > 3  # the same settings without ARCA: max_draft's 8 applies
    assert stats["tree"].tree_rounds >= 1


# --- the offline replay against live runs -------------------------------------------------------------------


class RoundRecorder(HATBackend):
    """A HATBackend that records how many drafts each of its rounds accepted, in order."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.accepted_per_round: list[int] = []

    async def _round(self, *args: Any, **kw: Any) -> Any:
        before = self.stats.accepted
        out = await super()._round(*args, **kw)
        self.accepted_per_round.append(self.stats.accepted - before)
        return out


@pytest.fixture(scope="module")
def replay_worker() -> Iterator[WorkerServer]:
    server = WorkerServer(load(SMOL)[0], SMOL, idle_timeout=60).start()
    yield server
    server.stop()


# SmolLM2 has no trained adapter: its untrained draft model (layer 2's attention) is right on the counting prompt's
# punctuation (rank 0) and has the repeated word at ranks 3-5, so both prompts accept some drafts.
REPLAY_PROMPTS = ("Count from one to ten in words.", "Repeat the word yes ten times.")
REPLAY_TOKENS = 12
# A depth-1 tree (the top 7 draft tokens): the device verifies a tree only where the round's cap allows the tree's
# depth, else (the answer's last token) a chain; at depth 1 both verify nothing there, as the replay does.
STAR = tuple((k,) for k in range(7))


RANKED = len(STAR) + 1  # the tree's ranks and the first past them; a chain's (rank 0 or not) among them


@torch.inference_mode()
def near_ties(split: Any, adapter: Any, ids: list[int], draft_head: Any) -> set[int]:
    """Positions q (predicting q + 1) where a live run and the replay's one teacher-forced pass, two computation paths,
    may decide otherwise (hf_fixtures' near-tie rule): the LLM's top two logits within NEAR_TIE (its token), the text's
    next token among the draft's top RANKED and its draft logit within NEAR_TIE of a neighbour's (its rank, where a
    round's acceptance can turn on it), or the draft's top probability within NEAR_TIE of eta (the confidence stop).
    `draft_head`: the device half's own (features -> logits, -inf outside its reduced vocabulary), as live drafting
    and the replay use it."""
    shallow = split.input(torch.tensor([ids]))
    llm = split.output(split.middle(shallow))[0].float()
    draft = draft_head(adapter(shallow)[0]).float()
    ties = set()
    for q in range(len(ids) - 1):
        row = draft[q]
        if top2_gap(llm[q]) < NEAR_TIE or abs(float(row.softmax(-1).max()) - DEFAULT_ETA) < NEAR_TIE:
            ties.add(q)
        if not torch.isfinite(row[ids[q + 1]]):
            continue  # outside the draft vocabulary: never drafted
        top = torch.topk(row, RANKED + 1).values
        rank = int((row > row[ids[q + 1]]).sum())
        if rank < RANKED:
            neighbours = top[max(rank - 1, 0) : rank + 2]
            if float(torch.sort((neighbours - row[ids[q + 1]]).abs()).values[1]) < NEAR_TIE:  # [0]: the token itself
                ties.add(q)
    return ties


def by_text(per_round: list[int], texts: list[rp.RankedText]) -> list[list[int]]:
    """A run's accepted drafts per round, cut into its texts' rounds (a round yields its accepted drafts + 1 token)."""
    out, rounds = [], iter(per_round)
    for t in texts:
        mine, p = [], t.first_round
        while p < t.end:
            mine.append(next(rounds))
            p += mine[-1] + 1
        out.append(mine)
    assert next(rounds, None) is None
    return out


async def test_offline_replay_of_acceptance_equals_the_live_runs(replay_worker: WorkerServer) -> None:
    """Greedy HAT on real weights, round by round: the accepted drafts of every live round equal app/tools/profiling's
    replay over the same answers, for chains under HAT's eta rule (the default) and for a token tree — up to a near
    tie (the live rounds and the replay's pass are two computation paths), after which a text's rounds part ways."""
    model, tok = load(SMOL)
    split = split_model(model, 2)
    configs: dict[str, tuple[dict[str, Any], Any]] = {
        "eta": ({}, lambda texts: rp.replay_eta_rounds(texts, DEFAULT_ETA, 8)[0]),
        "tree w=8": ({"tree_paths": STAR}, lambda texts: rp.replay(texts, trees.from_paths(STAR))),
    }
    for name, (options, offline) in configs.items():
        backend = RoundRecorder(
            # no lookup branches: the replay models the draft model's chains and trees only
            HATOptions(worker_url=replay_worker.ws, auth_token=TOKEN, chunk_size=16, lookup_tokens=0, **options),
            model_id=SMOL,
            model=model,
            tokenizer=tok,
        )
        await backend.start()
        texts, ties = [], []
        for prompt in REPLAY_PROMPTS:
            ids = prompt_ids(tok, prompt)
            got = token_ids(await collect(backend, ids, max_tokens=REPLAY_TOKENS))
            assert len(got) == REPLAY_TOKENS  # cut by the length limit (RankedText.capped, the default)
            half = backend.half
            head = lambda f, h=half: h.draft_logits(f, 0)  # noqa: E731 - the device half's own draft head
            texts.append(rp.rank_text(split, half.adapter, ids + got, len(ids), head))
            ties.append(near_ties(split, half.adapter, ids + got, head))
            print(f"{name}: near ties at {sorted(ties[-1])} of positions {len(ids)}..{len(ids) + len(got) - 2}")
        await backend.close()
        replayed = offline(texts)
        print(f"{name}: live {backend.accepted_per_round}, replayed {replayed.per_round}")
        parted = False
        for t, near, live, replay in zip(
            texts, ties, by_text(backend.accepted_per_round, texts), by_text(replayed.per_round, texts), strict=True
        ):
            # The replay's tie breaks: where the teacher-forced argmax is not the live text's next token.
            assert all(q in near for q in range(t.first_round, t.end) if t.tie(q)), (name, sorted(near))
            for r, (a, b) in enumerate(zip(live, replay, strict=False)):
                if a != b:
                    p = t.first_round + sum(x + 1 for x in live[:r])
                    assert near & set(range(p, p + max(a, b) + 1)), (name, r, live, replay, sorted(near))
                    print(f"{name}: round {r} parted at a near tie ({a} accepted live, {b} replayed)")
                    parted = True
                    break
            else:
                assert live == replay, name
        if not parted:
            assert (replayed.rounds, replayed.tokens) == (backend.stats.rounds, backend.stats.round_tokens), name
        assert replayed.accepted > 0, name  # drafts were accepted: not vacuous
        if name.startswith("tree"):
            assert backend.stats.tree_rounds == backend.stats.rounds - len(REPLAY_PROMPTS)  # all but the last
