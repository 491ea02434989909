"""Token-tree rounds on the device half: draft a tree depth by depth, verify its accepted path lazily, keep that path.

A tree (policies/trees.py DraftTree, level-ordered: every node's index is larger than those of all shallower nodes)
is drafted from the last accepted token (the root) one depth at a time: each depth is ONE batched step of the input
submodel + adapter over all of that depth's nodes (node i at position root + depth(i), seeing the cache and its own
ancestors only), and the draft head's top-k at each node with children gives them their tokens by rank. The worker
gets the shallow states of all w nodes (and the TREE structure) and returns w deep states. The head then walks the
tree from the root: the target's token at a node picks the child drafting it, until no child does; only the rows
on that path go through the head (one row each — the head over a full vocabulary is the device's biggest cost).
Both caches, the device's and the worker's (KEEP), then keep exactly the committed prefix and that path.

A lookup round's tree (`lookup_tree`, `draft_lookup`): the draft model's chain, drafted as a chain round drafts it,
and beside it a branch of tokens copied from the context (policies/lookup.py) leaving the chain where the two part;
the branch's nodes go through the input layers and the adapter in one batched call (their tokens are known: no draft
head, no step per depth). Verified, walked and kept like any tree.

Greedy only: the walk is exact greedy verification, so the output equals U-shape token for token. Sampling keeps
the chain with rejection sampling (multi-candidate rejection sampling over a tree is not implemented).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from clients.hat.drafting import Draft, Drafter, DraftState
from clients.hat.half import DeviceHalf
from clients.hat.ragged import ancestor_tensor
from policies.trees import DraftTree


@dataclass
class TreeDraft:
    tree: DraftTree
    tokens: list[int]  # per node; tokens[0] is the root (the last accepted token)
    shallow: torch.Tensor  # [w, hidden], node order
    input_seconds: float = 0.0  # of its drafting, the time in the input layers (the round's profile)


def check_level_ordered(tree: DraftTree) -> None:
    order = [i for level in tree.levels() for i in level]
    if order != list(range(tree.width)):
        raise ValueError("a drafted tree must be level-ordered (node indices grow with depth)")


def draft_tree(drafter: Drafter, st: DraftState, token: int, position: int, tree: DraftTree) -> TreeDraft:
    """Draft `tree` after `token` at `position`; appends all w nodes to the draft caches (slots position + i)."""
    check_level_ordered(tree)
    w = tree.width
    ancestors = ancestor_tensor(tree.parents)
    tokens = [token] + [-1] * (w - 1)
    has_children = [False] * w
    for p in tree.parents[1:]:
        has_children[p] = True
    shallows: list[torch.Tensor] = []
    input_seconds = 0.0
    with torch.inference_mode():
        for depth, level in enumerate(tree.levels()):
            ids = torch.tensor([[tokens[i] for i in level]], dtype=torch.long)
            first, last = level[0], level[-1] + 1  # level-ordered: the level is nodes first..last-1
            cached = len(st.input_cache)
            mask = torch.ones(len(level), cached + len(level), dtype=torch.bool)
            mask[:, position:] = ancestors[first:last, :last]  # the tree's nodes: own ancestors only
            positions = torch.full((len(level),), position + depth, dtype=torch.long)
            t0 = time.perf_counter()
            shallow = drafter.half.input(ids, st.input_cache, positions=positions, attention_mask=mask)
            input_seconds += time.perf_counter() - t0
            feats = drafter.half.adapter(shallow, st.adapter_cache, positions=positions, attention_mask=mask)
            shallows.append(shallow[0])
            parents = [i for i in level if has_children[i]]
            if not parents:
                continue
            rows = torch.tensor([i - first for i in parents])
            logits = drafter.half.draft_logits(feats[0, rows], position + depth)
            children = tree.children
            k = 1 + max(r for i in parents for r in children(i))
            top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices.tolist()
            for row, parent in enumerate(parents):
                for rank, child in children(parent).items():
                    tokens[child] = top[row][rank]
    return TreeDraft(tree, tokens, torch.cat(shallows), input_seconds)


def lookup_tree(chain: int, shared: int, branch: int) -> DraftTree:
    """A chain of `chain` drafts (nodes 1..chain) and a branch of `branch` nodes (after them) whose first node's
    parent is chain node `shared` (0: the root): the branch is the first node's rank-1 sibling of the chain's next
    draft, or, past the chain's end, the chain's rank-0 continuation."""
    if not 0 <= shared <= chain or branch < 1:
        raise ValueError(f"no lookup branch of {branch} nodes after node {shared} of a {chain}-draft chain")
    first = chain + 1
    parents = [-1, *range(chain), shared, *range(first, first + branch - 1)]
    ranks = [0] * (chain + 1) + [1 if shared < chain else 0] + [0] * (branch - 1)
    return DraftTree(tuple(parents), tuple(ranks))


def draft_lookup(
    drafter: Drafter, st: DraftState, token: int, draft: Draft, branch: list[int], shared: int, position: int
) -> TreeDraft:
    """The round's tree after a chain `draft` from `token` at `position` (its nodes already in the draft caches,
    slots position..position + len(draft.tokens)): the lookup `branch` leaving the chain after its first `shared`
    drafts, appended to both caches in one batched call (slots after the chain's, node order)."""
    k = len(draft.tokens)
    tree = lookup_tree(k, shared, len(branch))
    cached = len(st.input_cache)
    if cached != position + k + 1:
        raise RuntimeError(f"draft caches hold {cached} positions, not the {k}-draft chain's {position + k + 1}")
    first = k + 1
    ancestors = ancestor_tensor(tree.parents)
    mask = torch.ones(len(branch), cached + len(branch), dtype=torch.bool)
    mask[:, position:] = ancestors[first:, :]
    positions = torch.arange(position + shared + 1, position + shared + 1 + len(branch))
    with torch.inference_mode():
        ids = torch.tensor([branch], dtype=torch.long)
        t0 = time.perf_counter()
        shallow = drafter.half.input(ids, st.input_cache, positions=positions, attention_mask=mask)
        input_seconds = time.perf_counter() - t0
        drafter.half.adapter(shallow, st.adapter_cache, positions=positions, attention_mask=mask)
    tokens = [token, *draft.tokens, *branch]
    return TreeDraft(tree, tokens, torch.cat([draft.shallow, shallow[0]]), draft.input_seconds + input_seconds)


def walk_greedy(head_rows: Callable[[list[int]], torch.Tensor], draft: TreeDraft) -> tuple[list[int], list[int]]:
    """Greedy verification along the tree: (new tokens = the accepted drafts + the target's next token, the kept
    path's node indices from the root). `head_rows(nodes)` = the target's logits at those nodes, [len, vocab].

    The head runs lazily, like a chain's verification: the root alone first (its draft is rejected about half the
    time), then, once the walk enters a child, that child and its top-1 descendants in one call (a confident
    stretch tends to go on, and a head call of 4 rows costs about twice one row, not four times)."""
    tree = draft.tree
    children = [{draft.tokens[c]: c for c in tree.children(i).values()} for i in range(tree.width)]
    top1 = [tree.children(i).get(0) for i in range(tree.width)]
    logits: dict[int, torch.Tensor] = {}
    node, path, new = 0, [0], []
    while True:
        if node not in logits:
            rows = [node]
            while node and top1[rows[-1]] is not None:
                rows.append(top1[rows[-1]])
            logits.update(zip(rows, head_rows(rows), strict=True))
        t = int(logits[node].argmax())
        new.append(t)
        child = children[node].get(t)
        if child is None:
            return new, path
        node = child
        path.append(node)


def keep_path(st: DraftState, position: int, path: list[int]) -> None:
    """The draft caches keep the committed prefix (before the root at `position`) and the path's nodes."""
    slots = [*range(position), *(position + n for n in path)]
    st.input_cache.keep(slots)
    st.adapter_cache.keep(slots)


def verify_tree(
    half: DeviceHalf, st: DraftState, deep: torch.Tensor, draft: TreeDraft, position: int
) -> tuple[list[int], list[int]]:
    """walk_greedy with the device's head over the tree's deep states [w, hidden], then the draft caches cut to the
    kept path: (new tokens, the path's node indices)."""
    with torch.inference_mode():
        new, path = walk_greedy(lambda rows: half.argmax_rows(deep[rows]), draft)
    keep_path(st, position, path)
    return new, path
