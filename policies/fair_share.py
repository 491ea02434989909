"""Fair share of a HAT worker's passes between its sessions: deficit round robin over pass time.

Why: the worker runs one piece of every pending session's next frame in each forward pass, and a pass lasts what
its pieces cost. A session that floods its backlog with large frames (forty 1 MiB drafts sent at once) made every
pass it took part in as long as its own frame, so every other session's verification round waited behind it:
their round latency went from ~0.2 s to 3-4 s. Here each session earns `quantum` of credit per pass and runs what
its credit covers: a frame that fits runs whole; a larger frame that may run in pieces (a prefill chunk, a chain of
drafts: consecutive positions, exact with the KV cache) runs a piece of its credit; one that may not (a token tree,
whose nodes attend to each other in one pass) waits, keeping its credit, until the credit covers it.

The currency is time, not rows. A row's cost depends on the context it attends over: a piece of a flood late in its
context (4000 positions cached) costs several times what as many rows after none cost, so a quantum of rows let a
long-context piece make the pass far longer than its rows said (the other session's rounds stayed ~14× their usual
length). A piece of x rows after y cached positions is priced by `RowCost`: what it adds to a pass it shares, the
worker's prefill cost τ(x | y) = a + b·x + c·x·y + d·x² less the fixed cost a, which the pass pays once whoever runs
in it. With `ROW_COUNT` (one second a row, no context term) this is deficit round robin over rows.

So a pass carries about a quantum of any one session's work (what its credit covers: the quantum and what it kept
from earlier passes; a waiting tree's whole frame once its credit has grown to it; a piece of `min_piece` rows once
the credit covers it; more only when every frame waits and one must run), and a small frame never waits behind
another session's flood for more than a pass. `anticipation` says how long to hold a pass of only a flood's pieces
for a session about to send, so its frame does not arrive behind one either.

Pure: plain numbers in, plain numbers out; the worker's scheduler (app/worker/scheduler.py) keeps each session's
credit, picks the quantum and hands in the cost model (its fitted τ, or g's slope before τ is known); the engine
(app/worker/engine.py) times the sessions' turns and holds the pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.worker_batching import split_sizes


@dataclass(frozen=True)
class Pending:
    """A session's next frame as a pass sees it."""

    rows: int  # rows it still has to run
    splittable: bool  # whether it may run in pieces over several passes
    context: int = 0  # positions the session's cache holds before these rows: each row attends over them
    bulk: bool = False  # a flood in progress: the frame is partly run already, or more of the session's wait behind it


@dataclass(frozen=True)
class RowCost:
    """Seconds x rows after y cached positions add to a shared pass: per_row·x + per_context·x·y + per_pair·x².

    τ(x | y) without its fixed cost (policies/sequence_partition.ChunkCost's b, c, d): per_row is the rows'
    weights and MLP, per_context their attention over the cache, per_pair their attention among themselves."""

    per_row: float
    per_context: float = 0.0
    per_pair: float = 0.0

    def __post_init__(self) -> None:
        terms = (self.per_row, self.per_context, self.per_pair)
        if not all(math.isfinite(t) and t >= 0 for t in terms) or not any(terms):
            raise ValueError(f"a row cost needs finite, non-negative terms, not all 0; got {terms}")

    def __call__(self, rows: int, context: int) -> float:
        return rows * (self.per_row + self.per_context * context + self.per_pair * rows)

    def rows_within(self, seconds: float, context: int, limit: int) -> int:
        """The most rows (at most `limit`) after `context` positions that cost at most `seconds`."""
        if seconds <= 0 or limit <= 0:
            return 0
        linear = self.per_row + self.per_context * context
        if self.per_pair > 0:  # per_pair·x² + linear·x = seconds
            rows = (-linear + math.sqrt(linear * linear + 4 * self.per_pair * seconds)) / (2 * self.per_pair)
        else:
            rows = seconds / linear if linear > 0 else float(limit)
        fit = int(min(float(limit), rows))
        # the root in floating point may be one off either way
        while fit < limit and self(fit + 1, context) <= seconds:
            fit += 1
        while fit > 0 and self(fit, context) > seconds:
            fit -= 1
        return fit


ROW_COUNT = RowCost(per_row=1.0)  # a second a row, no context: deficit round robin over rows


def fair_shares(
    pending: Sequence[Pending],
    credits: Sequence[float],
    quantum: float,
    min_piece: int = 1,
    cost: RowCost = ROW_COUNT,
    *,
    fixed: float = 0.0,
    slowdown: float | None = None,
) -> tuple[list[int], list[float]]:
    """One pass of deficit round robin over `pending` (in round-robin order) with the credits (seconds under `cost`)
    each session kept from earlier passes. Returns the rows each runs in this pass (0: it waits) and the credit each
    keeps.

    A session whose frame runs whole keeps no credit (it had its turn; credit is not banked while idle); a piece of a
    splittable frame is at least `min_piece` rows (a smaller pass would be mostly fixed cost) and uses up what it
    costs; a frame whose credit covers neither it whole nor such a piece waits and keeps its credit. A pass is never
    empty: when every frame waits, the one with the most credit runs (whole, or a piece of `min_piece` rows) and keeps
    what is left of its credit, if anything.

    slowdown: with other sessions' frames running whole beside bulk ones (`Pending.bulk`), the bulk pieces together
    add at most (slowdown − 1)× what the pass costs without them (`fixed`, the pass's own cost, plus the whole
    frames'), shared equally, so another session's round is at most `slowdown` times its usual pass however much a
    flood has queued (`bound_bulk`)."""
    if not quantum > 0 or min_piece < 1:
        raise ValueError(f"quantum must be > 0 and min_piece >= 1, got {quantum} and {min_piece}")
    if len(pending) != len(credits):
        raise ValueError(f"{len(pending)} pending frames but {len(credits)} credits")
    runs: list[int] = []
    kept: list[float] = []
    for frame, credit in zip(pending, credits, strict=True):
        if frame.rows < 1:
            raise ValueError(f"a pending frame has at least one row, got {frame.rows}")
        credit += quantum
        run = _share(frame, credit, min_piece, cost)
        runs.append(run)
        kept.append(credit if run == 0 else (0.0 if run == frame.rows else credit - cost(run, frame.context)))
    if slowdown is not None:
        runs, kept = bound_bulk(pending, credits, runs, kept, quantum, cost, fixed, slowdown)
    if pending and not any(runs):
        first = max(range(len(pending)), key=lambda i: kept[i])
        frame = pending[first]
        runs[first] = min(frame.rows, min_piece) if frame.splittable else frame.rows
        kept[first] = 0.0 if runs[first] == frame.rows else max(0.0, kept[first] - cost(runs[first], frame.context))
    return runs, kept


