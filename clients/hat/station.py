"""The drafting station: one HAT backend drafts all its concurrent streams together (SD-edge §II-B..III, Eq. 20).

A gateway serving K HAT streams at once used to run each stream's device work as its own model calls, one at a
time on the backend's model thread. The station gathers the streams' pending device work and runs it batched:

- draft: one batched forward of the input submodel + adapter per draft step over every stream's next token
  (packed rows, each stream attending to its own KV caches: clients/hat/ragged.py's RaggedMiddle, which also
  drives the adapter's attention-only block), and one draft-head call over the rows that want logits; each
  stream's Eq. 5 stop rule, cap, grammar mask and sampling decide its own drafts (clients/hat/drafting.py,
  DraftRun), so streams drop out of the batch as they stop;
- verify: one LM-head call over every stream's first verification row (plus, for free, further rows up to the
  head's 4-row chunk), and one more over the remaining rows of the streams whose first draft was accepted, the
  head's lazy order kept; streams with sampling, penalties or a grammar get all their rows in the first call;
- prefill: the chunks streams have pending, as one ragged forward.

Grouping and the pipeline. Streams are split into the groups with the least steady round period of this free-running
station (policies/stream_groups.py: exact; each stream's work from its context) with T(b, F) = c1·F·b + c2 fitted
from the station's own timed passes (device stage: draft unit + head unit; verify stage: the streams' send -> reply
times); `grouping = "alg1"` uses SD-edge's Alg. 1 instead (the paper's step-barrier model, kept as a baseline).
A group is drafted when every one of its decoding members has its next round's work pending (a member handing out its
tokens is waited for up to `max_wait`, one whose draft is still at the worker up to `sync_wait`, so streams that fell
out of step fall back in); while group m's drafts are at the worker the station drafts group m + 1: the worker's round
trip of one group overlaps the device work of the next. Before the fits have data, and whenever the plan says so,
all streams form one group.

Exactness. Every batched call is batch-invariant: the ragged forwards pad to >= 4 rows and attend per stream, draft
steps' projections and the heads go through ragged.rows_linear (fixed 4-row chunks), so a stream's shallow states,
drafts and logits are bit-identical whether it ran alone through the station or beside others: greedy output is the
same token for token. (`drafting = "solo"`, the one-call-at-a-time path, uses the model's own layer forwards: equal
up to float reassociation, as HAT is to U-shape decoding.)

Parallel drafting runs only while the station serves a single stream (with more, the device has no idle time to
fill). The batched passes run on the backend's model thread (clients/hat/model_thread.py) over its device half
(clients/hat/half.py); the scheduling runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from clients.hat.drafting import Draft, DraftRun, DraftState
from clients.hat.half import DeviceHalf
from clients.hat.model_thread import ModelThread
from clients.hat.ragged import ROWS_CHUNK, RaggedMiddle, project_each_row, project_rows
from clients.hat.request_sampling import Sampling
from clients.hat.station_schedule import Away, Kind, Pending, equal_groups, next_unit
from clients.hat.verify import Verdict, VerifyJob, verify_round
from policies.cost import ModelArch
from policies.drafting import DraftStopRule
from policies.sd_edge import Runtime, fit_runtime
from policies.stream_groups import alg1_stream_groups, attention_span, plan_stream_groups

log = logging.getLogger(__name__)

# The exact grouping on the fitted times (policies/stream_groups.py); SD-edge's Alg. 1 on them (the paper's baseline);
# all streams in one group; M equal groups
Grouping = Literal["exact", "alg1", "one"] | int
DEFAULT_MAX_WAIT = 0.02  # seconds a group waits for a member between rounds (handing out its tokens)
DEFAULT_SYNC_WAIT = 1.0  # seconds a group waits for a member whose draft is still at the worker
REPLAN_EVERY = 8  # draft units between Alg. 1 re-plans (besides every join and leave)
FIT_POINTS = 64  # recent timed passes kept per stage for the T(b, F) fits


@dataclass(eq=False)
class StreamSlot:
    """One stream's place at the station."""

    id: int
    context: int  # its current length (Alg. 1 orders streams by it)
    decoding: bool = False  # in decode rounds: its group waits for its next round before drafting
    away: Away = "verified"  # where a decoding stream with nothing pending is
    away_since: float = 0.0
    sent: tuple[int, int] = (1, 1)  # (streams, rows) of the draft unit its latest draft went out with


