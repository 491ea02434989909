"""Which pending frames share the worker engine's next forward pass: frame collection and planning.

Batching (continuous, "ragged"): every tick the engine thread asks for the next pass, and the scheduler takes the next
tensor frame of every session that has one pending and chooses which of them (and how many of their rows) run together
in ONE forward pass. `batching = "greedy"`: all of them, up to max_batch_tokens, whole frames. `batching = "planned"`
(default): while more than one session is open, each session's share of a pass is bounded by deficit round robin in time
(policies/fair_share.py): a piece is priced by the fitted τ(x | y) less its fixed cost, so by its rows and the context
they attend over, and the quantum is what the sub-chunk budget costs after no context (`fair_price`; g's slope and
budget, rows only, until τ is known). A prefill frame or a chain of drafts costing more than the session's credit is cut
into consecutive pieces (exact with the KV cache), a token tree runs whole once the credit covers it, so one session
flooding its backlog with large frames makes no other session's verification round wait behind more than a piece,
however long the flood's context; in a pass that also carries frames running whole, the bulk pieces add at most
(fair_slowdown − 1)× what the pass costs without them. The pending pieces are sorted shortest first and grouped by
policies/worker_batching.plan_groups (least mean completion time under g), and only the first group runs; the rest are
re-planned next tick with whatever arrived meanwhile. A frame left out `max_defer` passes in a row is forced into the
next one — so at the default, max_defer = 0, every pending piece is forced into every pass and the DP has nothing to
choose: the sub-chunks are what a waiting verification round gains (it waits behind one sub-chunk's pass). In a staged
worker (app/worker/pipeline.py), each prefill frame is first cut at the ends of its Jupiter plan (the sequence partition
of app/worker/prefill_cost.py over the stages' τ_s) so a lone long prompt keeps every stage busy.

On the way to a session's next tensor frame, the control frames queued before it (ROLLBACK, TREE, KEEP) are handed
to the engine to apply, and a tensor frame whose positions do not follow the session's cache, or that breaks its
token tree, is refused; both go back to the engine through the two callbacks it gives, which answer the device.

Pure: no model, no thread, no clock, no I/O. It runs on the engine thread, which owns the sessions' queues; g's
coefficients and the number of open sessions are arguments of each pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

from app.worker.sessions import EngineError, Item, Session, check_positions
from app.worker.settings import EngineLimits
from app.worker.stats import EngineStats
from clients.hat import wire
from policies.fair_share import Pending, RowCost, fair_shares
from policies.sequence_partition import ChunkCost
from policies.worker_batching import plan_groups, subchunk_tokens

CONTROL_KINDS = frozenset({wire.Kind.ROLLBACK, wire.Kind.TREE, wire.Kind.KEEP})
MIN_SUBCHUNK = 16  # planned: a prefill frame is never split into pieces smaller than this

Piece = tuple[Item, int]  # a frame and how many of its rows (from item.done) the pass runs


class SequencePlanner(Protocol):
    """A staged worker's sequence partition (app/worker/prefill_cost.py's SubsequencePlanner)."""

    def lengths(self, n: int, context: int) -> list[int]: ...


class Scheduler:
    """The sessions with frames queued, in round-robin order, and the choice of each pass's pieces."""

    def __init__(
        self,
        limits: EngineLimits,
        stats: EngineStats,
        max_context: int,
        *,
        control: Callable[[Item], None],
        refuse: Callable[[Item, EngineError], None],
        planner: SequencePlanner | None = None,
    ) -> None:
        """`control(item)` applies a control frame and answers it; `refuse(item, error)` answers a tensor frame with
        an ERROR. `planner`: a staged worker's sequence partition (planned batching only)."""
        self.limits = limits
        self.stats = stats
        self.max_context = max_context
        self.control = control
        self.refuse = refuse
        self.planner = planner
        self._ready: OrderedDict[bytes, Session] = OrderedDict()  # sessions with queued frames, next served first

    @property
    def pending(self) -> bool:
        """Some session has a frame queued."""
        return bool(self._ready)

    def only_bulk(self) -> bool:
        """Every session with a tensor frame queued is a flood in progress: its next frame partly run already (the
        fair share is cutting it) or more frames queued behind it. Sessions with only control frames queued wait for
        no pass."""
        waiting = [frames for frames in (_tensor_frames(s, 2) for s in self._ready.values()) if frames]
        return bool(waiting) and all(frames[0].done > 0 or len(frames) > 1 for frames in waiting)

    def add(self, item: Item) -> None:
        """A frame released in its session's sequence order joins the session's queue."""
        item.session.queue.append(item)
        self._ready[item.session.id] = item.session

    def discard(self, session: Session) -> None:
        """The session is gone (its queue is the engine's to answer)."""
        self._ready.pop(session.id, None)

    def unqueue(self, item: Item) -> None:
        """Take a frame whose rows all ran (or that failed) off its session's queue if it is still at the head."""
        queue_ = item.session.queue
        if queue_ and queue_[0] is item:
            queue_.popleft()
            if not queue_:
                self._ready.pop(item.session.id, None)

    def next_pass(self, slope: float, intercept: float, sessions: int, tau: ChunkCost | None = None) -> list[Piece]:
        """This pass's (frame, rows) pieces by the configured batching. g(x) = slope·x + intercept is the fitted pass
        time; `sessions`: how many sessions are open (a lone one's prefill is never cut into sub-chunks); `tau`: the
        fitted cost of x rows after y cached positions, τ(x | y) (app/worker/prefill_cost.py; None while unknown),
        which prices each session's fair share of a pass by the context its rows attend over."""
        if self.limits.batching == "planned":
            return self._planned(slope, intercept, sessions, tau)
        return [(item, item.rows) for item in self._greedy()]

    def _planned(self, slope: float, intercept: float, sessions: int, tau: ChunkCost | None) -> list[Piece]:
        """One candidate piece per session (a sub-chunk for a long prefill frame); run the plan's first group."""
        limits = self.limits
        budget = subchunk_tokens(
            slope,
            intercept,
            overhead=limits.subchunk_overhead,
            min_tokens=MIN_SUBCHUNK,
            max_tokens=limits.max_batch_tokens,
        )
        self.stats.subchunk_budget = budget
        pieces: list[Piece] = []
        for _, item in self._heads():
            if item is not None:
                rows = item.rows - item.done
                if item.frame.kind == wire.Kind.PREFILL_CHUNK and self.planner is not None:  # type: ignore[union-attr]
                    rows = self._next_subsequence(item)
                pieces.append((item, rows))
        # Share the pass only when another session could be waiting: alone, a device gains nothing from pieces and
        # would pay their passes' fixed cost (up to `subchunk_overhead` of its TTFT).
        credits: dict[bytes, float] = {}  # what each session keeps of its fair share if its piece runs now
        if sessions > 1:
            pieces = self._fair(pieces, budget, slope, intercept, tau, credits)
        if not pieces:
            return []
        forced = [i for i, (item, _) in enumerate(pieces) if item.deferred >= limits.max_defer]
        groups = plan_groups(
            [rows for _, rows in pieces], slope, intercept, max_tokens=limits.max_batch_tokens, forced=forced
        )
        first = set(groups[0])
        st = self.stats
        st.planned_passes += 1
        st.planned_groups += len(groups)
        st.forced_frames += len(forced)
        batch: list[Piece] = []
        for i, (item, rows) in enumerate(pieces):
            if i not in first:
                item.deferred += 1
                st.deferred_frames += 1
                continue
            item.deferred = 0
            item.session.credit = credits.get(item.session.id, item.session.credit)
            remaining = item.rows - item.done
            if rows < remaining or item.done:
                st.subchunk_passes += 1
                st.split_frames += rows < remaining and item.done == 0
            batch.append((item, rows))
        self._to_back(item for item, _ in batch)
        return batch

    def _fair(
        self,
        pieces: list[Piece],
        budget: int,
        slope: float,
        intercept: float,
        tau: ChunkCost | None,
        credits: dict[bytes, float],
    ) -> list[Piece]:
        """Deficit round robin over the sessions (policies/fair_share.py): what each session's credit covers of its
        piece, priced in seconds by the rows and the context they attend over; a prefill chunk or a chain of drafts
        may run in pieces, a token tree only whole. A session's credit changes only when its piece runs (the planner
        may defer it): the credit it would keep goes into `credits`; one whose frame waits for more credit keeps what
        it earned."""
        price = fair_price(budget, slope, intercept, tau, self.limits)
        if price is None:  # nothing to price by yet: the least pieces, and no credit kept in a unit to come
            self.stats.fair_quantum = 0.0
            return [(item, min(rows, MIN_SUBCHUNK) if _splittable(item) else rows) for item, rows in pieces]
        self.stats.fair_quantum = price.quantum
        pending = [
            Pending(rows, _splittable(item), len(item.session.cache), item.done > 0 or _backlog(item.session))
            for item, rows in pieces
        ]
        credits_now = [item.session.credit for item, _ in pieces]
        runs, kept = fair_shares(
            pending,
            credits_now,
            price.quantum,
            MIN_SUBCHUNK,
            price.cost,
            fixed=price.fixed,
            slowdown=self.limits.fair_slowdown,
        )
        fair: list[Piece] = []
        for (item, _), run, credit in zip(pieces, runs, kept, strict=True):
            if run:
                fair.append((item, run))
                credits[item.session.id] = credit
            else:
                item.session.credit = credit
        return fair

    def _next_subsequence(self, item: Item) -> int:
        """A staged worker's next piece of a prefill frame: up to the next end of the frame's Jupiter plan (made
        when the frame first runs: the sequence partition over the stages' profiled τ_s)."""
        total = item.rows
        if item.cuts is None:
            lengths = self.planner.lengths(total - item.done, len(item.session.cache))  # type: ignore[union-attr]
            ends, at = [], item.done
            for n in lengths:
                at += n
                ends.append(at)
            item.cuts = tuple(ends)
        return next(end for end in item.cuts if end > item.done) - item.done

    def _next_tensor_frame(self, session: Session) -> Item | None:
        """The session's next tensor frame that may run, left at the head of its queue; the control frames before it
        are applied and frames whose positions do not fit are refused on the way."""
        while session.queue:
            item = session.queue[0]
            frame = item.frame
            assert frame is not None
            if frame.kind in CONTROL_KINDS:
                session.queue.popleft()
                self.control(item)
                continue
            remaining = item.rows - item.done
            try:
                session.attach_tree(item)
                err = check_positions(len(session.cache), frame.arg + item.done, remaining, self.max_context)
            except EngineError as e:
                err = e
            if err is not None:
                session.queue.popleft()
                self.refuse(item, err)
                continue
            return item
        return None

    def _greedy(self) -> list[Item]:
        """At most one whole tensor frame per session, up to max_batch_tokens (a larger frame alone still runs)."""
        batch: list[Item] = []
        tokens = 0
        for session, item in self._heads():
            if item is not None:
                n = item.rows
                if not (batch and tokens + n > self.limits.max_batch_tokens):
                    session.queue.popleft()
                    batch.append(item)
                    tokens += n
            if session.queue and batch and tokens >= self.limits.max_batch_tokens:
                break
        self._to_back(batch)
        return batch

    def _heads(self) -> Iterator[tuple[Session, Item | None]]:
        """Each ready session in turn with its next tensor frame that may run (None: none); a session whose queue
        the caller left empty then leaves the ready list."""
        for sid in list(self._ready):
            session = self._ready.get(sid)
            if session is None:
                continue
            yield session, self._next_tensor_frame(session)
            if not session.queue:
                self._ready.pop(sid, None)

    def _to_back(self, items: Iterable[Item]) -> None:
        """Round-robin: sessions served this pass go to the back of the line."""
        for item in items:
            if item.session.id in self._ready:
                self._ready.move_to_end(item.session.id)


