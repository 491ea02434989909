"""A HAT generation's decode rounds (HAT §3.4-3.5): draft, send, wait, verify, roll back.

A chain round: from the last accepted token the draft model drafts (clients/hat/drafting.py, at the drafting
station when several streams share the backend), the shallow states of [token + drafts] go out (DRAFT), their deep
states come back (VERIFY_RESULT), verification (clients/hat/verify.py) accepts a prefix plus one token, the rejected
tail leaves both caches (ROLLBACK to the worker, crop here), and the round's parts feed the draft-length controller
(Eq. 7's estimates) and the backend's counters.

Parallel drafting (Eq. 6; `parallel_drafting`): while the worker verifies, the device drafts ahead from the top-k
alternatives to the last draft, one batched step per candidate set, as many steps as Eq. 6 says fit the round trip
and never past the reply's arrival. If the verified correction is one of the candidates, the next round starts with
that branch's drafts and caches. Greedy rounds only: a sampled draft ahead would draw from the request's seeded
generator as often as the reply's timing allows, and seeded runs would not repeat. Not under a grammar (each branch
would need its own grammar state), and at the station only while it serves this one stream (with more, the device's
waiting time goes to the other streams). It changes no output (drafts are only proposals).

Proactive drafting (SpecEdge; `proactive_drafting`): while the worker verifies, the device drafts the next round as
if this one were accepted whole — from the draft head's guess for the token verification adds after the last draft
(clients/hat/drafting.py, Drafter.ahead), on a copy of the caches, until the stop rule ends it or the reply arrives.
If verification accepted all drafts and added the guessed token, the next round starts with those drafts; otherwise
they are dropped. Greedy rounds without a grammar, alone at the station; before parallel drafting when both are on.
Either kind feeds its drafts' last token inside the wait too (Drafter.feed_last), so a prepared draft goes out with
no input-layer work after the reply, and it may still take a lookup branch. Both off by default (measured: a ~2 %
shorter round on the CPU worker for ~110 ms of device work a round; BENCHMARKS.md, session 23).

Every round's times go into HATStats.add_round: drafting (of it, the input layers), the wait (of it, the link's
modelled share), verification (of it, the head), and the drafting done ahead inside the wait (the rounds' profile).

A tree round (`tree_width`, clients/hat/tree.py): for plain greedy rounds whose cap allows the tree's depth and
whose context has room for all its nodes, a tree of w nodes drafted over the draft head's top-k (one batched step
per depth), its structure sent (TREE: parent indices, no tokens) before its DRAFT, the verified tree walked from
the root with the head on as few rows as it needs, and both caches cut to the accepted path (KEEP to the worker).
Tree rounds run on the model thread by themselves, not at the station.

A lookup round (`lookup_tokens`, policies/lookup.py): a plain greedy chain round whose context holds an earlier
occurrence of its last tokens, and whose continuation there leaves the drafted chain, verifies a tree instead: the
chain (drafted as above, at the station too) and the continuation copied from the context as a branch beside it
(clients/hat/tree.py draft_lookup), walked and kept like a tree round's; the branch and the walk's head run on the
model thread by themselves, outside the station's batched passes (measured paying with several streams as well).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from clients.base import BackendError
from clients.hat import wire
from clients.hat.drafting import Branches, Draft, Drafter, DraftState
from clients.hat.half import DeviceHalf
from clients.hat.link_model import LinkModel
from clients.hat.model_thread import ModelThread
from clients.hat.options import HATOptions, HATStats
from clients.hat.request_sampling import Sampling
from clients.hat.session import FrameSession
from clients.hat.station import DraftingStation, StreamSlot
from clients.hat.tree import TreeDraft, draft_lookup, draft_tree, verify_tree
from clients.hat.verify import VerifyJob, verify_round
from policies.drafting import DraftLengthController, parallel_draft_steps
from policies.estimate import MovingAverage
from policies.lookup import NgramIndex, branch_depth, common_prefix
from policies.trees import DraftTree


class DecodeRounds:
    """The decode rounds of one backend's streams (see the module docstring). `tree`: the token tree greedy rounds
    verify (None: chains); `token_bytes` (token id -> bytes) spells logprobs' tokens. Each round is counted into
    the HATStats it is given: the backend's current ones (benchmarks replace them between measurements)."""

    def __init__(
        self,
        *,
        name: str,
        options: HATOptions,
        half: DeviceHalf,
        thread: ModelThread,
        drafter: Drafter,
        station: DraftingStation | None,
        controller: DraftLengthController,
        link: LinkModel,
        tree: DraftTree | None,
        token_bytes: Callable[[int], bytes],
    ) -> None:
        self.name = name
        self.options = options
        self.half = half
        self.thread = thread
        self.drafter = drafter
        self.station = station
        self.controller = controller
        self.link = link
        self.tree = tree
        self.token_bytes = token_bytes
        self.gamma = MovingAverage()  # seconds per draft step (HAT's gamma_i)
        self.pd_gamma = MovingAverage()  # seconds per batched parallel-drafting step

    async def run(
        self,
        link: FrameSession,
        st: DraftState,
        token: int,
        position: int,
        cap: int,
        sampling: Sampling,
        stats: HATStats,
        *,
        slot: StreamSlot | None = None,
        room: int | None = None,
        context: Sequence[int] | None = None,
    ) -> tuple[list[int], list | None]:
        """One speculative round from `token` at `position`; returns the new tokens (accepted drafts + 1) and,
        when the request asked for them, their logprobs (from the head's logits at each token's position).
        `room`: positions the context has left from `position` (a tree needs one per node). `slot`: the stream's
        place at the drafting station, if it drafts there. `context`: the generation's tokens so far, `token` last
        (what a lookup branch is copied from; None: no lookup)."""
        tree = self._tree_for(cap, room, sampling) if link.info.get("trees") else None
        if tree is not None and not (st.prepared is not None and st.prepared_at == (token, position)):
            return await self._tree_round(link, st, token, position, tree, stats), None
        t0 = time.perf_counter()
        prepared = st.prepared is not None and st.prepared_at == (token, position)
        if prepared:
            draft = await self.thread.run(self.drafter.take_prepared, st, position, cap)
            stats.parallel_hits += 1
        else:
            if st.prepared is not None:  # stale branch (cannot happen unless the caller skipped a round): drop it
                raise BackendError(f"{self.name}: internal error: unused parallel draft", 500, self.name)
            draft = await (
                self.station.draft(slot, st, token, position, cap, sampling)
                if slot is not None and self.station is not None
                else self.thread.run(self.drafter.draft, st, token, position, cap, sampling)
            )
        st.prepared = st.prepared_at = None
        t1 = time.perf_counter()
        k = len(draft.tokens)
        branch = self._lookup_branch(link, st, draft, cap, room, sampling, context)
        if branch is not None:  # its wait is no point of the station's verify-stage fit (observe_wait: chain rows)
            new = await self._lookup_round(link, st, token, position, draft, branch, stats, t0, t1, prepared)
            return new, None
        seq = link.send_tensor(wire.Kind.DRAFT, draft.shallow, position)
        ahead: asyncio.Task[tuple[Branches | None, Branches | None]] | None = None
        stop = threading.Event()
        alone = slot is None or self.station is None or self.station.alone(slot)
        may = k >= 1 and sampling.greedy and sampling.mask is None and alone
        proactive = self.options.proactive_drafting and may
        if proactive or (self.options.parallel_drafting and may):
            timing = self.link.reply_window(k, link.info)
            ahead = asyncio.create_task(
                self._ahead(st, draft, position, sampling, stop, timing, stats, proactive=proactive)
            )
        try:
            frame = await link.reply(seq, wire.Kind.VERIFY_RESULT)
        finally:
            stop.set()  # drafting ahead never delays verification by more than one step
        t2 = time.perf_counter()
        if slot is not None and self.station is not None:
            self.station.observe_wait(slot, t2 - t1)
        guessed, branches = await ahead if ahead is not None else (None, None)
        deep = frame.tensor().reshape(-1, self.half.hidden_size)
        if frame.arg != position or deep.shape[0] != k + 1:
            raise BackendError(
                f"{self.name}: worker verified {deep.shape[0]} positions from {frame.arg}, "
                f"sent {k + 1} from {position}",
                502,
                self.name,
            )
        t_verify = time.perf_counter()
        job = VerifyJob(st, deep, draft, position, sampling)
        if slot is not None and self.station is not None:  # the head's rows batched with other streams'
            verdict, lps = await self.station.verify(slot, job)
        else:
            rows_of = self.half.verification_head(sampling.argmax_only)
            head = lambda lo, hi: rows_of(deep[lo:hi])  # noqa: E731
            verdict, lps = await self.thread.run(verify_round, job, head, self.token_bytes)
        new, accepted = verdict.tokens, verdict.accepted
        t_head = time.perf_counter() - t_verify
        self._observe_chain(link, draft, accepted, t1 - t0, t2 - t1, t_head, prepared=prepared)
        if accepted < k:
            link.send_control(wire.Kind.ROLLBACK, position + accepted + 1)
        if guessed is not None and accepted == k and new[-1] == guessed.candidates[0] and guessed.shallows:
            await self.thread.run(self.drafter.adopt, st, guessed, 0)
            stats.proactive_hits += 1
        elif branches is not None and accepted == k - 1 and new[-1] in branches.candidates and branches.shallows:
            await self.thread.run(self.drafter.adopt, st, branches, branches.candidates.index(new[-1]))
        elif guessed is not None:  # the guess was wrong (or never drafted): its drafts are dropped unseen
            stats.proactive_misses += 1
        t3 = time.perf_counter()
        stats.rounds += 1
        stats.drafted += k
        stats.longest_draft = max(stats.longest_draft, k)
        stats.accepted += accepted
        stats.round_tokens += len(new)
        stats.add_round(t1 - t0, t2 - t1, t3 - t2, draft.input_seconds, t_head, self.link.round_trip_seconds(k + 1))
        return new, lps

    def _observe_chain(
        self,
        link: FrameSession,
        draft: Draft,
        accepted: int,
        drafting_s: float,
        wait_s: float,
        head_s: float,
        *,
        prepared: bool = False,
    ) -> None:
        """A chain's round into the draft-length controller (Eq. 7's estimates) and gamma, the time per draft step
        (a prepared draft's drafting time is not a draft step's)."""
        k = len(draft.tokens)
        eta = self.options.eta
        self.controller.observe(
            drafted=k,
            accepted=accepted,
            confident=[float(d[t]) >= eta for t, d in zip(draft.tokens, draft.dists, strict=True)],
            draft_s=None if prepared else drafting_s,
            wait_s=wait_s,
            head_s=head_s,
            link=self.link.state(link.info),
        )
        if k and drafting_s > 1e-3:
            self.gamma.update(drafting_s / k)

    # --- token trees ------------------------------------------------------------------------------

    def _tree_for(self, cap: int, room: int | None, sampling: Sampling) -> DraftTree | None:
        """The tree this round verifies, or None for a chain: trees are for plain greedy rounds whose cap allows the
        tree's depth and whose context has room for all its nodes at once."""
        tree = self.tree
        if tree is None or not sampling.allows_tree:
            return None
        if cap < tree.depth or (room is not None and tree.width > room):
            return None
        return tree

    async def _tree_round(
        self, link: FrameSession, st: DraftState, token: int, position: int, tree: DraftTree, stats: HATStats
    ) -> list[int]:
        """One greedy round over a token tree (clients/hat/tree.py); returns the accepted drafts + the next token."""
        t0 = time.perf_counter()
        draft = await self.thread.run(draft_tree, self.drafter, st, token, position, tree)
        new, _path, _wait_s, _head_s = await self._verify_tree(link, st, position, draft, stats, t0)
        return new

    def _lookup_branch(
        self,
        link: FrameSession,
        st: DraftState,
        draft: Draft,
        cap: int,
        room: int | None,
        sampling: Sampling,
        context: Sequence[int] | None,
    ) -> tuple[list[int], int] | None:
        """The lookup branch a greedy chain round adds (its tokens, and the chain drafts it shares), or None: no
        earlier occurrence of the context's end, its continuation inside the chain, or no room for it."""
        n = self.options.lookup_tokens
        if not n or context is None or not sampling.allows_tree or not link.info.get("trees"):
            return None
        if st.lookup is None:
            st.lookup = NgramIndex()
        st.lookup.sync(context)
        k = len(draft.tokens)
        proposal, match = st.lookup.propose(min(cap, k + n))
        shared = common_prefix(draft.tokens, proposal)
        width = min(len(proposal) - shared, branch_depth(match, n), cap - shared)
        if room is not None:
            width = min(width, room - (k + 1))
        return (proposal[shared : shared + width], shared) if width > 0 else None

    async def _lookup_round(
        self,
        link: FrameSession,
        st: DraftState,
        token: int,
        position: int,
        draft: Draft,
        branch: tuple[list[int], int],
        stats: HATStats,
        t0: float,
        t_chain: float,
        prepared: bool,
    ) -> list[int]:
        """A chain round verified as a tree with the lookup branch beside the chain (see the module docstring);
        `prepared`: the chain was drafted ahead, inside the previous round's wait."""
        tokens, shared = branch
        k = len(draft.tokens)
        tree_draft = await self.thread.run(draft_lookup, self.drafter, st, token, draft, tokens, shared, position)
        new, path, wait_s, head_s = await self._verify_tree(link, st, position, tree_draft, stats, t0)
        chain_accepted = sum(1 for node in path[1:] if node <= k)
        stats.lookup_rounds += 1
        stats.lookup_accepted += len(path) - 1 - chain_accepted
        self._observe_chain(link, draft, chain_accepted, t_chain - t0, wait_s, head_s, prepared=prepared)
        return new

    async def _verify_tree(
        self, link: FrameSession, st: DraftState, position: int, draft: TreeDraft, stats: HATStats, t0: float
    ) -> tuple[list[int], list[int], float, float]:
        """Send a drafted tree (TREE, then DRAFT), walk its verified deep states, keep the path (KEEP) and count the
        round: (new tokens, the kept path's node indices, the wait for the reply, the head's time)."""
        tree = draft.tree
        t1 = time.perf_counter()
        link.send_indices(wire.Kind.TREE, list(tree.parents), position)
        seq = link.send_tensor(wire.Kind.DRAFT, draft.shallow, position)
        frame = await link.reply(seq, wire.Kind.VERIFY_RESULT)
        t2 = time.perf_counter()
        deep = frame.tensor().reshape(-1, self.half.hidden_size)
        if frame.arg != position or deep.shape[0] != tree.width:
            raise BackendError(
                f"{self.name}: worker verified {deep.shape[0]} positions from {frame.arg}, "
                f"sent a tree of {tree.width} from {position}",
                502,
                self.name,
            )
        new, path = await self.thread.run(verify_tree, self.half, st, deep, draft, position)
        t_head = time.perf_counter() - t2
        link.send_indices(wire.Kind.KEEP, path, position)
        t3 = time.perf_counter()
        stats.rounds += 1
        stats.tree_rounds += 1
        stats.drafted += tree.width - 1
        stats.accepted += len(path) - 1
        stats.round_tokens += len(new)
        link_s = self.link.round_trip_seconds(tree.width)
        stats.add_round(t1 - t0, t2 - t1, t3 - t2, draft.input_seconds, t_head, link_s)
        return new, path, t2 - t1, t_head

    # --- parallel drafting (Eq. 6) --------------------------------------------------------------

    async def _ahead(
        self,
        st: DraftState,
        draft: Draft,
        position: int,
        sampling: Sampling,
        stop: threading.Event,
        timing: tuple[float, float],
        stats: HATStats,
        *,
        proactive: bool,
    ) -> tuple[Branches | None, Branches | None]:
        """The device's work while a round is at the worker: proactive drafting first (one row a step, the cheaper of
        the two; they cover different outcomes: all drafts accepted, or all but the last), then, with time left,
        parallel drafting's branches."""
        start = time.perf_counter()
        guessed = await self._proactive(st, draft, position, sampling, stop, stats) if proactive else None
        branches = None
        if self.options.parallel_drafting and not stop.is_set():
            branches = await self._parallel(st, draft, position, sampling, stop, timing, stats, start)
        return guessed, branches

    async def _proactive(
        self, st: DraftState, draft: Draft, position: int, sampling: Sampling, stop: threading.Event, stats: HATStats
    ) -> Branches | None:
        """Proactive drafting (SpecEdge): the next round's draft, from the guess that all of this one is accepted and
        of the token verification adds after it, drafted step by step until its stop rule ends it or the reply
        arrives (at most one step late)."""
        guessed, _ = await self._timed(stats, self.drafter.ahead, st, draft, position)
        while guessed is not None and not stop.is_set() and not self.drafter.branch_done(guessed):
            await self._timed(stats, self.drafter.step, guessed, sampling)
            stats.proactive_steps += 1
        if guessed is not None and not stop.is_set():
            await self._timed(stats, self.drafter.feed_last, guessed)
        return guessed

    async def _timed(self, stats: HATStats, work: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """Drafting-ahead work on the model thread: (its result, its seconds), the seconds counted as drafting
        inside the wait."""
        t = time.perf_counter()
        result = await self.thread.run(work, *args)
        seconds = time.perf_counter() - t
        stats.ahead_seconds += seconds
        return result, seconds

    async def _parallel(
        self,
        st: DraftState,
        draft: Draft,
        position: int,
        sampling: Sampling,
        stop: threading.Event,
        timing: tuple[float, float],
        stats: HATStats,
        start: float,
    ) -> Branches | None:
        g, window = timing
        branches, _ = await self._timed(stats, self.drafter.branch, st, draft, position)
        if branches is None:
            return None
        step = self.pd_gamma.get(self.gamma.get(0.05))
        steps = parallel_draft_steps(  # Eq. 6, with the measured time of one batched candidate step as gamma
            draft_len=len(draft.tokens) + 1,
            token_bytes=self.link.state_bytes,
            beta_up=self.link.beta_up,
            beta_down=self.link.beta_down,
            g_mu=g,
            gamma=max(step, 1e-4),
            max_steps=self.drafter.rule.max_draft,
        )
        for _ in range(max(steps, 1)):
            if stop.is_set() or time.perf_counter() - start + step > window:
                break
            _, seconds = await self._timed(stats, self.drafter.step, branches, sampling)
            self.pd_gamma.update(seconds)
            stats.parallel_steps += 1
            step = self.pd_gamma.get(step)
        if not stop.is_set() and time.perf_counter() - start + step <= window:
            await self._timed(stats, self.drafter.feed_last, branches)
        return branches