@dataclass(eq=False)
class _Job:
    kind: Kind
    slot: StreamSlot
    args: Any  # a prefill's or a draft's arguments, or a VerifyJob
    future: asyncio.Future[Any]
    at: float


# --- the station ---------------------------------------------------------------------------------------------------


@dataclass
class StationStats:
    units: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "draft": 0, "verify": 0})
    streams: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "draft": 0, "verify": 0})
    max_streams: int = 0  # most streams in one unit
    draft_steps: int = 0  # batched draft forwards
    head_calls: int = 0
    head_rows: int = 0
    plans: int = 0
    widest_plan: list[int] = field(default_factory=list)  # group sizes of the latest plan over the most streams


class DraftingStation:
    """Batched device work for a HATBackend's concurrent streams (see the module docstring): over `half`, on
    `thread`, drafts stopped by `rule`; `token_bytes` (token id -> bytes) spells logprobs' tokens."""

    def __init__(
        self,
        half: DeviceHalf,
        thread: ModelThread,
        rule: DraftStopRule,
        token_bytes: Callable[[int], bytes],
        *,
        grouping: Grouping = "exact",
        max_wait: float = DEFAULT_MAX_WAIT,
        sync_wait: float = DEFAULT_SYNC_WAIT,
        draft_step_rows: Literal["each", "chunked"] = "each",
    ):
        self.half = half
        self.thread = thread
        self.rule = rule
        self.token_bytes = token_bytes
        self.grouping: Grouping = grouping
        self.max_wait = max_wait
        self.sync_wait = sync_wait
        self.span = _attention_span(half)
        self._input = RaggedMiddle(half.input.stack, ROWS_CHUNK, batch_invariant=True)
        self._adapter = RaggedMiddle(half.adapter.stack, ROWS_CHUNK, batch_invariant=True)
        self._draft_project = project_each_row if draft_step_rows == "each" else project_rows  # HATOptions
        self._slots: dict[int, StreamSlot] = {}
        self._next_id = 0
        self._jobs: dict[int, _Job] = {}  # at most one pending job per stream
        self._groups: list[list[int]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._units_since_plan = 0
        self.draft_points: deque[tuple[float, float, float]] = deque(maxlen=FIT_POINTS)  # (b, F, s)
        self.head_points: deque[tuple[float, float, float]] = deque(maxlen=FIT_POINTS)
        self.wait_points: deque[tuple[float, float, float]] = deque(maxlen=FIT_POINTS)
        self.stats = StationStats()

    # --- streams ---------------------------------------------------------------------------------------------

    def join(self, context: int) -> StreamSlot:
        slot = StreamSlot(self._next_id, context)
        self._next_id += 1
        self._slots[slot.id] = slot
        self._replan()
        return slot

    def leave(self, slot: StreamSlot) -> None:
        self._slots.pop(slot.id, None)
        job = self._jobs.pop(slot.id, None)
        if job is not None and not job.future.done():
            job.future.cancel()
        self._replan()
        self._wake.set()

    def alone(self, slot: StreamSlot) -> bool:
        """True when `slot` is the only stream here (parallel drafting may then use the idle device)."""
        return len(self._slots) == 1 and slot.id in self._slots

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for job in self._jobs.values():
            if not job.future.done():
                job.future.cancel()
        self._jobs.clear()

    # --- work submitted by the streams -----------------------------------------------------------------------

    async def prefill(self, slot: StreamSlot, st: DraftState, ids: list[int], start: int) -> torch.Tensor:
        return await self._submit("prefill", slot, (st, ids, start))

    async def draft(
        self, slot: StreamSlot, st: DraftState, token: int, position: int, cap: int, sampling: Sampling
    ) -> Draft:
        slot.decoding = True
        slot.context = position
        return await self._submit("draft", slot, (st, token, position, cap, sampling))

    async def verify(self, slot: StreamSlot, job: VerifyJob) -> tuple[Verdict, list | None]:
        """verify.verify_round of `job`, the head's rows computed batched with other streams'."""
        return await self._submit("verify", slot, job)

    def observe_wait(self, slot: StreamSlot, seconds: float) -> None:
        """A stream's send -> reply time for its latest draft: a point of the verify stage's T(b, F)."""
        streams, rows = slot.sent
        self.wait_points.append((streams, rows / streams, seconds))

    async def _submit(self, kind: Kind, slot: StreamSlot, args: Any) -> Any:
        if slot.id not in self._slots:
            raise RuntimeError("stream is not at the station")
        if slot.id in self._jobs:
            raise RuntimeError(f"stream {slot.id} already has work pending")
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._serve())
        job = _Job(kind, slot, args, loop.create_future(), time.monotonic())
        self._jobs[slot.id] = job
        self._wake.set()
        try:
            return await job.future
        finally:
            if self._jobs.get(slot.id) is job:
                del self._jobs[slot.id]

    # --- scheduling ------------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            self._wake.clear()
            pending = {s: Pending(j.kind, j.at) for s, j in self._jobs.items() if not j.future.done()}
            away = {s.id: (s.away, s.away_since) for s in self._slots.values() if s.decoding and s.id not in pending}
            choice = next_unit(self._groups, pending, away, time.monotonic(), self.max_wait, self.sync_wait)
            if choice is None or isinstance(choice, float):
                timeout = None if choice is None else max(0.0, choice - time.monotonic())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            kind, ids = choice
            jobs = [self._jobs.pop(s) for s in ids]
            await self._run_unit(kind, jobs)

    async def _run_unit(self, kind: Kind, jobs: list[_Job]) -> None:
        fn = {"prefill": self._prefill_batch, "draft": self._draft_batch, "verify": self._verify_batch}[kind]
        st = self.stats
        st.units[kind] += 1
        st.streams[kind] += len(jobs)
        st.max_streams = max(st.max_streams, len(jobs))
        try:
            results = await self.thread.run(fn, [j.args for j in jobs])
        except BaseException as exc:  # a torch failure (or the backend closing): every stream in the unit fails
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        done = time.monotonic()
        for j, result in zip(jobs, results, strict=True):
            j.slot.away, j.slot.away_since = ("drafted" if kind == "draft" else "verified"), done
            if j.future.done():
                continue
            if isinstance(result, BaseException):
                j.future.set_exception(result)
            else:
                j.future.set_result(result)
        if kind == "draft":
            rows = sum(int(r.shallow.shape[0]) for r in results if isinstance(r, Draft))
            for j in jobs:
                j.slot.sent = (len(jobs), rows)
            self._units_since_plan += 1
            if self._units_since_plan >= REPLAN_EVERY:
                self._replan()

    # --- grouping (Alg. 1 on the fitted stage times) ---------------------------------------------------------

    def fits(self) -> tuple[Runtime, Runtime] | None:
        """(device stage, verify stage) T(b, F) fitted from the recent timed passes, once each has a spread."""
        try:  # list(): a snapshot (the model thread may append while a stream's join re-plans)
            draft = fit_runtime(list(self.draft_points))
            head = fit_runtime(list(self.head_points))
            wait = fit_runtime(list(self.wait_points))
        except ValueError:
            return None
        device = Runtime(max(0.0, draft.c1) + max(0.0, head.c1), max(0.0, draft.c2) + max(0.0, head.c2))
        return device, Runtime(max(0.0, wait.c1), max(0.0, wait.c2))

    def _replan(self) -> None:
        self._units_since_plan = 0
        slots = sorted(self._slots.values(), key=lambda s: (s.context, s.id))
        ids = [s.id for s in slots]
        if not ids:
            self._groups = []
            return
        fitted = self.fits() if self.grouping in ("exact", "alg1") else None
        if isinstance(self.grouping, int):
            groups = equal_groups(ids, self.grouping)
        elif fitted is None:
            groups = [ids]
        else:
            device, verify = fitted
            recent = list(self.wait_points)[-16:]
            rows = sum(f for _, f, _ in recent) / len(recent) if recent else 2.0
            contexts = [s.context for s in slots]
            if self.grouping == "exact":
                plan = plan_stream_groups(contexts, device, verify, rows, self.span)
            else:
                plan = alg1_stream_groups(contexts, device, verify, rows)
            groups = [[ids[i] for i in g] for g in plan]
        self._groups = groups
        self.stats.plans += 1
        if len(ids) >= sum(self.stats.widest_plan):
            self.stats.widest_plan = [len(g) for g in groups]

    # --- the batched passes (model thread) -------------------------------------------------------------------

    def _feed(
        self, items: list[tuple[list[int], DraftState, int]], draft_step: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        """Token ids of several streams, each at its position: shallow states and adapter features per stream, in
        one ragged forward of the input layers and one of the adapter (appending to each stream's caches).

        Draft steps (one row per stream) project through ragged.project_each_row or project_rows (HATOptions.
        draft_step_rows); prefill chunks through the layers' own linears (blocked GEMM over >= 4 rows). Either way a
        row's result does not depend on the other rows, and a row is a draft step's or a prefill's whatever else runs.
        Also returns the seconds the input layers took (the rounds' profile)."""
        for _, st, position in items:
            if len(st.input_cache) != position or len(st.adapter_cache) != position:
                raise RuntimeError(f"drafting station: caches hold {len(st.input_cache)} positions, fed at {position}")
        sizes = [len(ids) for ids, _, _ in items]
        flat = torch.tensor([t for ids, _, _ in items for t in ids], dtype=torch.long)
        embedded = self.half.input.embed_tokens(flat).split(sizes)
        project = self._draft_project if draft_step else None
        t0 = time.perf_counter()
        shallow = self._input.forward(
            [(e, st.input_cache) for e, (_, st, _) in zip(embedded, items, strict=True)], project=project
        )
        input_seconds = time.perf_counter() - t0
        feats = self._adapter.forward(
            [(s, st.adapter_cache) for s, (_, st, _) in zip(shallow, items, strict=True)], project=project
        )
        return [s.clone() for s in shallow], feats, input_seconds

    def _prefill_batch(self, jobs: list[tuple[DraftState, list[int], int]]) -> list[torch.Tensor]:
        with torch.inference_mode():
            shallow, _, _ = self._feed([(ids, st, start) for st, ids, start in jobs])
        return shallow

    def _draft_batch(self, jobs: list[tuple[Any, ...]]) -> list[Draft]:
        runs = [DraftRun(self.rule, *args[1:]) for args in jobs]
        states: list[DraftState] = [args[0] for args in jobs]
        t0 = time.perf_counter()
        fed = 0
        with torch.inference_mode():
            while True:
                active = [i for i, r in enumerate(runs) if not r.done]
                if not active:
                    break
                shallow, feats, input_seconds = self._feed(
                    [([runs[i].token], states[i], runs[i].position) for i in active], draft_step=True
                )
                for i in active:  # each stream's share of the shared pass
                    runs[i].input_seconds += input_seconds / len(active)
                fed += len(active)
                self.stats.draft_steps += 1
                want = [(i, f) for i, s, f in zip(active, shallow, feats, strict=True) if runs[i].fed(s, f[-1:])]
                if want:
                    rows = torch.cat([f[-1:] for _, f in want])
                    logits = self.half.draft_logits(rows, [runs[i].position for i, _ in want])
                    for (i, _), row in zip(want, logits, strict=True):
                        runs[i].decide(row)
        drafts = [r.finish() for r in runs]
        self.draft_points.append((len(jobs), fed / len(jobs), time.perf_counter() - t0))
        return drafts

    def _verify_batch(self, jobs: list[VerifyJob]) -> list[Any]:
        """verify.verify_round for each job, its head rows computed in (at most) two batched calls."""
        t0 = time.perf_counter()
        computed: list[dict[int, torch.Tensor]] = [{} for _ in jobs]
        head_rows = 0

        def run_head(wanted: list[tuple[int, int]]) -> None:
            nonlocal head_rows
            for argmax_only in (True, False):  # each row batch-invariant either way: one call per kind of head
                part = [(j, r) for j, r in wanted if jobs[j].sampling.argmax_only == argmax_only]
                if not part:
                    continue
                rows = torch.stack([jobs[j].deep[r] for j, r in part])
                logits = self.half.verification_head(argmax_only, batch_invariant=True)(rows)
                for (j, r), row in zip(part, logits, strict=True):
                    computed[j][r] = row
                head_rows += len(part)
                self.stats.head_calls += 1

        with torch.inference_mode():
            first: list[tuple[int, int]] = []
            rest: list[tuple[int, int]] = []  # rows a plain job may need: they fill the first call's last chunk
            for j, job in enumerate(jobs):  # greedy on raw logits: the lazy row order applies
                n = int(job.deep.shape[0])
                first += [(j, r) for r in range(n if not job.sampling.raw_argmax else 1)]
                if job.sampling.raw_argmax:
                    rest += [(j, r) for r in range(1, n)]
            fill = -len(first) % ROWS_CHUNK
            run_head(first + rest[:fill])
            second = []
            for j, job in enumerate(jobs):
                n = int(job.deep.shape[0])
                if job.sampling.raw_argmax and n > 1 and int(computed[j][0].argmax()) == job.draft.tokens[0]:
                    second += [(j, r) for r in range(1, n) if r not in computed[j]]
            run_head(second)
        self.stats.head_rows += head_rows
        t_head = time.perf_counter() - t0
        results: list[Any] = []
        for j, job in enumerate(jobs):
            deep = job.deep
            rows = computed[j]
            rows_of = self.half.verification_head(job.sampling.argmax_only, batch_invariant=True)

            def head(
                lo: int,
                hi: int,
                deep: torch.Tensor = deep,
                rows: dict[int, torch.Tensor] = rows,
                rows_of: Callable[[torch.Tensor], torch.Tensor] = rows_of,
            ) -> torch.Tensor:
                missing = [r for r in range(lo, hi) if r not in rows]
                if missing:  # not foreseen above (cannot happen for plain jobs): still batch-invariant rows
                    for r, row in zip(missing, rows_of(deep[missing]), strict=True):
                        rows[r] = row
                return torch.stack([rows[r] for r in range(lo, hi)])

            try:
                results.append(verify_round(job, head, self.token_bytes))
            except Exception as exc:  # one stream's failure (e.g. its grammar) is its own
                results.append(exc)
        self.head_points.append((len(jobs), max(head_rows, 1) / len(jobs), t_head))
        return results


def _attention_span(half: DeviceHalf) -> float:
    """The context at which a row's attention costs as much as its weights (policies.stream_groups), from the model's
    config; inf (context ignored) when the config does not say."""
    cfg = getattr(getattr(half.input, "stack", None), "config", None)
    try:
        heads = int(cfg.num_attention_heads)
        arch = ModelArch(
            n_layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), intermediate=int(cfg.intermediate_size),
            n_heads=heads, n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            vocab=int(cfg.vocab_size), head_dim=getattr(cfg, "head_dim", None),
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return float("inf")
    return attention_span(arch)
