"""Verification of a chain of drafts against the LLM's head (HAT §3.4), as a function of the head's logits.

Given the drafts (and the distributions they were picked from) and the head's raw logits at the k+1 verified
positions — the last accepted token's and each draft's — greedy accepts the longest prefix of drafts equal to the
argmax and adds the argmax after it (the correction, or a bonus token when all were accepted); sampling uses
speculative rejection sampling (accept draft d with probability min(1, p(d)/q(d)), else resample from
max(0, p - q)), so the output is distributed exactly as the LLM's at the same temperature and top-p.

Each position's logits are adjusted as plain decoding would see them: penalties / logit_bias with the drafts before
it counted, then the grammar's mask with the grammar advanced over those drafts (walked tentatively, stepped back
before returning). The head is a function of a row range, called lazily: on greedy raw logits the first position
alone first (its draft is rejected about half the time with a weak adapter, and the head is the device's biggest
cost), then the rest; otherwise all k+1 rows at once. `verify_draft` changes nothing outside it (the grammar is
left where it was); `verify_round` then cuts a stream's draft caches to what was accepted and reads logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from clients.hat.drafting import Draft, DraftState
from clients.hat.request_sampling import Sampling
from clients.sampling import probabilities, speculative_sample, token_logprob

Head = Callable[[int, int], torch.Tensor]  # (lo, hi) -> the head's raw float logits at verified rows lo..hi-1


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted drafts, then the LLM's own next token
    accepted: int  # drafts accepted
    logits: list[torch.Tensor]  # the head's raw logits at each of `tokens`' positions (for logprobs)


@dataclass(frozen=True)
class VerifyJob:
    """One stream's verification: its draft caches, the deep states of its k+1 positions from `position`, its draft."""

    state: DraftState
    deep: torch.Tensor  # [k+1, hidden]
    draft: Draft
    position: int  # of the last accepted token (the first verified row)
    sampling: Sampling


def verify_draft(draft: Draft, head: Head, sampling: Sampling) -> Verdict:
    """The accepted drafts and the next token from the head's logits at the draft's k+1 positions."""
    mask, adjust = sampling.mask, sampling.adjust
    k = len(draft.tokens)
    walked = [0, True]  # drafts the grammar has tentatively consumed; whether all so far fitted it

    def constrain(j: int, row: torch.Tensor) -> torch.Tensor:
        """Position j's logits masked by the grammar advanced over drafts 0..j-1 (as plain decoding would see them
        had it chosen those drafts). Past a draft the grammar refuses, positions are never reached (that draft has
        probability 0 in its own masked row and is rejected): left unmasked."""
        assert mask is not None
        while walked[0] < j and walked[1]:
            if mask.try_accept(draft.tokens[walked[0]]):
                walked[0] += 1
            else:
                walked[1] = False
        return mask.apply(row) if walked[0] == j else row

    rows: list[torch.Tensor] = []  # what the pick compares: scores (greedy) or probabilities (sampling)
    raw: list[torch.Tensor] = []  # the head's own logits

    def target(i: int) -> torch.Tensor:
        if i >= len(rows):
            logits = head(len(rows), 1 if not rows else k + 1)
            raw.extend(logits)
            if adjust is not None:  # position j follows drafts 0..j-1: they count for its penalties
                logits = torch.stack(
                    [adjust.apply(row, draft.tokens[:j]) for j, row in enumerate(logits, start=len(rows))]
                )
            if mask is not None:  # after penalties, as in plain decoding
                logits = torch.stack([constrain(j, row) for j, row in enumerate(logits, start=len(rows))])
            rows.extend(
                logits
                if sampling.greedy
                else probabilities(logits, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
            )
        return rows[i]

    try:
        if sampling.greedy:
            a = 0
            while a < k and draft.tokens[a] == int(target(a).argmax()):
                a += 1
            nxt = int(target(a).argmax())
        else:
            a, nxt = speculative_sample(target, draft.dists, draft.tokens, sampling.generator)
    finally:
        if mask is not None:
            mask.rollback(walked[0])  # the emitted tokens are accepted as they are delivered
    tokens = [*draft.tokens[:a], nxt]
    return Verdict(tokens, a, raw[: len(tokens)])


def verify_round(job: VerifyJob, head: Head, token_bytes: Callable[[int], bytes]) -> tuple[Verdict, list | None]:
    """verify_draft on the model thread's terms: the stream's draft caches cut to the accepted prefix + the next
    token's slot, and the new tokens' logprobs when the request asked for them (`token_bytes`: id -> its bytes)."""
    with torch.inference_mode():
        verdict = verify_draft(job.draft, head, job.sampling)
        job.state.crop(job.position + verdict.accepted + 1)
        top = job.sampling.logprobs
        lps = None
        if top is not None:
            pairs = zip(verdict.logits, verdict.tokens, strict=True)
            lps = [token_logprob(row, t, top, token_bytes) for row, t in pairs]
    return verdict, lps
