"""HAT's verification as a function of the head's logits (clients/hat/verify.py) on scripted logits, and the request's
Sampling value (clients/hat/request_sampling.py): greedy and sampled acceptance, the correction token, the accepted
count, the lazy head, penalties and grammar applied per position as plain decoding would, and the round's effects
(caches cut, logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from clients.base import GenerationRequest
from clients.hat.drafting import Draft
from clients.hat.request_sampling import Sampling
from clients.hat.verify import VerifyJob, verify_draft, verify_round

V = 8
NEG = float("-inf")


def peaked(*tokens: int) -> torch.Tensor:
    """Logit rows [len(tokens), V], row i's argmax at tokens[i] (others below by 1..V)."""
    rows = -torch.arange(1.0, V + 1).repeat(len(tokens), 1)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


class ScriptedHead:
    """The head's raw logits for rows lo..hi-1 of a fixed table, recording every call."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.calls: list[tuple[int, int]] = []

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        self.calls.append((lo, hi))
        return self.logits[lo:hi]


def draft_of(tokens: list[int], dists: list[torch.Tensor] | None = None) -> Draft:
    dists = dists if dists is not None else [torch.softmax(peaked(t)[0], -1) for t in tokens]
    return Draft(tokens, dists, torch.zeros(len(tokens) + 1, 4))


GREEDY = Sampling()


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_greedy_accepts_every_matching_draft_and_adds_the_bonus_token() -> None:
    head = ScriptedHead(peaked(2, 5, 7, 3))
    verdict = verify_draft(draft_of([2, 5, 7]), head, GREEDY)
    assert verdict.tokens == [2, 5, 7, 3] and verdict.accepted == 3
    assert head.calls == [(0, 1), (1, 4)]  # the first row alone, then the rest
    assert all(torch.equal(a, b) for a, b in zip(verdict.logits, head.logits, strict=True))


def test_greedy_rejection_gives_the_heads_correction_and_runs_the_head_on_the_first_row_only() -> None:
    head = ScriptedHead(peaked(4, 5, 7, 3))
    verdict = verify_draft(draft_of([2, 5, 7]), head, GREEDY)
    assert verdict.tokens == [4] and verdict.accepted == 0
    assert head.calls == [(0, 1)]


def test_greedy_accepts_the_longest_matching_prefix() -> None:
    head = ScriptedHead(peaked(2, 5, 1, 3))
    verdict = verify_draft(draft_of([2, 5, 7]), head, GREEDY)
    assert verdict.tokens == [2, 5, 1] and verdict.accepted == 2
    assert [int(row.argmax()) for row in verdict.logits] == [2, 5, 1]  # the logits at each new token's position


def test_no_drafts_is_one_plain_greedy_step() -> None:
    head = ScriptedHead(peaked(6))
    verdict = verify_draft(draft_of([]), head, GREEDY)
    assert verdict.tokens == [6] and verdict.accepted == 0 and head.calls == [(0, 1)]


# --- sampling -------------------------------------------------------------------------------------------------------


def test_sampling_accepts_drafts_the_target_agrees_with_and_samples_the_bonus() -> None:
    logits = peaked(2, 5, 0)
    logits[2] = torch.full((V,), NEG)
    logits[2, 3] = 0.0  # the position after the drafts: only token 3 possible
    dists = [torch.softmax(logits[i], -1) for i in range(2)]  # q = p: every draft is accepted
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0))
    verdict = verify_draft(draft_of([2, 5], dists), ScriptedHead(logits), sampling)
    assert verdict.tokens == [2, 5, 3] and verdict.accepted == 2


def test_sampling_rejects_a_draft_the_target_never_picks_and_corrects_from_the_residual() -> None:
    logits = torch.full((3, V), NEG)
    logits[0, 6] = 0.0  # the target is sure of 6 where the draft said 2
    logits[1:, 0] = 0.0
    q = torch.zeros(V)
    q[2] = 1.0
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0))
    verdict = verify_draft(draft_of([2, 4], [q, q]), ScriptedHead(logits), sampling)
    assert verdict.tokens == [6] and verdict.accepted == 0


def test_sampled_output_is_distributed_as_the_target() -> None:
    """p = (0.2, 0.8) at the first position, the draft always proposes token 0 (q = (1, 0)): accepted with
    probability p(0)/q(0) = 0.2, else the residual max(0, p - q) = (0, 0.8) gives token 1; overall P(0) = 0.2."""
    logits = torch.full((2, V), NEG)
    logits[0, 0], logits[0, 1] = math.log(0.2), math.log(0.8)
    logits[1, 5] = 0.0
    q = torch.zeros(V)
    q[0] = 1.0
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(7))
    firsts = [verify_draft(draft_of([0], [q]), ScriptedHead(logits), sampling).tokens[0] for _ in range(4000)]
    share = firsts.count(0) / len(firsts)
    assert set(firsts) == {0, 1} and abs(share - 0.2) < 0.025


# --- penalties and grammar, per position ----------------------------------------------------------------------------


class Penalty:
    """A LogitAdjuster stand-in: every token already among the drafts before a position loses 10 there."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def apply(self, row: torch.Tensor, extra: list[int]) -> torch.Tensor:
        self.seen.append(list(extra))
        out = row.clone()
        for t in extra:
            out[t] -= 10.0
        return out


