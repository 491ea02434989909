"""The worker's scheduler (app/worker/scheduler.py) on scripted pending frames, no model: the pieces each pass runs,
greedy and planned, max_defer forcing a deferred frame in, sub-chunks of a long prefill, a staged worker's cuts,
and the control frames and refusals it hands back to the engine on the way."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from app.worker.scheduler import Piece, Scheduler, fair_price
from app.worker.sessions import EngineError, Item, OpenParams, Reason, Session
from app.worker.settings import EngineLimits
from app.worker.stats import EngineStats
from clients.hat import wire
from policies.fair_share import RowCost
from policies.sequence_partition import ChunkCost

Kind = wire.Kind
# g(x) = 0.002·x + 0.048 s: the sub-chunk budget at the default 0.2 overhead is 0.048·0.8 / (0.2·0.002) = 96 tokens
SLOPE, INTERCEPT = 0.002, 0.048
PARAMS = OpenParams(hidden_size=1, num_layers=4, m=2, dtype="float32")


class Cache:
    """Just the length of a session's KV cache: all the scheduler reads of it."""

    def __init__(self, length: int = 0) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


class Script:
    """A scheduler over named sessions, with the engine's side played by hand: frames queued in order, control
    frames and refusals recorded, and a pass's rows marked as run (as Engine._forward and _complete do)."""

    def __init__(self, planner=None, **limits) -> None:
        self.stats = EngineStats()
        self.controls: list[tuple[str, Kind]] = []
        self.refused: list[tuple[str, Reason]] = []
        self.sessions: dict[str, Session] = {}
        self.names: dict[bytes, str] = {}
        self.sent: dict[str, int] = {}  # the next position each session's device would send
        self.scheduler = Scheduler(
            EngineLimits(**limits),
            self.stats,
            max_context=4096,
            control=lambda item: self.controls.append((self.names[item.session.id], item.frame.kind)),
            refuse=lambda item, err: self.refused.append((self.names[item.session.id], err.reason)),
            planner=planner,
        )

    def session(self, name: str, cached: int = 0) -> Session:
        sid = name.encode().ljust(16, b"\0")
        session = Session(sid, Cache(cached), PARAMS, created=0.0, last_active=0.0)  # type: ignore[arg-type]
        self.sessions[name], self.names[sid], self.sent[name] = session, name, cached
        return session

    def send(self, name: str, kind: Kind, rows: int = 0, arg: int | None = None) -> Item:
        """Queue a frame (as Engine._take does once it is in sequence); a tensor frame's `arg` defaults to the
        position after the session's last one."""
        session = self.sessions[name]
        first = self.sent[name] if arg is None else arg
        if rows:
            self.sent[name] = first + rows
        frame = wire.Frame(kind, session.id, session.expected_seq, first)
        session.expected_seq += 1
        item = Item(session, frame.seq, frame, torch.zeros(rows, 1) if rows else None, Future())
        self.scheduler.add(item)
        return item

    def next_pass(self, tau: ChunkCost | None = None) -> list[tuple[str, int]]:
        """The pass's pieces as (session, rows); then they run: the rows are done and in the session's cache."""
        extra = {} if tau is None else {"tau": tau}  # τ known or not: the fair share's prices
        pieces: list[Piece] = self.scheduler.next_pass(SLOPE, INTERCEPT, len(self.sessions), **extra)
        for item, n in pieces:
            item.done += n
            item.finished += n
            item.session.cache.length += n  # type: ignore[attr-defined]
            if item.done == item.rows:
                self.scheduler.unqueue(item)
        return [(self.names[item.session.id], n) for item, n in pieces]


def test_greedy_runs_every_sessions_next_whole_frame_up_to_the_token_cap() -> None:
    s = Script(batching="greedy", max_batch_tokens=10)
    for name in "abc":
        s.session(name)
    s.send("a", Kind.PREFILL_CHUNK, 200)  # larger than the cap: still runs, alone
    s.send("b", Kind.DRAFT, 5)
    s.send("c", Kind.DRAFT, 5)
    s.send("b", Kind.DRAFT, 3)  # b's next frame waits for its first
    assert s.next_pass() == [("a", 200)]
    assert s.next_pass() == [("b", 5), ("c", 5)]
    assert s.next_pass() == [("b", 3)]
    assert s.next_pass() == [] and not s.scheduler.pending
    assert s.stats.planned_passes == 0  # greedy plans nothing


