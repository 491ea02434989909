"""The device's draft model w_S = H o Lambda o w^m (HAT §3.4-3.5): drafting, and parallel drafting's branches.

The input submodel w^m and the adapter Lambda each keep a KV cache per generation (DraftState); the draft head H
is the device half's (clients/hat/half.py; a reduced draft vocabulary lives there). Drafting stops by the Eq. 5
rule. Parallel drafting forks the caches into one batch row per top-k alternative to the last draft and drafts all
rows at once; when the verified correction is one of them, that row becomes the generation's state and its drafts
the next draft. Proactive drafting's branch (Drafter.ahead) is one such row, continuing after the last draft from the
draft head's guess for the token an all-accepted verification adds. Everything here runs on the backend's model thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from clients.hat.half import DeviceHalf
from clients.hat.request_sampling import Sampling
from clients.hat.split import SplitKVCache
from clients.sampling import choose
from policies.drafting import DraftStopRule
from policies.lookup import NgramIndex


@dataclass
class Draft:
    tokens: list[int]
    dists: list[torch.Tensor]  # the distribution each draft was chosen from (softmax at temperature 0)
    shallow: torch.Tensor  # [k+1, hidden]: last accepted token + drafts
    input_seconds: float = 0.0  # of its drafting, the time in the input layers (the round's profile)
    # the adapter's features [1, hidden] of the last token fed (the last draft): the draft head's input for the token
    # after it, which proactive drafting guesses (None: not kept, e.g. a prepared draft cut to a shorter cap)
    last_feats: torch.Tensor | None = None


@dataclass
class Branches:
    """Parallel drafting (Eq. 6): drafts continuing each top-k candidate for the last draft position, batched."""

    position: int  # where the candidates go (the last draft's position)
    candidates: list[int]
    input_cache: SplitKVCache  # K rows (one per candidate), sharing positions
    adapter_cache: SplitKVCache
    tokens: list[list[int]] = field(default_factory=list)  # per step: the K rows' chosen drafts
    probs: list[list[float]] = field(default_factory=list)  # per step: their probabilities
    dists: list[torch.Tensor] = field(default_factory=list)  # per step: [K, vocab]
    shallows: list[torch.Tensor] = field(default_factory=list)  # per fed step: [K, hidden] (step 0 = candidates)
    feats: list[torch.Tensor] = field(default_factory=list)  # per fed step: the adapter's features [K, hidden]


@dataclass
class DraftState:
    """One generation's draft-model caches, and the next round's draft if parallel drafting prepared it."""

    input_cache: SplitKVCache
    adapter_cache: SplitKVCache
    prepared: Draft | None = None
    prepared_at: tuple[int, int] | None = None  # (token, position) the prepared draft continues
    lookup: NgramIndex | None = None  # the generation's context indexed for lookup branches (clients/hat/rounds.py)

    def crop(self, n: int) -> None:
        self.input_cache.crop(n)
        self.adapter_cache.crop(n)


class DraftRun:
    """One draft in progress, fed one token at a time by a driver that owns the forward passes: Drafter.draft for
    one generation, the drafting station (clients/hat/station.py) for several at once. Here: what to feed next, and
    the Eq. 5 stop rule, the cap and the grammar deciding each draft from the head's logits."""

    def __init__(self, rule: DraftStopRule, token: int, position: int, cap: int, sampling: Sampling) -> None:
        self.rule, self.sampling, self.mask = rule, sampling, sampling.mask
        self.token, self.position = token, position  # the next token to feed and where it goes
        self.cap = cap
        self.tokens: list[int] = []
        self.dists: list[torch.Tensor] = []
        self.shallows: list[torch.Tensor] = []
        self.stop = cap <= 0  # the token being fed is the last one: no head call after it
        self.done = False
        self.input_seconds = 0.0  # in the input layers (its share, when fed beside other streams)
        self.last_feats: torch.Tensor | None = None

    def fed(self, shallow: torch.Tensor, feats: torch.Tensor | None = None) -> bool:
        """The fed token's shallow state [1, hidden] (and its adapter features); True when the head's logits at its
        position are wanted next."""
        self.shallows.append(shallow)
        self.last_feats = feats
        if self.stop:
            self.done = True
        return not self.done

    def decide(self, logits: torch.Tensor) -> None:
        """The draft head's logits [vocab] after the fed token: keep a draft (and feed it next) or stop."""
        mask = self.mask
        if mask is not None:
            logits = mask.apply(logits)
            if not torch.isfinite(logits).any():  # a reduced draft vocabulary without an allowed token
                self.done = True
                return
        d, probs = choose(
            logits,
            self.sampling.temperature,
            self.sampling.top_p,
            self.sampling.generator,
            self.sampling.top_k,
            self.sampling.min_p,
        )
        keep, stop = self.rule.decide(float(probs[d]), len(self.tokens))
        if not keep:
            self.done = True
            return
        if mask is not None:
            if not mask.try_accept(d):
                self.done = True
                return
            stop = stop or mask.finished
        self.tokens.append(d)
        self.dists.append(probs)
        self.stop = stop or len(self.tokens) >= self.cap
        self.token, self.position = d, self.position + 1

    def finish(self) -> Draft:
        if self.mask is not None:
            self.mask.rollback(len(self.tokens))
        return Draft(self.tokens, self.dists, torch.cat(self.shallows), self.input_seconds, self.last_feats)


