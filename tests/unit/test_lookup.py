"""Prompt lookup's index (policies/lookup.py) and the tree a lookup round verifies (clients/hat/tree.py)."""

from __future__ import annotations

import pytest

from policies.lookup import DEPTH_BY_MATCH, NgramIndex, branch_depth, common_prefix


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one() -> None:
    index = NgramIndex(max_n=3, min_n=1)
    # "1 2 3 -> 4" once; "3 -> 9" later; the context ends in "1 2 3": the 3-gram's continuation, not the 1-gram's
    index.extend([1, 2, 3, 4, 5, 3, 9, 8, 1, 2, 3])
    assert index.propose(3) == ([4, 5, 3], 3)
    index.extend([7])  # now the suffix "7" never occurred before, nor "3 7" or "2 3 7"
    assert index.propose(4) == ([], 0)


def test_the_latest_occurrence_is_used_and_the_continuation_may_run_into_the_suffix() -> None:
    index = NgramIndex(max_n=2, min_n=1)
    index.extend([5, 6, 1, 5, 6, 2, 5, 6])
    assert index.propose(2) == ([2, 5], 2)  # "5 6" last followed by 2 (not the first occurrence's 1)
    repeat = NgramIndex()
    repeat.extend([4, 4, 4])
    assert repeat.propose(5) == ([4], 2)  # "4 4" last occurred at 0..1; what followed runs to the end


def test_sync_catches_up_and_refuses_a_context_that_shrank() -> None:
    index = NgramIndex()
    index.sync([1, 2, 3])
    index.sync([1, 2, 3, 1, 2])
    assert len(index) == 5 and index.propose(8) == ([3, 1, 2], 2)
    with pytest.raises(ValueError, match="shrank"):
        index.sync([1, 2])
    assert index.propose(0) == ([], 0) and NgramIndex().propose(4) == ([], 0)
    with pytest.raises(ValueError):
        NgramIndex(max_n=1, min_n=2)


def test_common_prefix_counts_the_shared_leading_tokens() -> None:
    assert common_prefix([7, 8, 9], [7, 8, 1, 2]) == 2
    assert common_prefix([7, 8], [7, 8, 9]) == 2  # the proposal goes on past the chain
    assert common_prefix([], [1]) == 0 and common_prefix([1], [2]) == 0


def test_the_lookup_tree_hangs_the_branch_where_it_leaves_the_chain() -> None:
    from clients.hat.tree import lookup_tree

    tree = lookup_tree(3, 1, 2)  # chain nodes 1..3, branch 4..5 leaving after the first draft
    assert tree.parents == (-1, 0, 1, 2, 1, 4) and tree.ranks == (0, 0, 0, 0, 1, 0)
    assert tree.children(1) == {0: 2, 1: 4} and tree.depth == 3
    past = lookup_tree(2, 2, 3)  # the proposal continues the whole chain: the chain's rank-0 continuation
    assert past.parents == (-1, 0, 1, 2, 3, 4) and past.is_chain()
    bare = lookup_tree(0, 0, 2)  # no drafts at all: the branch from the root
    assert bare.parents == (-1, 0, 1)
    with pytest.raises(ValueError):
        lookup_tree(2, 3, 1)
    with pytest.raises(ValueError):
        lookup_tree(2, 1, 0)


def test_branch_depth_grows_with_the_match_and_keeps_to_the_cap() -> None:
    assert [branch_depth(n, 4) for n in (1, 2, 3)] == [1, 3, 4]
    assert branch_depth(3, 16) == DEPTH_BY_MATCH[3] and branch_depth(5, 16) == DEPTH_BY_MATCH[3]
    assert branch_depth(2, 0) == 0