def test_greedy_serves_sessions_round_robin() -> None:
    s = Script(batching="greedy", max_batch_tokens=8)
    for name in "abc":
        s.session(name)
        s.send(name, Kind.DRAFT, 4)
        s.send(name, Kind.DRAFT, 4)
    assert s.next_pass() == [("a", 4), ("b", 4)]
    assert s.next_pass() == [("c", 4), ("a", 4)]  # a and b went to the back of the line
    assert s.next_pass() == [("b", 4), ("c", 4)]


def test_planned_runs_a_verification_before_a_long_prefill_then_max_defer_forces_the_prefill_in() -> None:
    s = Script(batching="planned", max_defer=1)
    s.session("verifier", cached=20)
    s.session("prefiller")
    s.send("prefiller", Kind.PREFILL_CHUNK, 128)
    s.send("verifier", Kind.DRAFT, 3)
    # budget 96: the 128-row prefill is cut into 64 + 64. Shortest first, the DP's best plan is [3] then [64]:
    # 2·g(3) + g(64) = 0.284 s of completion time against 2·g(67) = 0.364 s together
    assert s.next_pass() == [("verifier", 3)]
    assert s.stats.subchunk_budget == 96
    assert (s.stats.planned_passes, s.stats.planned_groups, s.stats.deferred_frames) == (1, 2, 1)
    # the prefill was left out once (= max_defer): it goes into the next pass, with the verifier's next round
    s.send("verifier", Kind.DRAFT, 3)
    assert s.next_pass() == [("prefiller", 64), ("verifier", 3)]
    assert (s.stats.forced_frames, s.stats.planned_groups, s.stats.deferred_frames) == (1, 3, 1)
    assert s.next_pass() == [("prefiller", 64)]
    assert (s.stats.split_frames, s.stats.subchunk_passes) == (1, 2)
    assert s.next_pass() == [] and not s.scheduler.pending


def test_planned_with_max_defer_0_puts_every_sessions_next_piece_in_every_pass() -> None:
    """What the default does (docs/hat.md, "Batching on the worker"): no piece is ever left out, the shortest-first DP
    reorders nothing (it does with max_defer 1: the test above), and the prefill's sub-chunks are the whole effect."""
    assert EngineLimits().max_defer == 0 and EngineLimits().batching == "planned"
    s = Script(batching="planned", fair_slowdown=None)  # the default's max_defer 0; the quantum alone cuts pieces
    s.session("verifier", cached=20)
    s.session("prefiller")
    s.send("prefiller", Kind.PREFILL_CHUNK, 200)
    s.send("verifier", Kind.DRAFT, 3)
    s.send("verifier", Kind.DRAFT, 3)
    # 200 rows in pieces of at most 96: 67 + 67 + 66, each beside the verifier's round of the moment
    assert s.next_pass() == [("prefiller", 67), ("verifier", 3)]
    assert s.next_pass() == [("prefiller", 67), ("verifier", 3)]
    assert s.next_pass() == [("prefiller", 66)]
    assert (s.stats.deferred_frames, s.stats.split_frames, s.stats.subchunk_passes) == (0, 1, 3)


def test_a_lone_sessions_prefill_is_not_cut_and_a_small_one_never() -> None:
    s = Script(batching="planned")
    s.session("alone")
    s.send("alone", Kind.PREFILL_CHUNK, 300)
    assert s.next_pass() == [("alone", 300)]  # no one could be waiting behind it
    s.session("other")
    s.send("alone", Kind.PREFILL_CHUNK, 90)
    s.send("other", Kind.PREFILL_CHUNK, 90)
    assert s.next_pass() == [("alone", 90), ("other", 90)]  # within the budget: whole
    assert (s.stats.split_frames, s.stats.subchunk_passes) == (0, 0)


def test_a_staged_worker_cuts_a_prefill_at_its_planned_sub_sequence_ends() -> None:
    class Planner:
        def __init__(self) -> None:
            self.asked: list[tuple[int, int]] = []

        def lengths(self, n: int, context: int) -> list[int]:
            self.asked.append((n, context))
            return [48, n - 48]

    planner = Planner()
    s = Script(planner, batching="planned")
    s.session("a", cached=32)
    s.send("a", Kind.PREFILL_CHUNK, 128)
    assert s.next_pass() == [("a", 48)]
    assert s.next_pass() == [("a", 80)]
    assert planner.asked == [(128, 32)]  # planned once, when the frame first ran, after the cached context


