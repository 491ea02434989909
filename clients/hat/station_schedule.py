"""The drafting station's pure decisions (clients/hat/station.py): which work runs next, and streams cut into equal
groups. No clock reads (time is an argument), no I/O: the station feeds it its pending work and its streams'
whereabouts and runs what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["prefill", "draft", "verify"]
Away = Literal["drafted", "verified"]  # a decoding stream with nothing pending: draft at the worker / between rounds


@dataclass(frozen=True)
class Pending:
    kind: Kind
    at: float  # when it was submitted


def next_unit(
    groups: Sequence[Sequence[int]],
    pending: dict[int, Pending],
    away: dict[int, tuple[Away, float]],
    now: float,
    max_wait: float,
    sync_wait: float,
) -> tuple[Kind, list[int]] | float | None:
    """What the station runs next: (kind, stream ids), else the time at which a waiting group stops waiting (a
    float), else None (nothing pending).

    Prefill pieces are ready as soon as they arrive (all pending ones run together). A group's decode work waits
    for its decoding members that have none pending (`away`: where each is, since when): up to `max_wait` after a
    member's verification for members between rounds ("verified": handing out tokens, their next draft comes at
    once), up to `sync_wait` after the group's oldest piece for members whose draft is at the worker ("drafted"),
    so members that fell out of step (one joined late, one straggled) wait out one round trip once and then go
    together. A ready
    group verifies first (all its members with a verification pending), else drafts. Among ready units the one
    ready first runs first (ties: verify, draft, prefill), so no group and no prefill is starved.
    """
    ready: list[tuple[float, int, Kind, list[int]]] = []
    deadline: float | None = None
    order = {"verify": 0, "draft": 1, "prefill": 2}
    prefills = [s for s, p in pending.items() if p.kind == "prefill"]
    if prefills:
        ready.append((min(pending[s].at for s in prefills), order["prefill"], "prefill", sorted(prefills)))
    grouped: set[int] = set()
    for group in groups:
        grouped.update(group)
        jobs = [s for s in group if s in pending and pending[s].kind != "prefill"]
        if not jobs:
            continue
        oldest = min(pending[s].at for s in jobs)
        kind: Kind = "verify" if any(pending[s].kind == "verify" for s in jobs) else "draft"
        chosen = [s for s in jobs if pending[s].kind == kind]
        members_away = [away[s] for s in group if s in away]
        waits = [since + max_wait if where == "verified" else oldest + sync_wait for where, since in members_away]
        if not waits:
            ready_at = max(pending[s].at for s in jobs)
        else:
            ready_at = max(waits)
            if ready_at > now:
                deadline = ready_at if deadline is None else min(deadline, ready_at)
                continue
        ready.append((ready_at, order[kind], kind, chosen))
    loose = [s for s, p in pending.items() if p.kind != "prefill" and s not in grouped]  # joined since the plan
    if loose:
        kind = "verify" if any(pending[s].kind == "verify" for s in loose) else "draft"
        chosen = [s for s in loose if pending[s].kind == kind]
        ready.append((min(pending[s].at for s in chosen), order[kind], kind, chosen))
    if ready:
        _, _, kind, chosen = min(ready, key=lambda r: (r[0], r[1]))
        return kind, chosen
    return deadline


def equal_groups(ids: Sequence[int], count: int) -> list[list[int]]:
    """`ids` (in order) cut into `count` contiguous groups of near-equal size (none empty)."""
    count = max(1, min(int(count), len(ids)))
    size, extra = divmod(len(ids), count)
    out, start = [], 0
    for g in range(count):
        end = start + size + (1 if g < extra else 0)
        out.append(list(ids[start:end]))
        start = end
    return [g for g in out if g]
