"""Offline replay of HAT's acceptance, exact for greedy decoding, for chains and token trees.

Why one teacher-forced pass suffices (app/tools/training/report.py has the chain argument): in greedy HAT the accepted
text is the LLM's greedy text G. A draft node at depth d of a round starting after G[:p+1] is accepted only if
every node on its path was, i.e. its path spells G[p+1 .. p+d]; the draft model's distribution below that node is
then its teacher-forced distribution along G at position p+d-1, whatever other branches the tree has. So a node is
named by its *rank path* (k_1, ..., k_d): the k_j-th most likely draft token at depth j, each conditional on the
path above it. With rank_q = the rank of the LLM's token G[q+1] in the draft's teacher-forced distribution at q,
the round from p accepts exactly the longest prefix of (rank_p, rank_{p+1}, ...) that is a path of the tree
(a chain of l drafts is the tree {(0,), (0, 0), ..., (0,)*l}). The rank sequence along G is all the replay needs.

From it (the tree arithmetic is policies/trees.py's, on `RankedText.answer()`):
- path counts: for every position as a round start, how often each rank path is the true path's prefix. P(node
  accepted) = count / starts, without Ghidorah's independence assumption (HAT's adapter is autoregressive:
  acceptance at depth d depends on the path); the best tree of n nodes is the n most frequent paths.
- `rank_cdf`: per depth d, P(rank at depth d <= k | the previous d-1 drafts were right), for chains (every earlier
  rank 0) and for trees (every earlier rank below top_k).
- `replay`: the exact sequential replay of a fixed tree (or chain), round after round along each text, and of
  HAT's eta rule through the live controller's own bookkeeping (the acceptance rates its plan uses).

A position where the LLM's fp32 argmax is not the text's next token (the text was generated with other arithmetic;
a near-tie broke the other way) ends a round there and is counted as a tie break, as in app/tools/training/report.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from policies import trees
from policies.drafting import AcceptanceEstimator, DraftLengthController, DraftStopRule

MISS = 1 << 30  # rank of a token the draft cannot propose (outside the reduced draft vocabulary)


@dataclass
class RankedText:
    """One text with what the replay needs at every position q (predicting q + 1)."""

    ids: list[int]
    prompt_len: int
    llm_top1: list[int]  # the LLM's argmax
    ranks: list[int]  # rank of the LLM's argmax in the draft distribution (0 = the draft's argmax; MISS)
    maxp: list[float]  # the draft distribution's max probability (the eta rule's confidence)
    # Cut by a length limit (True) or ended by an end token (False). A live run capped at a length drafts at most
    # up to the last token but one, so its own token closes the last round; one that stops at the end token may
    # draft the end token itself, and its last round's token then lies past the text.
    capped: bool = True

    @property
    def draft_limit(self) -> int:
        """Drafts of a round starting at p stop before position p + d reaches this."""
        return self.end - 1 if self.capped else self.end

    @property
    def first_round(self) -> int:
        """Where the first decode round starts: at the first answer token, which prefill produced (no drafts)."""
        return self.prompt_len

    @property
    def end(self) -> int:
        return len(self.ids) - 1  # the last position whose next token is known

    def tie(self, q: int) -> bool:
        return self.llm_top1[q] != self.ids[q + 1]

    def answer(self) -> trees.AnswerRanks:
        """The decode rounds' rank sequence (from the first round's start), for policies/trees.py's replay."""
        start = self.first_round
        ties = frozenset(q - start for q in range(start, self.end) if self.tie(q))
        return trees.AnswerRanks(self.ranks[start : self.end], ties, open_end=not self.capped)


@torch.inference_mode()
def rank_text(
    split: Any,
    adapter: Any,
    ids: Sequence[int],
    prompt_len: int,
    draft_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk: int = 256,
    capped: bool = True,
) -> RankedText:
    """Teacher-forced LLM argmax and draft ranks along `ids` (fp32 split model). `draft_head`: adapter features
    [rows, hidden] -> draft logits [rows, vocab], -inf outside a reduced draft vocabulary: the device half's own
    (DeviceHalf.draft_logits: its reduced vocabulary and int8 rows, so the replay ranks what live drafting picks
    from); None = the fp32 full head."""
    t = torch.tensor([list(ids)], dtype=torch.long)
    shallow = split.input(t)
    llm_top1 = split.output(split.middle(shallow)).argmax(-1)[0]
    feats = adapter(shallow)[0]
    ranks, maxp = [], []
    for s in range(0, feats.shape[0], chunk):
        rows = feats[s : s + chunk]
        if draft_head is not None:
            logits = draft_head(rows).float()
        else:
            logits = torch.nn.functional.linear(split.output.norm(rows), split.output.lm_head.weight).float()
        true_logit = logits.gather(1, llm_top1[s : s + chunk, None])
        rank = (logits > true_logit).sum(-1)
        inside = torch.isfinite(true_logit[:, 0])  # the LLM's token is one the draft head can propose
        ranks += torch.where(inside, rank, torch.full_like(rank, MISS)).tolist()
        maxp += torch.softmax(logits, -1).max(-1).values.tolist()
    return RankedText(list(ids), prompt_len, llm_top1.tolist(), ranks, maxp, capped)


# --- calibration statistics -------------------------------------------------------------------------


