"""Prompt lookup: drafts copied from the generation's own context (prompt lookup decoding, Saxena 2023; vLLM's
n-gram proposer; LLMA, Yang et al. 2023).

Answers repeat their prompt and themselves: names, code identifiers, a list's structure, a phrase said twice. Where
the context's last n tokens occurred before, the tokens that followed that occurrence are a draft that costs no model
call. HAT verifies it as a branch of the round's token tree beside the draft model's chain (clients/hat/tree.py
lookup_tree), so a round accepts whichever of the two goes further, and greedy output stays the LLM's.

`NgramIndex` keeps, for every n in min_n..max_n, where each n-gram of the context last occurred, updated as tokens
are appended (O(max_n) a token), so a proposal costs a dictionary lookup per n however long the context.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_N = 3  # the longest suffix matched: longer ones add almost nothing measured (BENCHMARKS.md, prompt lookup)
MIN_N = 1  # a single repeated token's continuation is right about one time in five: worth one node
# How many of a proposal's tokens are worth a node in the tree, by the length n of the match it came from. A node
# costs the worker a row and the device an input-layer row; it pays when the walk reaches it. Measured on held-out
# corpus answers (not the benchmark's prompts), the shipped adapter's chain beside it: the branch reaches depth
# 1 / 2 / 3 / 4 in 18 / 10 / 6 / 4 % of rounds after a 1-token match, 42 / 26 / 16 / 10 % after 2 tokens,
# 56 / 43 / 35 / 27 % after 3 (BENCHMARKS.md, "Lookup branches"): nodes reached in under ~15 % are left out.
DEPTH_BY_MATCH = {1: 1, 2: 3, 3: 8}


class NgramIndex:
    """The context's n-grams (min_n <= n <= max_n), each mapped to where the token after its latest occurrence is."""

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the context. Each new token is the continuation of the n-grams that end just before it."""
        for token in tokens:
            i = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._after[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(int(token))

    def sync(self, context: Sequence[int]) -> None:
        """Catch up with `context`, the whole context so far (the index's tokens must be its prefix)."""
        if len(context) < len(self.tokens):
            raise ValueError(f"the context shrank from {len(self.tokens)} to {len(context)} tokens")
        self.extend(context[len(self.tokens) :])

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's longest matching suffix
        (max_n tokens first, down to min_n), and that suffix's length n; ([], 0) when no suffix occurred before."""
        toks = self.tokens
        if k > 0:
            for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
                start = self._after.get(tuple(toks[len(toks) - n :]))
                if start is not None:
                    return toks[start : start + k], n
        return [], 0


def branch_depth(match: int, most: int) -> int:
    """Nodes worth verifying of a proposal from a `match`-token suffix match, at most `most` (DEPTH_BY_MATCH)."""
    return min(most, DEPTH_BY_MATCH.get(match, DEPTH_BY_MATCH[max(DEPTH_BY_MATCH)]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: where a lookup proposal leaves the draft chain (its own nodes in
    a round's tree start after them), or how much of a cached context a prompt can reuse (clients/llamacpp.py)."""
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return shared
