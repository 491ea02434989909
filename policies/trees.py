"""Token trees for HAT verification (Ghidorah §III-C), shaped from measured draft ranks.

A round verifies w positions: the root (the last accepted token, which the worker has not seen yet) and w - 1 draft
nodes. Node i drafts the rank-`ranks[i]` candidate (0 = the draft model's top-1) of the draft distribution at its
parent; a chain of l drafts is the tree whose ranks are all 0 (w = l + 1; w = 1 is U-shape).

Why the model is built on rank sequences and not on Ghidorah's per-head accuracies. Ghidorah (Medusa heads)
estimates a path's acceptance as the product of per-depth rank accuracies, i.e. it assumes depths are independent.
HAT's draft model is autoregressive: when a tree node's path matches the target's tokens, the draft distribution at
that node is exactly the draft's distribution on the true prefix. So for greedy decoding a round starting at answer
position t accepts tree node p = (r1, ..., rd) iff the true tokens at t+1..t+d have exactly the draft ranks
r1..rd — the whole acceptance process is a function of one sequence per answer: the rank of each true token in the
draft distribution given the true prefix (`RankSequence`, recorded by the profile's offline replay; `AnswerRanks`
adds where a near-tie ends a round and how the answer ended). From it (`tandem profile` uses each one):
- `path_probabilities`: P(path) = the fraction of start positions whose rank sequence begins with the path —
  conditional on the path by construction (a confident stretch going on is in the data), no independence assumed;
- `best_tree`: the tree of w nodes with the most expected tokens, exact for any probabilities (Ghidorah's step 4,
  "add the most probable node next", is exact only with every child of any rank on its frontier, and only for
  data where no node is more probable than its parent; otherwise a small knapsack on the trie of paths);
- `replay`: the exact greedy rounds over a rank sequence (each round starts after the previous round's accepted
  drafts and its correction), i.e. the accept length a live run gets on the same prompts;
- `refine_tree`: Ghidorah's step 5 (swap leaves for frontier nodes while the replayed accept length improves).
ARCA's width choice over these trees and the profiled round time is `tandem profile`'s (app/tools/profiling/main.py).

Pure: no I/O, no clocks; times are arguments.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Per answer token after the first (the first comes from the prefill's deep state): its rank in the draft
# distribution given the true prefix. Ranks >= the profile's cap may be recorded as the cap.
RankSequence = Sequence[int]
RankPath = tuple[int, ...]  # the ranks of a node's ancestors below the root and its own


@dataclass(frozen=True)
class DraftTree:
    """A verification tree in topological order: `parents[0] == -1` (the root), `parents[i] < i` for i > 0.

    `ranks[i]`: which candidate of its parent's draft distribution node i drafts (0-based; the root's is 0 and
    unused). Children of one parent have distinct ranks. Parent indices and ranks are structure, not tokens.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        check_tree(self.parents, self.ranks)

    @property
    def width(self) -> int:
        """Positions verified per round (the root included)."""
        return len(self.parents)

    def depths(self) -> list[int]:
        return tree_depths(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths())

    def path(self, node: int) -> RankPath:
        """The rank path from the root to `node` (empty for the root)."""
        ranks: list[int] = []
        while node > 0:
            ranks.append(self.ranks[node])
            node = self.parents[node]
        return tuple(reversed(ranks))

    def children(self, node: int) -> dict[int, int]:
        """rank -> child index, for `node`."""
        return {self.ranks[i]: i for i in range(1, self.width) if self.parents[i] == node}

    def levels(self) -> list[list[int]]:
        """Node indices by depth (level 0 is [0])."""
        depths = self.depths()
        out: list[list[int]] = [[] for _ in range(max(depths) + 1)]
        for i, d in enumerate(depths):
            out[d].append(i)
        return out

    def expanded_per_level(self) -> list[int]:
        """How many nodes of each depth have children: the rows of that depth's batched draft step."""
        parents = set(self.parents[1:])
        return [sum(1 for i in level if i in parents) for level in self.levels()[:-1]]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents[1:], start=1)) and not any(self.ranks[1:])