class FairPrice(NamedTuple):
    """What the fair share prices a pass with: a piece's cost beside others, the quantum a session earns a pass, and
    the pass's own fixed cost (what it costs with no rows: the bound on bulk pieces is relative to it)."""

    cost: RowCost
    quantum: float
    fixed: float


def fair_price(
    budget: int, slope: float, intercept: float, tau: ChunkCost | None, limits: EngineLimits
) -> FairPrice | None:
    """The fair share's cost model, quantum (seconds of work each session may add to a pass) and fixed cost, or None
    with nothing to price by.

    With τ known: a piece is priced by τ(x | y) less its fixed cost a, and the quantum is what the sub-chunk budget
    computed on τ's own fixed cost and per-row cost costs after no context, a·(1 − ε) / ε (a short-context piece gets
    the rows it always got, one late in a long context what the same time buys: fewer), within what 16 rows and
    max_batch_tokens rows cost. Not on g: g has no context term, so a
    long-context flood inflates its slope and drives its intercept below 0 (measured in `bench fair-share`: the
    budget fell to its 16-row floor), which would shrink everyone's quantum. Before τ is known: g's slope per row,
    g's budget (rows, no context term) and g's intercept (0 if below). With neither (g's slope not positive: it has
    seen passes of one size only, e.g. a session's rounds, and measured: a slightly negative slope), None: the
    scheduler then runs the least pieces rather than a whole-frame quantum of max_batch_tokens (which let a flood's
    first 1 MiB draft run whole, 1.5 s, beside a 0.07 s round)."""
    if tau is not None and tau.b > 0:
        cost = RowCost(tau.b, tau.c, tau.d)
        # b·X for the budget X = a·(1 − ε) / (ε·b): the fixed cost's multiple itself, so a small fitted b (a loaded
        # host's noise) cannot blow the budget up to max_batch_tokens, whose x² term alone made a 20 s quantum
        overhead = limits.subchunk_overhead
        quantum = tau.a * (1 - overhead) / overhead
        return FairPrice(
            cost, min(max(quantum, cost(MIN_SUBCHUNK, 0)), cost(limits.max_batch_tokens, 0)), max(tau.a, 0)
        )
    if slope > 0:
        cost = RowCost(slope)
        return FairPrice(cost, cost(budget, 0), max(intercept, 0.0))
    return None


def _tensor_frames(session: Session, most: int) -> list[Item]:
    """Up to `most` of the session's queued tensor frames, in order."""
    frames: list[Item] = []
    for item in session.queue:
        if item.frame is not None and item.frame.kind not in CONTROL_KINDS:
            frames.append(item)
            if len(frames) == most:
                break
    return frames


def _backlog(session: Session) -> bool:
    """More than one tensor frame of the session is queued: a flood, or a prompt's chunks sent at once."""
    return len(_tensor_frames(session, 2)) > 1


def has_tensor_frame(session: Session) -> bool:
    """The session has a tensor frame queued (its next round or chunk is at the worker)."""
    return bool(_tensor_frames(session, 1))


def _splittable(item: Item) -> bool:
    """Whether a frame's rows may run over several passes: consecutive positions (a prefill chunk, a chain of drafts)
    are exact with the KV cache; a token tree's nodes see each other only within one pass."""
    return item.frame.kind == wire.Kind.PREFILL_CHUNK or item.tree is None  # type: ignore[union-attr]