def test_control_frames_are_handed_back_in_order_and_misplaced_frames_refused() -> None:
    s = Script(batching="greedy")
    s.session("a", cached=10)
    s.session("b")
    s.send("a", Kind.ROLLBACK, arg=8)
    s.send("a", Kind.DRAFT, 2, arg=10)  # the test's engine applies no rollback: the cache still holds 10
    s.send("b", Kind.DRAFT, 2, arg=5)  # b's cache is empty: refused (409 position)
    s.send("b", Kind.DRAFT, 2, arg=0)
    assert s.next_pass() == [("a", 2), ("b", 2)]
    assert s.controls == [("a", Kind.ROLLBACK)]
    assert s.refused == [("b", Reason.POSITION)]


def test_a_tree_must_be_followed_by_its_draft() -> None:
    s = Script(batching="planned")
    a = s.session("a")
    a.expect_tree(0, (-1, 0, 0))  # as the engine applies a TREE frame
    s.send("a", Kind.DRAFT, 2, arg=0)  # two rows for a three-node tree
    assert s.next_pass() == [] and s.refused == [("a", Reason.SHAPE)]
    a.expect_tree(0, (-1, 0, 0))
    item = s.send("a", Kind.DRAFT, 3, arg=0)
    assert s.next_pass() == [("a", 3)] and item.tree == (-1, 0, 0)


def test_the_scheduler_is_told_of_a_closed_session() -> None:
    s = Script(batching="greedy")
    a = s.session("a")
    s.send("a", Kind.DRAFT, 2)
    s.scheduler.discard(a)
    assert not s.scheduler.pending and s.next_pass() == []


def test_sessions_control_frame_methods() -> None:
    class Cropped(Cache):
        def crop(self, keep: int) -> None:
            self.length = keep

        def keep(self, positions: list[int]) -> None:
            self.kept = positions
            self.length = len(positions)

    session = Session(bytes(16), Cropped(10), PARAMS, created=0.0, last_active=0.0)  # type: ignore[arg-type]
    session.rollback(8)
    assert len(session.cache) == 8
    refused = _error(lambda: session.rollback(9))
    assert (refused.status, refused.reason) == (400, Reason.POSITION)
    # a verified tree of 3 nodes at 8..10: ROLLBACK may not keep part of it, KEEP takes a path from the root
    session.open_tree, session.cache.length = (8, (-1, 0, 0)), 11  # type: ignore[attr-defined]
    assert _error(lambda: session.rollback(10)).status == 409
    assert _error(lambda: session.keep_path(7, [0, 1])).status == 409
    assert _error(lambda: session.keep_path(8, [1, 2])).reason == Reason.MALFORMED
    session.keep_path(8, [0, 2])
    assert session.cache.kept == [*range(8), 8, 10] and session.open_tree is None  # type: ignore[attr-defined]


def test_sessions_sequence_order_and_status_due() -> None:
    session = Session(bytes(16), Cache(), PARAMS, created=0.0, last_active=0.0)  # type: ignore[arg-type]

    def item(seq: int, refused: bool = False) -> Item:
        frame = None if refused else wire.Frame(Kind.DRAFT, session.id, seq)
        return Item(session, seq, frame, None, Future())

    assert session.hold(item(2)) == []
    assert session.seq_error(2, 64).reason == Reason.SEQ  # type: ignore[union-attr]  # held already
    assert session.seq_error(66, 64) is not None and session.seq_error(65, 64) is None
    assert session.hold(item(3, refused=True)) == []
    assert [i.seq for i in session.hold(item(1))] == [1, 2]  # 3's ERROR used its seq up
    assert session.expected_seq == 4 and session.seq_error(3, 64) is not None
    # STATUS: due the first time, then only when mu or g's prediction moved by more than the tolerance
    assert session.status_due(4.0, 0.01, 0.1, 3, 0.1)
    assert not session.status_due(4.2, 0.01, 0.1, 3, 0.1)
    assert session.status_due(5.0, 0.01, 0.1, 3, 0.1) and session.told == (5.0, 0.01, 0.1)
    assert session.status_due(5.0, 0.02, 0.1, 3, 0.1)