def check_tree(parents: Sequence[int], ranks: Sequence[int] | None = None) -> None:
    """Raise ValueError unless `parents` is a topologically ordered tree (and `ranks` distinct among siblings)."""
    if not parents or parents[0] != -1:
        raise ValueError("a draft tree starts with its root: parents[0] must be -1")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must be an earlier node (0 <= parent < {i})")
    if ranks is None:
        return
    if len(ranks) != len(parents):
        raise ValueError(f"{len(ranks)} ranks for {len(parents)} nodes")
    seen: set[tuple[int, int]] = set()
    for i in range(1, len(parents)):
        if ranks[i] < 0:
            raise ValueError(f"ranks[{i}] = {ranks[i]} is negative")
        key = (parents[i], ranks[i])
        if key in seen:
            raise ValueError(f"node {parents[i]} has two children of rank {ranks[i]}")
        seen.add(key)


def chain(drafts: int) -> DraftTree:
    """The chain of `drafts` top-1 drafts (width drafts + 1)."""
    if drafts < 0:
        raise ValueError(f"drafts must be >= 0, got {drafts}")
    return DraftTree(parents=(-1, *range(drafts)), ranks=(0,) * (drafts + 1))


def from_paths(paths: Iterable[RankPath]) -> DraftTree:
    """The tree whose non-root nodes are `paths` (ancestor-closed), ordered by depth then rank path."""
    ordered = sorted(set(paths), key=lambda p: (len(p), p))
    index: dict[RankPath, int] = {(): 0}
    parents, ranks = [-1], [0]
    for p in ordered:
        if not p:
            continue
        if p[:-1] not in index:
            raise ValueError(f"path {p} has no parent {p[:-1]} in the tree")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return DraftTree(tuple(parents), tuple(ranks))


