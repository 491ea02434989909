"""Fair share of a HAT worker's passes between its sessions: deficit round robin over rows.

Why: the worker runs one piece of every pending session's next frame in each forward pass, and a pass costs what
its rows cost. A session that floods its backlog with large frames (forty 1 MiB drafts sent at once) made every
pass it took part in as long as its own frame, so every other session's verification round waited behind it:
their round latency went from ~0.2 s to 3-4 s. Here each session earns `quantum` rows of credit per pass and runs
what its credit covers: a frame that fits runs whole; a larger frame that may run in pieces (a prefill chunk, a
chain of drafts: consecutive positions, exact with the KV cache) runs a piece of its credit; one that may not (a
token tree, whose nodes attend to each other in one pass) waits, keeping its credit, until the credit covers it.
So a pass carries at most `quantum` rows of any one session (a waiting tree's whole frame once its credit has
grown to it), and a small frame never waits behind another session's flood for more than a pass.

Pure: plain numbers in, plain numbers out; the worker's scheduler (app/worker/scheduler.py) keeps each session's
credit and picks the quantum (its sub-chunk budget, from the fitted pass time g).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.worker_batching import split_sizes


@dataclass(frozen=True)
class Pending:
    """A session's next frame as a pass sees it."""

    rows: int  # rows it still has to run
    splittable: bool  # whether it may run in pieces over several passes


def fair_shares(
    pending: Sequence[Pending], credits: Sequence[float], quantum: int, min_piece: int = 1
) -> tuple[list[int], list[float]]:
    """One pass of deficit round robin over `pending` (in round-robin order) with the credits each session kept
    from earlier passes. Returns the rows each runs in this pass (0: it waits) and the credit each keeps.

    A session whose frame runs whole keeps no credit (it had its turn; credit is not banked while idle); a piece of a
    splittable frame is at least `min_piece` rows (a smaller pass would be mostly fixed cost) and uses up that much
    credit; a frame that waits keeps its credit. A pass is never empty: when every frame waits, the one with the
    most credit runs whole."""
    if quantum < 1 or min_piece < 1:
        raise ValueError(f"quantum and min_piece must be >= 1, got {quantum} and {min_piece}")
    if len(pending) != len(credits):
        raise ValueError(f"{len(pending)} pending frames but {len(credits)} credits")
    runs: list[int] = []
    kept: list[float] = []
    for frame, credit in zip(pending, credits, strict=True):
        if frame.rows < 1:
            raise ValueError(f"a pending frame has at least one row, got {frame.rows}")
        credit += quantum
        if frame.rows <= credit:
            runs.append(frame.rows)
            kept.append(0.0)
        elif frame.splittable:
            # the first of the fewest pieces within the credit, as equal as possible: no small remainder left for a
            # pass of its own (200 rows at a credit of 96: 67, 67, 66 rather than 96, 96, 8)
            piece = min(frame.rows, max(min_piece, split_sizes(frame.rows, max(1, int(credit)))[0]))
            runs.append(piece)
            kept.append(max(0.0, credit - piece))
        else:
            runs.append(0)
            kept.append(credit)
    if pending and not any(runs):
        first = max(range(len(pending)), key=lambda i: kept[i])
        runs[first], kept[first] = pending[first].rows, 0.0
    return runs, kept