def _starts(texts: Iterable[RankedText]) -> Iterable[tuple[RankedText, int]]:
    """Every answer position as a round start: the position whose token was just accepted (the first one from
    prefill)."""
    for t in texts:
        for p in range(t.first_round, t.end):
            yield t, p


def rank_cdf(texts: Sequence[RankedText], depth: int, top_k: int) -> dict[str, Any]:
    """Per depth d: P(rank <= k | previous d-1 drafts right), k < top_k, for chains and trees (see module doc)."""
    out: dict[str, Any] = {}
    for name, right in (("chain", lambda r: r == 0), ("tree", lambda r: r < top_k)):
        hist = [[0] * (top_k + 1) for _ in range(depth)]  # last bin: rank >= top_k (or not proposable)
        for t, p in _starts(texts):
            for d in range(depth):
                q = p + d
                if q >= t.end:
                    break
                hist[d][min(t.ranks[q], top_k)] += 1
                if not right(t.ranks[q]) or t.tie(q):
                    break
        rows = []
        for d, h in enumerate(hist):
            n = sum(h)
            cum, acc = [], 0
            for k in range(top_k):
                acc += h[k]
                cum.append(round(acc / n, 5) if n else None)
            rows.append({"depth": d + 1, "samples": n, "p_rank_le": cum})
        out[name] = rows
    return out


# --- sequential replay ------------------------------------------------------------------------------------


@dataclass
class Replay:
    rounds: int = 0
    tokens: int = 0  # accepted drafts + one LLM token per round
    accepted: int = 0
    tie_breaks: int = 0
    histogram: list[int] = field(default_factory=list)
    per_round: list[int] = field(default_factory=list)  # accepted drafts of each round, in order (not in summary)

    def add_round(self, accepted: int) -> None:
        self.rounds += 1
        self.per_round.append(accepted)
        self.accepted += accepted
        self.tokens += accepted + 1
        if accepted >= len(self.histogram):
            self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1

    @property
    def accept_length(self) -> float:
        return self.tokens / max(self.rounds, 1)

    def summary(self) -> dict[str, Any]:
        return {
            "accept_length": round(self.accept_length, 4),
            "rounds": self.rounds,
            "tokens": self.tokens,
            "tie_breaks": self.tie_breaks,
            "accepted_histogram": self.histogram,
        }


def replay(texts: Sequence[RankedText], tree: trees.DraftTree) -> Replay:
    """Greedy HAT rounds verifying this tree every round, from each answer's first round to the end of its text
    (policies/trees.py's exact replay)."""
    out = Replay()
    for t in texts:
        answer = t.answer()
        rounds = trees.replay(tree, answer)
        for accepted in rounds:
            out.add_round(accepted)
        out.tie_breaks += trees.tie_breaks(answer, rounds)
    return out


def replay_eta(texts: Sequence[RankedText], eta: float, max_draft: int, include_low: bool = True) -> dict[str, Any]:
    """HAT's eta rule (Eq. 5) replayed, with the live controller's bookkeeping: the accept length and the pooled
    and confident-draft acceptance rates (policies.drafting.DraftLengthController.observe), and the pooled rate of
    fixed chains of max_draft without the stop (what "eq7" measures)."""
    out, ctl = replay_eta_rounds(texts, eta, max_draft, include_low)
    fixed = replay(texts, trees.chain(max_draft))
    rejections = sum(c for a, c in enumerate(fixed.histogram) if a < max_draft)
    chain_alpha = fixed.accepted / (fixed.accepted + rejections) if fixed.accepted + rejections else 0.0
    return {
        "accept_length": round(out.accept_length, 4),
        "rounds": out.rounds,
        "tie_breaks": out.tie_breaks,
        "alpha": {
            "chain": round(chain_alpha, 5),
            "eta": round(ctl.pooled.alpha, 5),
            "confident": round(ctl.confident.alpha, 5),
        },
    }


def replay_eta_rounds(
    texts: Sequence[RankedText], eta: float, max_draft: int, include_low: bool = True
) -> tuple[Replay, DraftLengthController]:
    """The eta rule's rounds, one by one (the Replay), and the controller that observed them."""
    rule = DraftStopRule(eta=eta, max_draft=max_draft, include_low_confidence=include_low)
    ctl = DraftLengthController(
        mode="eta",
        max_len=max_draft,
        eta=eta,
        pooled=AcceptanceEstimator(0.0, 0.0),
        confident=AcceptanceEstimator(0.0, 0.0),
    )
    out = Replay()
    for t in texts:
        p = t.first_round
        while p < t.end:
            drafted, accepted, flags = 0, 0, []
            while p + drafted < t.draft_limit:
                q = p + drafted
                keep, stop = rule.decide(t.maxp[q], drafted)
                if not keep:
                    break
                drafted += 1
                flags.append(t.maxp[q] >= eta)
                # Drafts after a rejected one change none of the bookkeeping (the round ends at the rejection), and
                # their confidences are not on the teacher-forced path: the round's replay stops here.
                if t.ranks[q] != 0:
                    break
                accepted += 1
                if t.tie(q):
                    out.tie_breaks += 1
                    break
                if stop:
                    break
            ctl.observe(drafted=drafted, accepted=accepted, confident=flags)
            out.add_round(accepted)
            p += accepted + 1
    return out, ctl