class Drafter:
    """The device half's draft model (input submodel + adapter + draft head), with the Eq. 5 stop rule and
    `candidates` parallel branches."""

    def __init__(self, half: DeviceHalf, rule: DraftStopRule, candidates: int) -> None:
        self.half = half
        self.rule = rule
        self.candidates = candidates

    def new_state(self) -> DraftState:
        return DraftState(self.half.input.new_cache(), self.half.adapter.new_cache())

    def _feed(
        self,
        ids: torch.Tensor,
        input_cache: SplitKVCache,
        adapter_cache: SplitKVCache,
        position: int,
        run: DraftRun | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [rows, n] at `position` -> (shallow states, adapter features), appending to both caches; the
        input layers' time is added to `run`'s."""
        t0 = time.perf_counter()
        shallow = self.half.input(ids, input_cache, positions=position)
        if run is not None:
            run.input_seconds += time.perf_counter() - t0
        return shallow, self.half.adapter(shallow, adapter_cache, positions=position)

    def prefill(self, st: DraftState, ids: list[int], start: int) -> torch.Tensor:
        """A prompt chunk's shallow states; the adapter sees the chunk too, since the draft model attends to it."""
        with torch.inference_mode():
            shallow, _ = self._feed(torch.tensor([ids], dtype=torch.long), st.input_cache, st.adapter_cache, start)
        return shallow[0]

    def draft(self, st: DraftState, token: int, position: int, cap: int, sampling: Sampling) -> Draft:
        """Draft up to `cap` tokens after `token` (Eq. 5 stop rule); shallow states of token + drafts.

        `sampling.mask` (clients.grammar.TokenMask, a constrained request's): every draft is chosen from the head's
        logits masked by the grammar advanced over the drafts before it; the grammar is stepped back to where it was
        before returning. Drafting stops where the grammar is complete (nothing but the end may follow)."""
        run = DraftRun(self.rule, token, position, cap, sampling)
        with torch.inference_mode():
            while not run.done:
                ids = torch.tensor([[run.token]], dtype=torch.long)
                shallow, feats = self._feed(ids, st.input_cache, st.adapter_cache, run.position, run)
                if run.fed(shallow[0], feats[:, -1]):
                    run.decide(self.half.draft_logits(feats[:, -1], run.position)[0])
        return run.finish()

    def take_prepared(self, st: DraftState, position: int, cap: int) -> Draft:
        """The prepared draft, cut to this round's cap (its caches cut to match)."""
        draft = st.prepared
        assert draft is not None
        k = min(len(draft.tokens), max(cap, 0))
        if k < len(draft.tokens):
            st.crop(position + k + 1)
            return Draft(draft.tokens[:k], draft.dists[:k], draft.shallow[: k + 1])
        return draft

    def branch(self, st: DraftState, draft: Draft, position: int) -> Branches | None:
        """Candidates: the top alternatives to the last draft at its position; caches forked before that position."""
        at = position + len(draft.tokens)
        dist = draft.dists[-1]
        top = torch.topk(dist, min(self.candidates + 1, dist.numel())).indices.tolist()
        candidates = [t for t in top if t != draft.tokens[-1]][: self.candidates]
        rows = len(candidates)
        if not rows:
            return None
        return Branches(at, candidates, st.input_cache.fork(rows, at), st.adapter_cache.fork(rows, at))

    def ahead(self, st: DraftState, draft: Draft, position: int) -> Branches | None:
        """Proactive drafting (SpecEdge): one branch continuing the draft as if the worker accepted all of it. Its
        candidate is the draft head's top pick after the last draft — the guess for the token verification adds
        after an all-accepted draft — and its caches are forked after the last draft. None when there is nothing to
        continue from."""
        if not draft.tokens or draft.last_feats is None:
            return None
        at = position + len(draft.tokens) + 1
        with torch.inference_mode():
            guess = int(self.half.draft_logits(draft.last_feats, at - 1)[0].argmax())
        return Branches(at, [guess], st.input_cache.fork(1, at), st.adapter_cache.fork(1, at))

    def branch_done(self, b: Branches) -> bool:
        """Whether a one-row branch's draft is complete: the stop rule (Eq. 5) or the cap ended it."""
        if not b.tokens:
            return False
        keep, stop = self.rule.decide(b.probs[-1][0], len(b.tokens) - 1)
        return not keep or stop or len(b.tokens) >= self.rule.max_draft

    def step(self, b: Branches, sampling: Sampling) -> None:
        """Feed every branch's newest token (the candidates first) and draft one more token per branch."""
        if len(b.shallows) != len(b.tokens):
            raise RuntimeError("a branch whose last drafts were fed without drafting (feed_last) takes no more steps")
        pos = b.position + len(b.shallows)
        cur = b.candidates if not b.tokens else b.tokens[-1]
        with torch.inference_mode():
            ids = torch.tensor(cur, dtype=torch.long)[:, None]
            shallow, feats = self._feed(ids, b.input_cache, b.adapter_cache, pos)
            logits = self.half.draft_logits(feats[:, -1], pos)
            chosen, probs, dists = [], [], []
            for row in logits:
                d, dist = choose(
                    row, sampling.temperature, sampling.top_p, sampling.generator, sampling.top_k, sampling.min_p
                )
                chosen.append(d)
                probs.append(float(dist[d]))
                dists.append(dist)
        b.shallows.append(shallow[:, -1])
        b.feats.append(feats[:, -1])
        b.tokens.append(chosen)
        b.probs.append(probs)
        b.dists.append(torch.stack(dists))

    def feed_last(self, b: Branches) -> None:
        """Feed every branch's newest drafts without drafting after them, when a prepared draft from some row would
        send its last draft (`kept`): their shallow states, computed inside the wait instead of by `adopt` after the
        reply. The branch takes no more steps."""
        if not b.tokens or len(b.shallows) != len(b.tokens):
            return
        if all(self.kept(b, row) < len(b.tokens) for row in range(len(b.candidates))):
            return
        pos = b.position + len(b.shallows)
        with torch.inference_mode():
            ids = torch.tensor(b.tokens[-1], dtype=torch.long)[:, None]
            shallow, feats = self._feed(ids, b.input_cache, b.adapter_cache, pos)
        b.shallows.append(shallow[:, -1])
        b.feats.append(feats[:, -1])

    def kept(self, b: Branches, row: int) -> int:
        """How many of branch `row`'s drafts a prepared draft keeps: Eq. 5's stop rule over their probabilities."""
        n = 0
        for step_probs in b.probs:
            keep, stop = self.rule.decide(step_probs[row], n)
            if not keep:
                break
            n += 1
            if stop:
                break
        return min(n, len(b.tokens))

    def adopt(self, st: DraftState, b: Branches, row: int) -> None:
        """Make branch `row` the generation's state: its caches, and its drafts (cut by Eq. 5) as the prepared draft
        for the round that starts with its candidate."""
        n = self.kept(b, row)
        st.input_cache = b.input_cache.row(row)
        st.adapter_cache = b.adapter_cache.row(row)
        tokens = [b.tokens[i][row] for i in range(n)]
        shallows = [b.shallows[i][row : row + 1] for i in range(min(n + 1, len(b.shallows)))]
        last_feats = b.feats[n][row : row + 1] if len(b.feats) > n else None
        with torch.inference_mode():
            keep_len = b.position + len(shallows)
            st.crop(keep_len)
            if len(shallows) < n + 1:  # the last draft was chosen but never fed: its shallow state is one step away
                ids = torch.tensor([[tokens[-1]]], dtype=torch.long)
                fed, feats = self._feed(ids, st.input_cache, st.adapter_cache, keep_len)
                shallows.append(fed[0])
                last_feats = feats[:, -1]
        dists = [b.dists[i][row] for i in range(n)]
        st.prepared = Draft(tokens, dists, torch.cat(shallows), last_feats=last_feats)
        st.prepared_at = (b.candidates[row], b.position)