def _error(fn) -> EngineError:
    try:
        fn()
    except EngineError as e:
        return e
    raise AssertionError("no EngineError")


def test_a_session_flooding_its_backlog_gets_its_fair_share_of_each_pass_and_no_more() -> None:
    """Forty 455-row drafts (1 MiB each at SmolLM2's width) sent at once by one session, beside another's 3-row
    rounds: every pass carries at most the quantum (96 rows) of the flood, so the other's round never waits behind
    more than a piece of it (the engine replies to a draft run in pieces once, with all its rows: test_hat.py). The
    quantum alone here (fair_slowdown off); the default bounds the flood more tightly: the test below."""
    s = Script(batching="planned", fair_slowdown=None)
    s.session("victim", cached=20)
    s.session("flood")
    for _ in range(40):
        s.send("flood", Kind.DRAFT, 455)
    flooded = 0
    for _ in range(12):
        s.send("victim", Kind.DRAFT, 3)
        pass_ = dict(s.next_pass())
        assert pass_["victim"] == 3 and pass_["flood"] <= 96, pass_
        flooded += pass_["flood"]
    assert flooded >= 12 * 91  # and the flood is not starved: it gets its share of every pass


def test_by_default_a_flood_makes_the_other_sessions_pass_at_most_twice_its_own() -> None:
    """The default fair_slowdown (2): beside the victim's 3-row round, a flood 3000 positions into its context runs
    what (2 − 1)·(a + the round's cost) buys, priced by τ, in every pass; so the victim's pass costs at most twice
    what it costs alone, and the flood still runs in every pass (not starved)."""
    assert EngineLimits().fair_slowdown == 2.0
    tau = ChunkCost(0.048, 0.002, 2e-6, 0.0)
    s = Script(batching="planned")
    s.session("victim", cached=20)
    s.session("flood", cached=3000)
    for _ in range(3):
        s.send("flood", Kind.DRAFT, 455)
    alone = tau(3, 20)
    for _ in range(12):
        s.send("victim", Kind.DRAFT, 3)
        context = len(s.sessions["flood"].cache)
        pass_ = dict(s.next_pass(tau))
        assert pass_["victim"] == 3 and pass_["flood"] >= 1, pass_
        shared = alone + pass_["flood"] * (0.002 + 2e-6 * context)
        assert shared <= 2 * alone + 1e-9 < shared + (0.002 + 2e-6 * context)  # the most rows within the bound
        assert s.sessions["flood"].credit <= s.stats.fair_quantum  # what the bound held back is not banked
    s.send("flood", Kind.DRAFT, 455)
    assert dict(s.next_pass(tau))["flood"] > 16  # alone again: its quantum, not the bound


def test_a_token_tree_larger_than_the_quantum_waits_for_its_credit_then_runs_whole() -> None:
    s = Script(batching="planned")
    s.session("small", cached=20)
    tree = s.session("tree")
    tree.expect_tree(0, (-1, *range(149)))  # a 150-node chain shape, sent as a tree: never cut
    s.send("tree", Kind.DRAFT, 150, arg=0)
    s.send("small", Kind.DRAFT, 3)
    assert s.next_pass() == [("small", 3)]  # the tree's credit (96) does not cover it yet
    s.send("small", Kind.DRAFT, 3)
    assert s.next_pass() == [("tree", 150), ("small", 3)]  # 192 does
    assert tree.credit == 0.0


def test_a_long_context_flood_gets_its_share_of_each_pass_in_time_not_rows() -> None:
    """With τ known (τ(x | y) = 0.048 + 0.002·x + 2e-6·x·y s), the quantum is what the sub-chunk budget's 96 rows
    cost after no context (0.192 s) and a piece is priced by the context it attends over: the flood, 3000 positions
    in, runs ~21 rows a pass (9 ms each), not 96, so the pass beside the other session's round costs what a
    96-row piece after no context does, not 4× that. The quantum alone (fair_slowdown off)."""
    tau = ChunkCost(0.048, 0.002, 2e-6, 0.0)
    s = Script(batching="planned", fair_slowdown=None)
    s.session("victim", cached=20)
    s.session("flood", cached=3000)
    for _ in range(2):
        s.send("flood", Kind.DRAFT, 455)
    flooded = spent = 0.0
    for _ in range(12):
        s.send("victim", Kind.DRAFT, 3)
        context, credit = len(s.sessions["flood"].cache), s.sessions["flood"].credit
        pass_ = dict(s.next_pass(tau))
        piece = pass_["flood"]
        assert pass_["victim"] == 3 and 16 <= piece <= 24, pass_
        seconds = piece * (0.002 + 2e-6 * context)
        assert seconds <= credit + 0.192 + 1e-9  # what its credit covers: the quantum and what it kept
        flooded, spent = flooded + piece, spent + seconds
    assert s.stats.fair_quantum == 0.002 * 96
    assert 11 * 0.192 < spent <= 12 * 0.192 + 1e-9  # its time share of every pass: not starved, no more
    assert flooded < 12 * 24  # where a row quantum ran 12 × ~91


