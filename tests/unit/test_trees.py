"""policies/trees.py: draft trees, acceptance from rank sequences, the best tree and ARCA's width choice."""

from __future__ import annotations

import itertools
import random

import pytest

from policies.drafting import expected_tokens_per_verification
from policies.trees import (
    AnswerRanks,
    DraftTree,
    ancestor_mask,
    best_tree,
    chain,
    check_tree,
    expected_tokens,
    from_paths,
    path_probabilities,
    refine_tree,
    replay,
    replay_accept_length,
    tie_breaks,
)


def _sequences(seed: int, n: int = 6, length: int = 60, sticky: float = 0.7) -> list[list[int]]:
    """Rank sequences with runs (a confident stretch tends to go on), like a real draft's."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seq, easy = [], True
        for _ in range(length):
            easy = easy if rng.random() < sticky else not easy
            weights = [0.8, 0.1, 0.05, 0.05] if easy else [0.3, 0.2, 0.1, 0.4]
            seq.append(rng.choices([0, 1, 2, 9], weights)[0])
        out.append(seq)
    return out


def _random_tree(rng: random.Random, width: int) -> DraftTree:
    parents, ranks, used = [-1], [0], {}
    for i in range(1, width):
        p = rng.randrange(i)
        r = used.get(p, 0)
        used[p] = r + 1
        parents.append(p)
        ranks.append(r)
    return DraftTree(tuple(parents), tuple(ranks))


def test_malformed_trees_are_rejected_naming_the_problem():
    with pytest.raises(ValueError, match="root"):
        check_tree([0, 0])
    with pytest.raises(ValueError, match=r"parents\[2\] = 2"):
        check_tree([-1, 0, 2])
    with pytest.raises(ValueError, match="two children of rank 0"):
        DraftTree((-1, 0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="3 ranks for 2 nodes"):
        DraftTree((-1, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="no parent"):
        from_paths([(0, 1)])


def test_chain_shape_and_levels():
    c = chain(3)
    assert c.width == 4 and c.depth == 3 and c.is_chain()
    assert c.expanded_per_level() == [1, 1, 1]
    assert [c.path(i) for i in range(4)] == [(), (0,), (0, 0), (0, 0, 0)]
    t = from_paths([(0,), (1,), (0, 0)])
    assert not t.is_chain() and t.levels() == [[0], [1, 2], [3]] and t.expanded_per_level() == [1, 1]


@pytest.mark.parametrize("seed", range(20))
def test_tree_mask_is_the_ancestor_relation(seed):
    rng = random.Random(seed)
    tree = _random_tree(rng, rng.randint(1, 12))
    mask = ancestor_mask(tree.parents)
    for i, j in itertools.product(range(tree.width), repeat=2):
        ancestors, k = set(), i
        while k >= 0:
            ancestors.add(k)
            k = tree.parents[k]
        assert mask[i][j] == (j in ancestors)
        if mask[i][j]:  # an ancestor's path is a prefix of the node's
            assert tree.path(i)[: len(tree.path(j))] == tree.path(j)


def test_chain_probabilities_match_eq7_under_iid_acceptance():
    """With i.i.d. rank-0 acceptance alpha, a chain's expected tokens are Eq. 7's L(l, alpha)."""
    rng = random.Random(1)
    alpha = 0.7
    seqs = [[0 if rng.random() < alpha else 3 for _ in range(4000)]]
    probs = path_probabilities(seqs, max_depth=6, max_rank=2)
    for drafts in range(0, 6):
        assert expected_tokens(chain(drafts), probs) == pytest.approx(
            expected_tokens_per_verification(alpha, drafts), rel=0.03
        )


def _simulate(tree: DraftTree, seq: list[int]) -> list[int]:
    """Independent reference: walk the tree by paths (no child maps)."""
    paths = {tree.path(i) for i in range(tree.width)}
    out, t = [], 0
    while t < len(seq):
        a = 0
        while t + a < len(seq) and tuple(seq[t : t + a + 1]) in paths:
            a += 1
        tokens = min(a + 1, len(seq) - t)  # the accepted drafts and the target's token, within the answer
        out.append(tokens - 1)
        t += tokens
    return out


@pytest.mark.parametrize("seed", range(10))
def test_replay_equals_a_reference_simulation(seed):
    rng = random.Random(seed)
    for seq in _sequences(seed, n=3):
        tree = _random_tree(rng, rng.randint(1, 10))
        assert replay(tree, seq) == _simulate(tree, seq)
        assert sum(replay(tree, seq)) + len(replay(tree, seq)) == len(seq)  # every answer token is produced once


def _brute_force_best(probs: dict, width: int, depth: int = 3, ranks: int = 3) -> float:
    """The most expected tokens of any ancestor-closed tree of `width` nodes on paths of depth <= 3, ranks < 3."""
    universe = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    best = 1.0
    for subset in itertools.combinations(universe, width - 1):
        s = set(subset)
        if all(p[:-1] in s or len(p) == 1 for p in s):
            best = max(best, expected_tokens(from_paths(s), probs))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_best_tree_is_optimal_on_measured_path_probabilities(seed):
    """Brute force over every tree of width w on paths of depth <= 3 and ranks < 3 (measured data: a node is never
    more probable than its parent, so the w - 1 most probable paths are the answer)."""
    probs = path_probabilities(_sequences(seed), max_depth=3, max_rank=3)
    for width in (2, 3, 4, 5):
        tree = best_tree(width, probs)
        assert tree.width == width
        assert expected_tokens(tree, probs) == pytest.approx(_brute_force_best(probs, width))


def test_best_tree_drafts_a_more_probable_second_rank_without_the_first():
    """The issue's counterexample: the next-rank-only frontier gave 1.2 expected tokens at width 2 (rank 0 first);
    the best tree drafts rank 1 alone (1.5), and with room for both takes both."""
    probs = {(0,): 0.2, (1,): 0.5}
    assert best_tree(2, probs).path(1) == (1,)
    assert expected_tokens(best_tree(2, probs), probs) == pytest.approx(1.5)
    assert expected_tokens(best_tree(3, probs), probs) == pytest.approx(1.7)
    deep = {(0,): 0.1, (1,): 0.3, (0, 0): 0.5}  # a child above its parent (not measured data): the knapsack's case
    assert {best_tree(3, deep).path(i) for i in (1, 2)} == {(0,), (0, 0)}


@pytest.mark.parametrize("seed", range(4))
def test_best_tree_is_optimal_on_any_probabilities(seed):
    """Random probabilities in no order at all (children above their parents, parents missing, siblings in any
    rank order): equal to brute force at every width."""
    rng = random.Random(seed)
    universe = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
    for _ in range(5):
        probs = {p: rng.random() for p in universe if rng.random() < 0.6}
        for width in (2, 3, 4, 5):
            tree = best_tree(width, probs)
            assert tree.width == width
            assert expected_tokens(tree, probs) == pytest.approx(_brute_force_best(probs, width), abs=1e-12)


def test_best_tree_refuses_negative_probabilities():
    with pytest.raises(ValueError, match=">= 0"):
        best_tree(3, {(0,): -0.1})


def test_estimated_acceptance_does_not_fall_with_width_and_trees_beat_chains():
    seqs = _sequences(3, n=8, length=120)
    probs = path_probabilities(seqs, max_depth=32, max_rank=8)
    previous = 0.0
    for w in (1, 2, 4, 8, 16, 32):
        tree = best_tree(w, probs)
        est = expected_tokens(tree, probs)
        assert est >= previous - 1e-12
        assert est >= expected_tokens(chain(w - 1), probs) - 1e-12
        previous = est
    assert expected_tokens(best_tree(8, probs), probs) > expected_tokens(chain(7), probs)


def test_best_tree_fills_its_width_even_where_nothing_was_observed():
    tree = best_tree(5, {(0,): 0.5})
    assert tree.width == 5 and tree.path(1) == (0,)


def test_refining_never_lowers_the_replayed_accept_length():
    seqs = _sequences(5, n=6, length=80)
    probs = path_probabilities(seqs, max_depth=8, max_rank=4)
    for w in (4, 8):
        tree = best_tree(w, probs)
        refined = refine_tree(tree, seqs)
        assert refined.width == w
        assert replay_accept_length(refined, seqs) >= replay_accept_length(tree, seqs)


def test_greedy_walk_follows_the_targets_tokens_and_runs_the_head_lazily():
    import torch

    from clients.hat.tree import TreeDraft, walk_greedy

    tree = from_paths([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)])  # nodes 1..6 in level order
    tokens = [10, 11, 12, 13, 14, 15, 16]  # node i drafts token 10 + i
    paths = {tree.path(i): i for i in range(tree.width)}
    assert paths[(1,)] == 2 and paths[(1, 0)] == 4 and paths[(1, 0, 0)] == 6
    # The target: after the root -> 12 (node 2, rank 1), then 14 (node 4), then 16 (node 6), then 99 (no child).
    target = {0: 12, 2: 14, 4: 16, 6: 99}
    calls: list[list[int]] = []

    def head_rows(rows: list[int]) -> torch.Tensor:
        calls.append(rows)
        out = torch.zeros(len(rows), 100)
        for j, r in enumerate(rows):
            out[j, target.get(r, 0)] = 1.0
        return out

    new, path = walk_greedy(head_rows, TreeDraft(tree, tokens, torch.zeros(tree.width, 4)))
    assert path == [0, 2, 4, 6] and new == [12, 14, 16, 99]
    assert calls == [[0], [2, 4, 6]]  # the root alone, then the entered child with its top-1 descendants
    calls.clear()
    target[0] = 50  # the root's target drafts nothing: only the root's row is computed
    assert walk_greedy(head_rows, TreeDraft(tree, tokens, torch.zeros(tree.width, 4))) == ([50], [0])
    assert calls == [[0]]


def test_replay_ends_a_round_at_a_tie_and_only_an_open_ended_answer_drafts_its_last_token() -> None:
    assert replay(chain(2), [0, 0]) == [1]  # length-capped: the last round's own token is the answer's last
    assert replay(chain(2), AnswerRanks([0, 0], open_end=True)) == [2]  # stopped at an end token it drafted
    tied = AnswerRanks([0, 0, 0, 0, 0], ties=frozenset({1}))
    rounds = replay(chain(4), tied)
    assert rounds == [2, 1] and tie_breaks(tied, rounds) == 1  # accepted up to the tie, then a new round
    assert path_probabilities([tied], max_depth=3, max_rank=1)[(0, 0, 0)] == pytest.approx(1 / 5)  # only from 2