def ancestor_mask(parents: Sequence[int]) -> list[list[bool]]:
    """mask[i][j]: node i attends to node j (j is i or one of its ancestors) — the tree attention among the nodes."""
    check_tree(parents)
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (the root's is 0); a node sits at the tree's first position + its depth."""
    check_tree(parents)
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root to `node`, both included."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def is_root_path(parents: Sequence[int], nodes: Sequence[int]) -> bool:
    """`nodes` starts at the root and each next node is a child of the one before (what KEEP may keep)."""
    if not nodes or nodes[0] != 0:
        return False
    return all(0 <= b < len(parents) and parents[b] == a for a, b in itertools.pairwise(nodes))


# --- acceptance from rank sequences ------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerRanks:
    """One answer as the replay sees it: `ranks` (a RankSequence); `ties`, the indices whose true token is not the
    target's own argmax in the replay's arithmetic (a near-tie the live run broke the other way: accepting that node
    ends the round there); `open_end`: the answer stopped at an end token, so its last round may draft the end token
    itself (a length-capped answer's last round drafts at most up to its last token but one)."""

    ranks: RankSequence
    ties: frozenset[int] = frozenset()
    open_end: bool = False


Answer = RankSequence | AnswerRanks


def _answer(a: Answer) -> AnswerRanks:
    return a if isinstance(a, AnswerRanks) else AnswerRanks(a)


def path_counts(answers: Iterable[Answer], max_depth: int, max_rank: int) -> tuple[Counter[RankPath], int]:
    """(how many round starts each rank path is the true path's prefix at, the number of starts), for paths of
    depth <= max_depth with ranks < max_rank.

    Every position t with at least one answer token after it is a start (the root is the token at t; its children
    draft position t + 1). An answer's end cuts paths short, as it does in a live round; so does a tie.
    """
    counts: Counter[RankPath] = Counter()
    starts = 0
    for a in map(_answer, answers):
        seq = a.ranks
        for t in range(len(seq)):
            starts += 1
            prefix: list[int] = []
            for q in range(t, min(t + max_depth, len(seq))):
                if seq[q] >= max_rank:
                    break
                prefix.append(seq[q])
                counts[tuple(prefix)] += 1
                if q in a.ties:
                    break
    return counts, starts


def path_probabilities(answers: Iterable[Answer], max_depth: int, max_rank: int) -> dict[RankPath, float]:
    """P(a round starting at a random answer position accepts path p): `path_counts` over the starts."""
    counts, starts = path_counts(answers, max_depth, max_rank)
    return {p: c / starts for p, c in counts.items()} if starts else {}


# Without a profile: P(the true token is the draft's rank-r candidate), independent across depths — a rough prior
# for a distilled adapter (HAT's shipped one: ~43% top-1 offline), used only to shape a tree until a profile's
# measured rank sequences replace it.
PRIOR_RANK_ACCURACY = (0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.02, 0.015)


def prior_probabilities(max_depth: int, rank_accuracy: Sequence[float] = PRIOR_RANK_ACCURACY) -> dict[RankPath, float]:
    """P(path) = the product of its ranks' accuracies (Ghidorah's independence assumption, as a fallback only)."""
    out: dict[RankPath, float] = {}
    frontier: list[tuple[RankPath, float]] = [((), 1.0)]
    for _ in range(max_depth):
        nxt = []
        for path, p in frontier:
            for r, a in enumerate(rank_accuracy):
                q = p * a
                if q < 1e-6:
                    continue
                out[(*path, r)] = q
                nxt.append(((*path, r), q))
        frontier = nxt
    return out


def expected_tokens(tree: DraftTree, probabilities: dict[RankPath, float]) -> float:
    """Tokens a round yields on average: the accepted drafts plus the target's own token (1 + sum of P(node))."""
    return 1.0 + sum(probabilities.get(tree.path(i), 0.0) for i in range(1, tree.width))


def best_tree(width: int, probabilities: dict[RankPath, float]) -> DraftTree:
    """The tree of `width` nodes with the most expected tokens (`expected_tokens`) under `probabilities`: exact for
    any probabilities (a path absent from them counts 0; negative ones are refused).

    What is maximised is Σ P(node) over an ancestor-closed set of w − 1 rank paths (a node's parent is in the tree;
    its siblings need not be: rank 1 may be drafted without rank 0). Two algorithms, each exact where it runs:

    * depth-monotone data (every listed path's parent is listed with at least its probability — what
      `path_probabilities` and `prior_probabilities` produce by construction): the w − 1 most probable paths, ties to
      the shallower, then lower-ranked one. They are ancestor-closed (a parent sorts before its child), and no set
      of w − 1 paths sums higher, so this is Ghidorah's step 4 with every child of the tree, of any rank, on its
      frontier (a frontier holding only the next rank under each parent — the rule this replaces — misses e.g.
      P((1,)) = 0.5 behind P((0,)) = 0.2 at width 2: 1.2 expected tokens where 1.5 is possible);
    * anything else: a knapsack over the trie of the listed paths (best value of k nodes in each subtree, children
      merged by max-plus convolution), O(n·w²) for n listed paths.

    Either way, when fewer than w − 1 paths have a positive probability the tree is filled with zero-probability
    paths (the lowest unused rank under a node, shallowest first), so it always has exactly `width` nodes.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if any(v < 0 for v in probabilities.values()):
        raise ValueError("path probabilities must be >= 0")
    positive = {p: v for p, v in probabilities.items() if p and v > 0}
    if _depth_monotone(positive):
        chosen = sorted(positive, key=lambda p: (-positive[p], len(p), p))[: width - 1]
    else:
        chosen = _knapsack(positive, width - 1)
    return from_paths(_fill(set(chosen), width - 1))


def _depth_monotone(values: dict[RankPath, float]) -> bool:
    return all(len(p) == 1 or values.get(p[:-1], -1.0) >= v for p, v in values.items())


def _knapsack(values: dict[RankPath, float], budget: int) -> list[RankPath]:
    """The ancestor-closed set of at most `budget` paths (values >= 0) with the largest sum: tree knapsack over the
    trie of the listed paths and their ancestors."""
    if budget <= 0:
        return []
    nodes = {p[:d] for p in values if len(p) <= budget for d in range(1, len(p) + 1)}
    kids: dict[RankPath, list[RankPath]] = {}
    for p in sorted(nodes, key=lambda p: (len(p), p)):
        kids.setdefault(p[:-1], []).append(p)
    best: dict[RankPath, list[float]] = {}  # path -> best[k]: k nodes of its subtree, itself included when k >= 1
    picks: dict[RankPath, list[list[int]]] = {}  # path -> per child j, per k: nodes given to child j's subtree
    neg = float("-inf")

    def solve(p: RankPath, cap: int) -> None:  # cap: nodes p's subtree may hold (p itself included, the root not)
        inner = cap - 1 if p else cap  # what its children's subtrees may hold together
        merged = [0.0]  # merged[k]: the best k nodes among the subtrees of the children merged so far
        choice: list[list[int]] = []
        for c in kids.get(p, []):
            solve(c, inner)
            fc = best[c]
            out = [neg] * (min(inner, len(merged) + len(fc) - 2) + 1)
            arg = [0] * len(out)
            for k in range(len(out)):
                for t in range(max(0, k - len(merged) + 1), min(k, len(fc) - 1) + 1):
                    if merged[k - t] + fc[t] > out[k]:
                        out[k], arg[k] = merged[k - t] + fc[t], t
            merged = out
            choice.append(arg)
        best[p] = [0.0, *(values.get(p, 0.0) + m for m in merged)] if p else merged
        picks[p] = choice

    def collect(p: RankPath, k: int, out: list[RankPath]) -> None:
        rest = k if not p else k - 1
        if p:
            out.append(p)
        for c, arg in reversed(list(zip(kids.get(p, []), picks[p], strict=True))):
            t = arg[rest]
            if t:
                collect(c, t, out)
            rest -= t

    solve((), budget)
    root = best[()]
    k = max(range(len(root)), key=lambda i: (root[i], -i))  # values >= 0: the fullest best, ties to fewer nodes
    out: list[RankPath] = []
    collect((), k, out)
    return out


def _fill(chosen: set[RankPath], count: int) -> set[RankPath]:
    """`chosen` grown to `count` paths by zero-probability ones: the lowest unused rank under a node, shallowest
    first."""
    members = set(chosen)
    while len(members) < count:
        options = [(*p, _next_rank(members, p)) for p in members | {()}]
        members.add(min(options, key=lambda p: (len(p), p)))
    return members


def replay(tree: DraftTree, answer: Answer) -> list[int]:
    """Drafts accepted in each greedy round over one answer (exact: see the module docstring).

    A round starting after answer position t accepts the deepest node whose rank path equals the true ranks at
    t+1.. (a tie or the answer's end stops it), then the target contributes one token; the next round starts after
    that.
    """
    a = _answer(answer)
    seq, n = a.ranks, len(a.ranks)
    limit = n if a.open_end else n - 1  # drafts of a round stop before this index
    children = [tree.children(i) for i in range(tree.width)]
    accepted: list[int] = []
    t = 0  # index in `seq` of the first token this round can draft
    while t < n:
        node, k = 0, 0
        while t + k < limit and seq[t + k] in children[node]:
            node = children[node][seq[t + k]]
            k += 1
            if t + k - 1 in a.ties:
                break
        accepted.append(k)
        t += k + 1
    return accepted


def tie_breaks(answer: Answer, accepted: Sequence[int]) -> int:
    """How many of `replay`'s rounds ended on a tie."""
    a, t, n = _answer(answer), 0, 0
    for k in accepted:
        n += k > 0 and t + k - 1 in a.ties
        t += k + 1
    return n


def replay_accept_length(tree: DraftTree, answers: Iterable[Answer]) -> float:
    """Mean tokens per round (accepted drafts + 1) over greedy rounds of every answer: the live accept length."""
    rounds = [k for a in answers for k in replay(tree, a)]
    return 1.0 + sum(rounds) / len(rounds) if rounds else 1.0


def refine_tree(tree: DraftTree, answers: Sequence[Answer], max_passes: int = 3) -> DraftTree:
    """Ghidorah's step 5: replace a leaf by a frontier node (a missing child of a kept node) whenever the exact
    replay's accept length rises; repeat until a pass changes nothing (at most `max_passes`). Width is kept."""
    best = tree
    best_len = replay_accept_length(best, answers)
    for _ in range(max_passes):
        improved = False
        paths = {best.path(i) for i in range(1, best.width)}
        leaves = [p for p in paths if not any(q[:-1] == p for q in paths)]
        for leaf in sorted(leaves):
            kept = paths - {leaf}
            frontier = {(*p, r) for p in kept | {()} for r in range(_next_rank(kept, p) + 1)} - paths
            for cand in sorted(frontier, key=lambda p: (len(p), p)):
                trial = from_paths(kept | {cand})
                length = replay_accept_length(trial, answers)
                if length > best_len + 1e-12:
                    best, best_len, improved = trial, length, True
                    break
            if improved:
                break
        if not improved:
            return best
    return best


def _next_rank(paths: set[RankPath], parent: RankPath) -> int:
    """The lowest rank not yet used under `parent`."""
    used = {p[-1] for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent}
    r = 0
    while r in used:
        r += 1
    return r