def test_only_bulk_when_every_session_with_a_tensor_frame_queued_is_a_flood_in_progress() -> None:
    """What the engine holds a pass for a returning session on (policies/fair_share.anticipation): a pass of only a
    flood's pieces; a session's single next round, or a first frame not yet cut, is not bulk."""
    s = Script(batching="planned", fair_slowdown=None)
    s.session("victim", cached=20)
    s.session("flood")
    assert not s.scheduler.only_bulk()  # nothing queued
    s.send("flood", Kind.DRAFT, 455)
    assert not s.scheduler.only_bulk()  # one frame, not cut yet: it may be a round of its own
    s.send("flood", Kind.DRAFT, 455)
    assert s.scheduler.only_bulk()  # a backlog
    s.send("victim", Kind.ROLLBACK, arg=20)
    assert s.scheduler.only_bulk()  # a control frame waits for no pass
    s.send("victim", Kind.DRAFT, 3)
    assert not s.scheduler.only_bulk()  # the victim's round is here
    assert dict(s.next_pass()) == {"flood": 91, "victim": 3}
    assert s.scheduler.only_bulk()


def test_the_fair_quantum_comes_from_tau_not_from_a_g_that_a_long_context_flood_distorted() -> None:
    """g has no context term: under a long-context flood its slope grows and its intercept goes below 0 (measured in
    `bench fair-share`), which would floor the sub-chunk budget. With τ known the quantum is τ's own sub-chunk
    budget's cost: 0.048·0.8 / (0.2·0.002) = 96 rows, 0.192 s."""
    limits = EngineLimits()
    tau = ChunkCost(0.048, 0.002, 2e-6, 0.0)
    price = fair_price(16, 0.02, -0.3, tau, limits)  # g's budget floored at 16 rows by a distorted g
    assert price.cost == RowCost(0.002, 2e-6, 0.0) and price.quantum == pytest.approx(0.192) and price.fixed == 0.048
    price = fair_price(96, SLOPE, INTERCEPT, None, limits)  # before τ: g's slope per row, no context term
    assert price.cost == RowCost(SLOPE) and price.quantum == pytest.approx(SLOPE * 96) and price.fixed == INTERCEPT
    assert fair_price(96, SLOPE, -0.01, None, limits).fixed == 0.0  # a fixed cost below 0 is g's noise
    assert fair_price(4096, -1e-4, INTERCEPT, None, limits) is None  # nothing to price by: see the test below
    # a loaded host's fit with a tiny per-row cost: still four fixed costs, not max_batch_tokens rows' x² term
    price = fair_price(16, 0.02, 0.0, ChunkCost(0.08, 1e-7, 2e-6, 1e-6), limits)
    assert price.quantum == pytest.approx(0.32)


def test_with_nothing_to_price_by_a_flood_runs_in_the_least_pieces_not_whole() -> None:
    """g's slope not positive (it saw one pass size only) and no τ: a flood's 455-row draft beside a round runs 16
    rows a pass, not whole, and nobody's credit changes."""
    s = Script(batching="planned")
    s.session("victim", cached=20)
    s.session("flood")
    s.send("flood", Kind.DRAFT, 455)
    s.send("victim", Kind.DRAFT, 3)
    pieces = s.scheduler.next_pass(-1e-4, 0.07, 2)
    assert [(s.names[item.session.id], n) for item, n in pieces] == [("flood", 16), ("victim", 3)]
    assert s.sessions["flood"].credit == 0.0 and s.stats.fair_quantum == 0.0