def bound_bulk(
    pending: Sequence[Pending],
    credits: Sequence[float],
    runs: list[int],
    kept: list[float],
    quantum: float,
    cost: RowCost,
    fixed: float,
    slowdown: float,
) -> tuple[list[int], list[float]]:
    """Cut the bulk frames' pieces of a pass that also carries other sessions' frames running whole (their rounds), so
    that together they add at most (slowdown − 1)·(fixed + those frames' cost) to it, an equal allowance each. Bulk
    frames that may not be cut (token trees) keep their quantum; a frame not bulk but cut (a large first frame) is
    neither: the quantum bounds it, and from its second piece on it is bulk.

    Why: deficit round robin alone gives a flood a quantum a pass, and the quantum is sized for throughput (four of the
    pass's fixed costs at the default sub-chunk overhead): another session's round in such a pass took 4-9× its
    usual time (BENCHMARKS.md, fair share). Bounding by the other frames' own pass ties the flood's share to what it
    delays. A bulk piece may then be smaller than `min_piece`, or nothing (it runs in the next pass without others);
    its credit keeps at most a quantum, so what the bound held back is not spent in one piece when the others leave."""
    if not slowdown > 1 or fixed < 0:
        raise ValueError(f"slowdown must be > 1 and fixed >= 0, got {slowdown} and {fixed}")
    whole = [i for i, frame in enumerate(pending) if not frame.bulk and runs[i] == frame.rows]
    bulk = [i for i, frame in enumerate(pending) if frame.bulk and frame.splittable]
    if not whole or not bulk:
        return runs, kept
    others = fixed + sum(cost(pending[i].rows, pending[i].context) for i in whole)
    allowance = (slowdown - 1) * others / len(bulk)
    runs, kept = list(runs), list(kept)
    for i in bulk:
        frame, credit = pending[i], credits[i] + quantum
        runs[i] = cost.rows_within(min(credit, allowance), frame.context, frame.rows)
        kept[i] = min(credit - cost(runs[i], frame.context), quantum)
    return runs, kept


def _share(frame: Pending, credit: float, min_piece: int, cost: RowCost) -> int:
    """The rows `credit` buys of `frame` in this pass: all of it, a piece, or none."""
    if cost(frame.rows, frame.context) <= credit:
        return frame.rows
    if not frame.splittable:
        return 0
    affordable = cost.rows_within(credit, frame.context, frame.rows)
    if affordable < min_piece:
        return 0
    # the first of the fewest pieces within the credit, as equal as possible: no small remainder left for a pass of
    # its own (200 rows at a credit of 96 rows: 67, 67, 66 rather than 96, 96, 8)
    return max(min_piece, split_sizes(frame.rows, affordable)[0])


# How late a session answered a moment ago may send its next frame, as a multiple of its usual gap, and still be held
# for: a gap is noisy (the device's own work, the link), and a held pass costs a flood no more than the hold.
LATE_FACTOR = 1.5
# ... and at least this share of the cap: a turn of a few milliseconds jitters by as much again on a loaded host
# (traced: rounds whose frame reached the engine 5-8 ms after the reply, past 1.5× a 3 ms turn, waited 0.6 s behind a
# piece), and waiting a tenth of a piece for a frame that would otherwise wait the whole piece is cheap.
MIN_PATIENCE = 0.1


def anticipation(answered: Sequence[tuple[float, float]], cap: float) -> float:
    """Seconds to hold back a pass that would carry only a flood's pieces, for a session answered a moment ago.

    Why: a pass cannot be pre-empted. When every pending frame is bulk (pieces of frames the fair share is cutting),
    a session whose reply just went out is usually between rounds: its next frame comes a few milliseconds later
    (the bench: a verification round's reply, ROLLBACK, the next DRAFT). A flood piece started in that gap makes it
    wait for the whole piece, late in a long context several times its own pass (measured: a 16-row piece after
    4000 positions ~0.3 s against a 4-row round's ~0.07 s); about half of its round during a flood was that wait.
    Holding the pass until its frame arrives lets the two share the next pass instead (anticipatory scheduling, as
    disk schedulers hold for a process about to issue its next read).

    `answered`: for each session with nothing queued whose last frame was answered, (seconds since that reply, its
    usual reply-to-next-frame gap). The hold lasts until the soonest of them is due (LATE_FACTOR × its gap since its
    reply, at least MIN_PATIENCE × cap) and never past `cap` seconds after that reply (the time one flood piece may
    take: holding longer would cost the flood more than the piece costs the other). 0: run the pass now."""
    hold = math.inf
    for since, gap in answered:
        due = min(max(LATE_FACTOR * gap, MIN_PATIENCE * cap), cap) - since
        if due > 0:
            hold = min(hold, due)
    return 0.0 if hold == math.inf else hold