def test_penalties_count_the_drafts_before_each_position() -> None:
    logits = peaked(2, 2, 2)
    logits[1, 4] = 4.0  # second best at position 1
    penalty = Penalty()
    verdict = verify_draft(draft_of([2, 2]), ScriptedHead(logits), Sampling(adjust=penalty))  # type: ignore[arg-type]
    assert verdict.tokens == [2, 4] and verdict.accepted == 1  # plain decoding would not repeat 2 at position 1
    assert penalty.seen[:2] == [[], [2]]
    assert int(verdict.logits[1].argmax()) == 2  # the raw logits stay raw (logprobs)


class Grammar:
    """A TokenMask stand-in: token 5 is never allowed; records the prefix each masked row was seen after."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.masked_after: list[list[int]] = []

    def try_accept(self, token: int) -> bool:
        if token == 5:
            return False
        self.accepted.append(token)
        return True

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        self.masked_after.append(list(self.accepted))
        out = row.clone()
        out[5] = NEG
        return out

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n :]


def test_grammar_masks_each_position_after_the_drafts_before_it_and_is_left_where_it_was() -> None:
    logits = peaked(2, 5, 0)
    logits[1, 3] = 4.0  # what the grammar leaves at position 1
    grammar = Grammar()
    verdict = verify_draft(draft_of([2, 5]), ScriptedHead(logits), Sampling(mask=grammar))  # type: ignore[arg-type]
    assert verdict.tokens == [2, 3] and verdict.accepted == 1
    assert grammar.masked_after[:2] == [[], [2]]
    assert grammar.accepted == []  # stepped back: the delivered tokens are accepted as they are emitted


# --- a round on the model thread's terms ----------------------------------------------------------------------------


class Caches:
    def __init__(self) -> None:
        self.cropped: list[int] = []

    def crop(self, n: int) -> None:
        self.cropped.append(n)


def test_verify_round_cuts_the_caches_to_the_accepted_prefix_and_reads_logprobs() -> None:
    logits = peaked(2, 5, 1, 3)
    caches = Caches()
    job = VerifyJob(caches, torch.zeros(4, 4), draft_of([2, 5, 7]), 10, Sampling(logprobs=2))  # type: ignore[arg-type]
    verdict, lps = verify_round(job, ScriptedHead(logits), lambda i: bytes([65 + i]))
    assert verdict.tokens == [2, 5, 1] and caches.cropped == [10 + 2 + 1]
    assert lps is not None and len(lps) == 3
    for lp, row, t in zip(lps, logits[:3], verdict.tokens, strict=True):
        assert lp.logprob == pytest.approx(float(torch.log_softmax(row, -1)[t]))
        assert lp.bytes == bytes([65 + t]) and len(lp.top) == 2
    without = VerifyJob(caches, torch.zeros(4, 4), draft_of([2, 5, 7]), 10, GREEDY)  # type: ignore[arg-type]
    assert verify_round(without, ScriptedHead(logits), lambda i: b"")[1] is None


# --- the Sampling value ---------------------------------------------------------------------------------------------


def test_sampling_of_a_request_and_the_shortcuts_it_allows() -> None:
    req = GenerationRequest(prompt_text="", temperature=0.7, top_p=0.9, logprobs=3)
    gen = torch.Generator()
    s = Sampling.of(req, gen)
    assert (s.temperature, s.top_p, s.generator, s.logprobs, s.adjust, s.mask) == (0.7, 0.9, gen, 3, None, None)
    assert not s.greedy and not s.raw_argmax and not s.allows_tree and not s.argmax_only
    plain = Sampling()
    assert plain.greedy and plain.raw_argmax and plain.allows_tree and plain.argmax_only
    assert Sampling(logprobs=0).raw_argmax and not Sampling(logprobs=0).allows_tree  # trees skip positions' logits
    assert not Sampling(logprobs=0).argmax_only  # logprobs read the whole distribution: the fp32 head
    assert not Sampling(adjust=Penalty()).raw_argmax  # type: ignore[arg-type]
    assert not Sampling(mask=Grammar()).raw_argmax  # type: ignore[arg-type]
    assert not Sampling(mask=Grammar()).argmax_only  # type: ignore[arg-type]
