"""One request's life: plan → race → relay → migrate → account.

- Plan: DiSCo's dispatch policy (or a pinned backend) says which endpoints start,
  and for DiSCo-D how long the device waits for the cloud's first token.
- Race: when both start, the first token wins and the loser is cancelled at once
  (its prefill is still booked). A failure before the first token falls back to
  the other endpoint.
- Relay: every event goes through the answer's `Relay` (app/serving/relay.py):
  stop sequences, the token limit, tool calls held until whole, the consumption
  clock, and the prefix a migration continues from.
- Migrate: after every token DiSCo's migration rule may say "move" (a policy that
  migrates for cost): once the lead reaches the buffer B = r_c·t_m the source
  stops and the target continues from
  exactly the delivered prefix (token IDs when it shares the vocabulary, else
  text, in the target's continuation dialect, joined at a seam: app/serving/seam.py).
  A source that errors or stalls mid-stream is migrated the same way, so a fault
  becomes a migration, not a broken answer. Under the quality policy a device answer
  whose confidence falls below τ, or that writes again a tool call the conversation
  holds answered, goes on on the cloud the same way (policies/quality.py); an answer the
  client gets whole (not streamed) has no seam to keep, so a confidence escalation starts
  it over on the cloud instead, the device's tokens dropped.
- Account: as the answer streams (every settle interval) and when it ends, every attempt's cost goes into the
  ledger, and at the end its usage into the metrics (app/serving/accounting.py); its trace is kept (`remember`).

Each step is published on the event bus (app/serving/events.py) as it happens: the plan, every endpoint's start,
win, loss, failure and finish, every migration's start and end, and the request's end with its trace. The live
feed, the dashboard and the OpenTelemetry spans read it there.

Why one module past ~600 lines: every step above reads and writes the same request's attempts (which endpoint
holds the stream, which may continue it, what was delivered), so plan, race, relay and migration stay together;
the parts with no such state live beside it (relay.py, seam.py, job.py, traces.py, accounting.py, policies/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import anyio

from app.serving.accounting import Accounting
from app.serving.disco import conversation_key
from app.serving.events import EventBus
from app.serving.job import Attempt, Job
from app.serving.metrics import Metrics
from app.serving.relay import Delta, Prefix, Relay
from app.serving.seam import Seam, split_trailing_whitespace, through_seam
from app.serving.traces import ms, plan_kind, replay_row, trace_of
from clients.base import Backend, BackendError, GenerationRequest, TokenEvent, Usage
from clients.deadline import Deadline
from policies.breaker import CircuitBreaker
from policies.dispatch import DispatchPlan
from policies.estimate import MovingAverage
from policies.privacy import allows
from policies.quality import ConfidenceMonitor, call_key, loops, repeats

log = logging.getLogger(__name__)


class _Failed(Exception):
    """Every endpoint failed before producing a token."""


class Orchestrator:
    def __init__(
        self,
        backends: dict[str, Backend],
        device: str,
        cloud: str | None,
        fallback: bool,
        metrics: Metrics,
        disco,
        ledger,
        stall_timeout: float = 10.0,
        stall_timeouts: dict[str, float] | None = None,
        history: int = 1000,
        trace_file: str = "",
        events: EventBus | None = None,
        breakers: dict[str, CircuitBreaker] | None = None,
    ):
        self.events = events if events is not None else EventBus()
        self.backends = backends
        self.device = device
        self.cloud = cloud
        self.fallback = fallback
        self.metrics = metrics
        self.disco = disco
        self.ledger = ledger
        self.accounting = Accounting(disco, ledger, metrics)
        self.stall_timeout = stall_timeout
        self.stall_timeouts = stall_timeouts or {}  # an endpoint's own, where it has one
        self.traces: OrderedDict[str, dict] = OrderedDict()
        self.breakers = breakers or {}  # a cloud's, where it has one: while it cools, nothing starts or moves there
        # A shared store's copy of each trace (app/serving/state.py's keep_trace), so any replica can answer for it.
        self.keep_trace: Callable[[str, dict], None] | None = None
        # Seconds between two tokens of each endpoint (outline decoding places points by predicted finish time).
        self.token_seconds: dict[str, MovingAverage] = {name: MovingAverage() for name in backends}
        self.history = history
        self._trace_out = None
        if trace_file:
            path = os.path.expanduser(trace_file)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._trace_out = open(path, "a", buffering=1, encoding="utf-8")  # lives with the app

    # -- helpers -----------------------------------------------------------------------------------
    def stall_of(self, name: str) -> float:
        """The mid-answer silence after which endpoint `name` counts as stalled."""
        return self.stall_timeouts.get(name, self.stall_timeout)

    def role_of(self, name: str) -> str:
        return "device" if name == self.device else "cloud"

    def _serves(self, job: Job, name: str | None, continuing: bool = False) -> bool:
        """Whether `name` may serve this request: its privacy level allows the endpoint's locality, and the
        endpoint can give the answer the structure it asks for (a grammar from tool_choice or response_format: a
        chat upstream that enforces it natively only from the start, a backend that applies the grammar itself, or
        an upstream sent its GBNF form, also from a delivered prefix; tools without a grammar go anywhere but to a
        chat upstream configured not to take them), and its context window holds the prompt, the answer delivered so
        far when it continues one, and one token more. Starts, races, fallbacks, cost migrations and fault migrations
        all ask here."""
        if name is None:
            return False
        backend = self.backends[name]
        if not allows(job.privacy, backend.locality):  # the one place every route passes: plan, race, moves
            return False
        if not self._holds(job, name, continuing):
            return False
        continuing = continuing or bool(job.gen.prefill)  # the client's own prefill is continued from the start
        if continuing and not backend.can_continue:
            return False
        kind = backend.structured_output
        if job.gen.grammar is not None:
            if kind == "grammar" and not self._takes_ids(name) and "<[" in job.gen.grammar:
                return False  # its `<[id]>` special tokens are the device vocabulary's ids (a HAT with another model)
            if kind == "gbnf":
                return job.gen.gbnf is not None  # None: the constraint has no GBNF form (clients/gbnf.py)
            return kind == "grammar" or (kind == "native" and not continuing)
        # Tools travel in the prompt the gateway renders, except to a chat upstream, which must take them itself.
        return not (job.gen.tools and kind == "none" and not backend.can_continue)

    def _holds(self, job: Job, name: str, continuing: bool = False) -> bool:
        """Whether endpoint `name`'s window holds the prompt (with the answer delivered so far, when it would continue
        it) and one token more."""
        context = job.prompt_tokens + (_delivered(job) if continuing else 0)
        return context < self.backends[name].context_window

    def _keeps_calls_whole(self, job: Job, name: str | None, continuing: bool = False) -> bool:
        """Whether a call the model starts on `name` comes out whole and valid: it applies the request's tool grammar
        (tool_choice auto; app/serving/structured.py), or it is a chat upstream that takes the tools itself. True for
        a request without one."""
        if job.gen.tool_grammar is None or job.gen.grammar is not None:
            return True
        if name is None:
            return False
        kind = self.backends[name].structured_output
        if kind == "native":
            return not continuing
        return kind == "grammar" and (self._takes_ids(name) or "<[" not in job.gen.tool_grammar)

    def _cooling(self, name: str | None) -> str | None:
        """Why endpoint `name` is kept out of plans and migrations now (its breaker is open), or None."""
        breaker = self.breakers.get(name) if name is not None else None
        cooling = breaker.cooling(time.monotonic(), time.time()) if breaker is not None else None
        return f"{name} {cooling} after: {breaker.last_error}" if cooling is not None else None

    def _name_of(self, job: Job, role: str) -> str | None:
        return self.device if role == "device" else job.cloud

    def _takes_ids(self, name: str) -> bool:
        """Whether a backend takes prompts as token ids of the device's vocabulary."""
        return self.backends[name].accepts_token_ids

    def _continuation(self, job: Job, prefix: Prefix, target: str) -> tuple[GenerationRequest, str]:
        """What `target` continues the answer from, and the whitespace held out of it at the seam. The text goes
        after the prompt, which ends with the client's prefill less its trailing whitespace (held by the job)."""
        text = job.prefill_held + prefix.text
        held = ""
        if (prefix.ids is None or not self._takes_ids(target)) and self._moves_whitespace(job, target):
            text, held = split_trailing_whitespace(text)
        gen = replace(
            job.gen, prefix_text=text, prefix_ids=prefix.ids, max_tokens=max(1, job.gen.max_tokens - prefix.tokens)
        )
        return gen, held

    def _moves_whitespace(self, job: Job, target: str) -> bool:
        """Whether a text continuation on `target` moves trailing whitespace out of its prefix (app/serving/seam.py):
        always in a chat dialect, and whenever the text crosses from one vocabulary to another."""
        backend = self.backends[target]
        if backend.dialect.continuation.moves_whitespace or not backend.device_vocabulary:
            return True
        return any(not self.backends[a.name].device_vocabulary for a in job.attempts if a.first_at is not None)

    def _open(
        self,
        job: Job,
        name: str,
        gen: GenerationRequest,
        context: int,
        migration: bool,
        from_token: int = 0,
        held: str = "",
    ) -> Attempt:
        attempt = Attempt(self.role_of(name), name, time.monotonic(), context, migration, from_token)
        backend = self.backends[name]
        attempt.ignored = backend.dialect.ignored(gen.extras, name)
        room = max(1, backend.context_window - context)  # what its window leaves the answer (`_serves` saw room)
        if gen.max_tokens > room:
            gen = replace(gen, max_tokens=room)
        if gen.request_id != job.id:  # what the backend's own events name (a choice of n, an outline's point: its own)
            gen = replace(gen, request_id=job.id)
        if attempt.role == "device" and job.declared.quality_migration:
            gen = replace(gen, confidence=True)  # the quality policy reads the device's confidence in each token
        if not self._takes_ids(name):  # device-vocabulary ids mean nothing there: it gets the text
            gen = replace(gen, prompt_ids=None, prefix_ids=None)
            if gen.tool_grammar is not None and "<[" in gen.tool_grammar:
                gen = replace(gen, tool_grammar=None)  # its `<[id]>` tokens are the device vocabulary's
        stream = backend.stream(gen)
        if gen.prefill or gen.prefix_text or gen.prefix_ids:
            continuation = backend.dialect.continuation
            by_ids = gen.prefix_ids is not None and not continuation.evaluates_tokens
            attempt.dialect = "token-ids" if by_ids else continuation.name
            if gen.prefix_ids is None:  # a text continuation: the seam is where its text joins the answer's
                held = held if migration else job.prefill_held
                head = gen.prefill + gen.prefix_text
                echo = head if continuation.echoes_prefill else ""
                attempt.seam = Seam(held, len(head), attempt.dialect, echo)
                if attempt.seam.active:
                    stream = through_seam(stream, attempt.seam)
        attempt.stream = stream
        job.attempts.append(attempt)
        self._publish_attempt("endpoint.started", job, attempt, context_tokens=context, from_token=attempt.from_token)
        return attempt

    def _publish_attempt(self, kind: str, job: Job, attempt: Attempt, **fields) -> None:
        backend = self.backends[attempt.name]
        self.events.publish(
            kind,
            request_id=job.id,
            endpoint=attempt.role,
            backend=attempt.name,
            model=backend.model_id,
            locality=backend.locality,
            migration=attempt.migration,
            **fields,
        )

    async def _close(self, attempt: Attempt, outcome: str | None = None, job: Job | None = None) -> None:
        if outcome is not None and attempt.outcome == "running":
            attempt.outcome = outcome
            if job is not None:
                self._publish_attempt(f"endpoint.{outcome}", job, attempt, decode_tokens=attempt.decode_tokens)
        if attempt.ended_at is None:
            attempt.ended_at = time.monotonic()
        if attempt.stream is not None:
            with anyio.CancelScope(shield=True):
                if attempt.ended:
                    attempt.ended = False
                    with anyio.move_on_after(0.2), contextlib.suppress(BackendError):
                        async for _ in attempt.stream:
                            pass
                await attempt.stream.aclose()

    def _failed(self, job: Job, attempt: Attempt, exc: BaseException) -> None:
        attempt.outcome = "failed"
        attempt.error = str(exc)
        attempt.ended_at = time.monotonic()
        status = exc.status if isinstance(exc, BackendError) else 500
        self.metrics.errors.labels(backend=attempt.name, kind=f"http_{status}").inc()
        self._publish_attempt(
            "endpoint.failed", job, attempt, error=attempt.error, status=status, decode_tokens=attempt.decode_tokens
        )

    def _won(self, job: Job, attempt: Attempt, event: TokenEvent) -> None:
        attempt.first_at = event.t
        attempt.outcome = "won"
        # A device that had the prompt's start in its KV cache (a repeated system prompt, the same
        # conversation again) computed only the rest: that is what costs energy and what T_d(l) must see.
        # (At most its context as counted here: a prefix delivered as another endpoint's text pieces may be more
        # tokens of the device's own.)
        attempt.cached_tokens = min(event.cached_tokens or 0, attempt.context_tokens)
        self._clamp(job, attempt.name)
        # A cloud says what its prompt cache held only with its usage, at the end: its start is timed against what
        # the plan expected it to hold.
        held = attempt.cached_tokens
        if attempt.role == "cloud" and not attempt.migration and job.plan is not None and job.plan.outlook is not None:
            held = min(round(job.plan.outlook.cloud_cached), attempt.context_tokens)
        self.disco.observe_first_token(
            attempt.role,
            job.cloud,
            attempt.context_tokens - held,
            event.t - attempt.started,
            attempt.migration,
            held,
        )
        self._publish_attempt(
            "endpoint.won",
            job,
            attempt,
            ttft_ms=ms(event.t - attempt.started),
            prefill_tokens=attempt.context_tokens - attempt.cached_tokens,
            cached_tokens=attempt.cached_tokens,
        )

    def _clamp(self, job: Job, name: str) -> None:
        """The answer is written on `name` from now on: its max_tokens cut to what `name`'s window leaves after the
        prompt, said in the trace and a response header (`x-tandem-max-tokens-clamped`), never refused. Answers that
        move onto a smaller window are cut again there (the relay's limit follows: `_migrate`)."""
        room = self.backends[name].context_window - job.prompt_tokens
        if room >= job.gen.max_tokens:
            return
        asked = job.max_tokens_clamped["asked"] if job.max_tokens_clamped else job.gen.max_tokens
        job.gen = replace(job.gen, max_tokens=room)
        if job.limit_asked:  # a limit the client never named is the gateway's to cut, unsaid
            job.max_tokens_clamped = {"asked": asked, "given": room, "endpoint": name}

    # -- start: plan and race ----------------------------------------------------------------------
    def _plan(self, job: Job) -> DispatchPlan:
        if job.pinned is not None:
            role = self.role_of(job.pinned)
            return DispatchPlan(role == "cloud", role == "device", None, "pinned", f"model names {job.pinned}")
        if self._looping(job):
            return DispatchPlan(True, False, None, job.declared.name, "an agent loop: a tool call answered twice")
        # DiSCo's plans count what each endpoint holds: the device's cached prefix (its cache index, exact), the
        # cloud's for the conversation (its usage reports). The baselines' plans do not depend on it: not probed.
        device_cached = self._cached_prefix(self.device, job, []) if job.declared.by_disco else 0
        conversation = conversation_key(job.gen)
        plan = self.disco.plan(
            job.policy, job.prompt_tokens, job.cloud, device_cached=device_cached, conversation=conversation
        )
        # DiSCo starts nothing on a cloud that cools: the device answers. A baseline keeps its plan (an operator who
        # chose server-only chose where answers go; its client still retries and fails fast).
        cooling = self._cooling(job.cloud) if plan.start_cloud and job.declared.by_disco else None
        plan = plan if cooling is None else DispatchPlan(False, True, None, plan.policy, cooling)
        return self._within_windows(job, plan)

    def _within_windows(self, job: Job, plan: DispatchPlan) -> DispatchPlan:
        """The plan without the endpoint of the pair whose window cannot hold the prompt: the other starts alone (the
        core refused a prompt that neither holds, and a policy's one endpoint that cannot)."""
        cloud = job.cloud is not None and self._holds(job, job.cloud)
        holds = {"device": self._holds(job, self.device), "cloud": cloud}
        starts = {"device": plan.start_device, "cloud": plan.start_cloud}
        for role, other in (("device", "cloud"), ("cloud", "device")):
            if starts[role] and not holds[role] and holds[other]:
                name = self._name_of(job, role)
                why = (
                    f"the prompt's {job.prompt_tokens} tokens leave no room in {name}'s "
                    f"{self.backends[name].context_window}-token window"
                )
                return DispatchPlan(other == "cloud", other == "device", None, plan.policy, why)
        return plan

    async def _start(self, job: Job) -> tuple[Attempt, TokenEvent]:
        plan = job.plan = self._plan(job)
        self.metrics.decisions.labels(policy=plan.policy, plan=plan_kind(plan)).inc()
        self.events.publish(
            "request.planned",
            request_id=job.id,
            policy=job.policy,
            plan=plan_kind(plan),
            plan_policy=plan.policy,
            reason=plan.reason,
            device_delay_ms=ms(plan.device_delay),
            prompt_tokens=job.prompt_tokens,
            max_tokens=job.gen.max_tokens,
            privacy=job.privacy,
            cloud=job.cloud,
            pinned=job.pinned,
            **(plan.outlook.describe() if plan.outlook is not None else {}),
        )
        keeps = [
            n
            for n in (self.device, job.cloud)
            if n is not None and self._keeps_calls_whole(job, n) and not self._cooling(n)
        ]
        if job.pinned is not None:
            names = [job.pinned]
        elif len(keeps) == 1 and self._serves(job, keeps[0]) and job.declared.by_disco and not self._looping(job):
            # tool_choice auto with one endpoint of the pair where a started call comes out whole: DiSCo starts the
            # answer there, whatever its plan said (the other is the fallback). The baselines (server-only,
            # device-only, Stoch) keep their plans: an operator who chose one chose where answers go.
            other = job.cloud if keeps[0] == self.device else self.device
            names = [keeps[0], *([other] if self.fallback and other is not None else [])]
        elif plan.start_cloud and plan.start_device and self._serves(job, job.cloud) and self._serves(job, self.device):
            return await self._race(job, plan.device_delay or 0.0)
        else:
            names = [job.cloud if plan.start_cloud else self.device]
            other = self.device if plan.start_cloud else job.cloud
            if (self.fallback and other is not None) or not self._serves(job, names[0]):
                names.append(other)
        names = [n for n in names if self._serves(job, n)]
        pair = [job.pinned] if job.pinned is not None else [self.device, job.cloud]
        allowed = [n for n in pair if n is not None and allows(job.privacy, self.backends[n].locality)]
        if not names and allowed and not any(self._holds(job, n) for n in allowed):
            # Kept on the device after the core routed it (an API key at its dollar cap, a lost shared store).
            window = max(self.backends[n].context_window for n in allowed)
            raise BackendError(
                f"This prompt is {job.prompt_tokens} tokens, more than the context window of {window} tokens of the "
                f"endpoints it may use now ({', '.join(allowed)})",
                400,
            )
        if not names:
            raise BackendError(
                f"{job.pinned or 'no endpoint of this request'} cannot serve it: its tool_choice or response_format "
                "needs an endpoint that enforces it (the device model, HAT, a chat upstream), and a continued final "
                f"assistant message one that can continue answers, within its privacy level '{job.privacy}'",
                400,
            )
        last: BaseException | None = None
        for name in names:
            attempt = self._open(job, name, job.gen, job.prompt_tokens, False)
            try:
                event = await anext(attempt.stream)
            except Exception as exc:
                exc = _backend_error(name, exc)
                self._failed(job, attempt, exc)
                await self._close(attempt)
                log.warning("request %s: %s failed before its first token: %s", job.id, name, exc)
                last = exc
                if exc.status == 400:  # the request itself is wrong; another endpoint will not help
                    raise
                continue
            self._won(job, attempt, event)
            return attempt, event
        raise _Failed(str(last)) from last

    async def _race(self, job: Job, delay: float) -> tuple[Attempt, TokenEvent]:
        """Cloud now; device now (delay 0) or after `delay` unless the cloud's first token came."""
        pending: dict[asyncio.Future, Attempt] = {}

        def launch(name: str) -> None:
            attempt = self._open(job, name, job.gen, job.prompt_tokens, False)
            pending[asyncio.ensure_future(anext(attempt.stream))] = attempt

        launch(job.cloud)
        device_started = False
        if delay <= 0:
            launch(self.device)
            device_started = True
        errors: list[BaseException] = []
        try:
            while pending or not device_started:
                timeout = None
                if not device_started:
                    timeout = max(0.0, job.started + delay - time.monotonic())
                done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done or (not device_started and not pending):
                    launch(self.device)  # w(l) passed without a cloud token, or the cloud failed
                    device_started = True
                    continue
                for fut in done:
                    attempt = pending.pop(fut)
                    exc = fut.exception()
                    if exc is None:
                        event = fut.result()
                        self._won(job, attempt, event)
                        self.metrics.races.labels(winner=attempt.role).inc()
                        return attempt, event
                    exc = _backend_error(attempt.name, exc)
                    self._failed(job, attempt, exc)
                    await self._close(attempt)
                    errors.append(exc)
                    if isinstance(exc, BackendError) and exc.status == 400:
                        raise exc
                if not pending and not device_started:
                    launch(self.device)
                    device_started = True
            raise _Failed("; ".join(str(e) for e in errors)) from (errors[-1] if errors else None)
        finally:
            for fut, attempt in pending.items():  # the loser: cancel at once, book its prefill
                fut.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(fut, return_exceptions=True)
                await self._close(attempt, "lost", job)

    # -- relay -------------------------------------------------------------------------------------
    async def generate(self, job: Job) -> AsyncIterator[Delta]:
        """Yields deltas of the answer; the first arrives with the first token, so a failure
        before it surfaces as an exception from the first `anext` (a real HTTP error)."""
        self.metrics.in_flight.inc()
        self.disco.observe_request(job.prompt_tokens)
        attempt: Attempt | None = None
        relay: Relay | None = None
        stall = Deadline(None)
        monitor = self._confidence_monitor(job)
        # An answer the client gets whole (not streamed) has no seam to keep: the device's deltas wait here while a
        # quality escalation may still come, and one starts the answer over on the cloud, dropping them (the cloud's
        # own answer, not its continuation of the device's half-written one: BENCHMARKS.md, "Answer quality").
        held: list[Delta] | None = [] if monitor is not None and not job.streamed else None
        try:
            attempt, event = await self._first_token(job)
            stall = Deadline(self.stall_of(attempt.name))
            relay = Relay(job.gen, time.monotonic(), self.disco.settings.consumption_rate)
            job.ttft = relay.t_first - job.started
            self.metrics.ttft.labels(backend=attempt.name).observe(job.ttft)
            while True:
                loop_target = self._loop_target(job, attempt, relay, event)
                if loop_target is not None:
                    attempt, event = await self._leave_loop(job, attempt, loop_target, relay)
                    stall.close()
                    stall = Deadline(self.stall_of(attempt.name))
                    continue
                delta = relay.feed(event, time.monotonic())
                attempt.decode_tokens = relay.produced - attempt.from_token
                attempt.reasoning_tokens += bool(event.reasoning)
                if event.usage is not None:
                    attempt.usage = event.usage
                if delta.finish_reason is not None:
                    self._finished(job, attempt, relay, delta.finish_reason, event.usage)
                    for earlier in held or ():
                        yield earlier
                    yield delta
                    return
                self.accounting.progress(job, time.monotonic())  # booked as it goes, every settle interval
                if held is not None and attempt.role == "device" and not job.migrations:
                    held.append(delta)
                else:
                    for earlier in held or ():  # the answer left the device otherwise: what it wrote stands
                        yield earlier
                    held = None
                    yield delta
                # Cost-driven (Eqs. 4-6) or quality migration: only at a clean text boundary, once per answer. The
                # source keeps its stream until the target's first token: if the target fails, the answer goes on here.
                # A forced migration (`tandem.migrate_after_tokens`) takes their place for its request.
                unsure = (
                    monitor is not None
                    and attempt.role == "device"
                    and event.confidence is not None
                    and monitor.add(event.confidence)
                )
                if relay.holding_call:
                    move = None
                elif job.migrate_after_tokens is not None:
                    forced = self._forced_target(job, attempt, event, relay)
                    move = (forced, "forced") if forced else None
                else:
                    move = self._migration_target(job, attempt, event, relay, unsure)
                restart = held is not None and move is not None and move[1] == "quality"
                moved = await self._migrate(job, attempt, *move, relay, restart=restart) if move else None
                if moved is not None:
                    attempt, event = moved
                    if restart:  # a new answer: its own relay, its consumption clock from its first token
                        held = None
                        relay = Relay(job.gen, time.monotonic(), self.disco.settings.consumption_rate)
                    stall.close()
                    stall = Deadline(self.stall_of(attempt.name))
                    continue
                try:
                    with stall:  # not asyncio.timeout: no timer pushed and cancelled per token (clients/deadline.py)
                        following = await anext(attempt.stream)
                except Exception as exc:
                    attempt, event = await self._recover(job, attempt, exc, relay)
                    stall.close()
                    stall = Deadline(self.stall_of(attempt.name))
                    continue
                self.metrics.inter_token_of(attempt.name).observe(following.t - event.t)
                self.token_seconds[attempt.name].update(following.t - event.t)
                event = following
        except Exception as exc:
            job.error = str(exc)
            if attempt is not None and attempt.outcome in ("running", "won"):
                self._failed(job, attempt, exc)  # the trace must not show a crashed answer's endpoint as the winner
            if not isinstance(exc, BackendError):
                log.exception("request %s failed", job.id)
                raise BackendError(f"internal error: {type(exc).__name__}: {exc}", 500) from exc
            raise
        finally:
            stall.close()
            self.metrics.in_flight.dec()
            for a in job.attempts:
                await self._close(a, "cancelled", job)
            if job.finish_reason is None:  # failed or abandoned: book what was spent
                if relay is not None:
                    job.delayed_tokens = relay.delayed
                self.accounting.book(job, sum(a.decode_tokens for a in job.attempts), None, finished=False)
            self.remember(job)

    async def _first_token(self, job: Job) -> tuple[Attempt, TokenEvent]:
        """The plan's start (a race, or one endpoint with its fallback) up to the answer's first token."""
        try:
            attempt, event = await self._start(job)
        except _Failed as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, BackendError) else None
            status = cause.status if cause else 503
            many = len(job.attempts) > 1
            message = f"every endpoint failed; last error: {exc}" if many else str(exc)
            raise BackendError(message, status, cause.backend if cause else None) from exc
        job.backend = attempt.name
        return attempt, event

    def _finished(self, job: Job, attempt: Attempt, relay: Relay, finish: str, upstream: Usage | None) -> None:
        job.finish_reason = finish
        job.stop_sequence = relay.stop_sequence
        attempt.outcome = "finished"
        attempt.ended_at = time.monotonic()
        attempt.ended = not relay.stopped
        self._publish_attempt("endpoint.finished", job, attempt, decode_tokens=attempt.decode_tokens)
        job.delayed_tokens = relay.delayed
        self.accounting.book(job, relay.produced, upstream)
        # The trace exists before the client sees the end of the answer (it may ask for it at once).
        self.remember(job, final=False)

    def _migration_target(
        self, job: Job, attempt: Attempt, event: TokenEvent, relay: Relay, unsure: bool
    ) -> tuple[str, str] | None:
        """(target, reason) when the answer should move now: "quality" when the device is `unsure` under the quality
        policy (at once: the answer is better for every token the cloud writes), "cost" when Eqs. 4-6 say it pays
        under a policy that migrates for cost."""
        produced = relay.produced
        if (
            job.pinned is not None
            or job.migrations
            or not self.disco.settings.migration
            or job.cloud is None
            or not event.text
            or produced >= job.gen.max_tokens
        ):
            return None
        target_role = "cloud" if attempt.role == "device" else "device"
        target = self._name_of(job, target_role)
        if not self._can_continue(target) or not self._serves(job, target, continuing=True) or self._cooling(target):
            return None
        if not self._keeps_calls_whole(job, target, continuing=True) and self._keeps_calls_whole(job, attempt.name):
            return None  # saving money is no reason to lose the guarantee that a call comes out whole
        if unsure and target_role == "cloud":
            return target, "quality"
        if not job.declared.cost_migration:
            return None  # the baselines move an answer only on a fault
        decision = self.disco.check_migration(
            attempt.role,
            target_role,
            job.cloud,
            job.prompt_tokens,
            produced,
            job.gen.max_tokens,
            relay.lead(time.monotonic()),
            self._cached_prefix(target, job, relay.ids),
            conversation_key(job.gen),
        )
        return (target, "cost") if decision.start_now else None

    def _confidence_monitor(self, job: Job) -> ConfidenceMonitor | None:
        """The answer's confidence monitor under the quality policy (τ: the request's, else the gateway's; 0: none)."""
        if not job.declared.quality_migration:
            return None
        threshold = (
            job.quality_threshold if job.quality_threshold is not None else self.disco.settings.quality_threshold
        )
        return ConfidenceMonitor(threshold) if threshold > 0 else None

    def _loop_target(self, job: Job, attempt: Attempt, relay: Relay, event: TokenEvent) -> str | None:
        """The cloud, when `event` completes a device tool call that the conversation already holds answered (an agent
        loop) under a policy that escapes loops and the answer may go on there; else None. A fault, not a choice: the
        budget's `migration` switch (DiSCo's moves for cost) does not hold it back."""
        if not (job.declared.escapes_loops and job.answered_calls and attempt.role == "device"):
            return None
        if job.pinned is not None or job.migrations or job.cloud is None:
            return None
        call = relay.call_completed_by(event)
        if call is None or not repeats(call_key(call.name, call.arguments), job.answered_calls):
            return None
        # A target that cannot enforce the call grammar still passes: a call it writes is held until whole and parsed
        # (app/serving/tool_calls.py), while the device, left here, only repeats itself until the turn limit.
        target = job.cloud
        return target if self._can_continue(target) and self._serves(job, target, continuing=True) else None

    async def _leave_loop(self, job: Job, source: Attempt, target: str, relay: Relay) -> tuple[Attempt, TokenEvent]:
        """The device wrote again a call the conversation holds answered: the call, never delivered, is dropped and
        the answer goes on on `target` from the last delivered token. The device's stream is already past the call,
        so it stops first; should `target` fail, the device writes the answer on from there (the call included)."""
        relay.rewind_uncommitted_call()
        await self._close(source)
        for name in (target, self.device):
            moved = await self._migrate(job, source, name, "loop", relay)
            if moved is not None:
                return moved
        raise BackendError(f"the answer could not go on after a repeated tool call: {job.migrations[-1]['error']}", 502)

    def _looping(self, job: Job) -> bool:
        """Whether DiSCo's policies start this request on the cloud: its conversation already holds one tool call
        answered twice (an agent loop that the endpoint which wrote it has not left). A baseline keeps its plan."""
        declared = job.declared
        return (
            declared.escapes_loops and declared.by_disco and loops(job.answered_calls) and self._serves(job, job.cloud)
        )

    def _cached_prefix(self, name: str | None, job: Job, ids: list[int] | None) -> int:
        """Context tokens endpoint `name` would take from its own KV cache (the device's prompt cache included) for the
        prompt followed by `ids` (the delivered answer): the plan's device length, and for a migration target (e.g.
        the device that lost the first-token race has the prompt cached) what Eq. 5's overhead and the buffer's t_m
        leave out. A migration target's probe is kept until the endpoint has run something since."""
        if name is None or ids is None or job.gen.prompt_ids is None or not self._takes_ids(name):
            return 0
        backend = self.backends[name]
        if not ids:
            return backend.cached_prefix(job.gen.prompt_ids)
        if job.cache_probe is not None and job.cache_probe[0] == backend.evaluations:
            return job.cache_probe[1]
        cached = backend.cached_prefix([*job.gen.prompt_ids, *ids])
        job.cache_probe = (backend.evaluations, cached)
        return cached

    def _can_continue(self, name: str) -> bool:
        """Whether a backend can continue an answer from a delivered prefix (a chat-only upstream cannot)."""
        return self.backends[name].can_continue

    def _forced_target(self, job: Job, attempt: Attempt, event: TokenEvent, relay: Relay) -> str | None:
        """Where a forced migration goes: once, at the first clean text boundary after `migrate_after_tokens` answer
        tokens, to the other endpoint of the request's device-cloud pair (the core refused the request where there
        is none that could continue it)."""
        produced = relay.produced
        if job.migrations or not event.text or produced < job.migrate_after_tokens or produced >= job.gen.max_tokens:
            return None
        target = self._name_of(job, "cloud" if attempt.role == "device" else "device")
        return target if self._serves(job, target, continuing=True) else None

    def _fault_targets(self, job: Job, source: Attempt) -> list[str]:
        """Where an answer may go on after `source` failed mid-answer: the other endpoint of the request's DiSCo
        pair first, then every other configured endpoint; never one that cannot continue from a prefix or that
        already failed in this request (so a chain of faults ends)."""
        if job.pinned is not None or job.cloud is None:
            return []
        failed = {a.name for a in job.attempts if a.outcome == "failed"}
        pair = job.cloud if source.role == "device" else self.device
        order = [pair, *(n for n in self.backends if n != pair)]
        order.sort(key=lambda n: self._cooling(n) is not None)  # a cooling cloud only when nothing else can
        return [
            n
            for n in order
            if n != source.name and n not in failed and self._can_continue(n) and self._serves(job, n, continuing=True)
        ]

    async def _recover(self, job: Job, source: Attempt, exc: BaseException, relay: Relay) -> tuple[Attempt, TokenEvent]:
        """The serving endpoint failed or stalled mid-answer: continue on the next endpoint that can, from
        exactly the delivered prefix, or raise when none can."""
        if relay.rewind_uncommitted_call() and job.gen.grammar is None:
            # The call is written again from its start: under the tool-call grammar, so it comes out whole.
            job.gen = replace(job.gen, grammar=job.call_grammar, gbnf=job.call_gbnf, grammar_covers_prefix=False)
        reason = "stall" if isinstance(exc, TimeoutError) else "error"
        if isinstance(exc, TimeoutError):
            silence = self.stall_of(source.name)
            exc = BackendError(f"{source.name} sent nothing for {silence:g} s (stalled)", 504, source.name)
        exc = _backend_error(source.name, exc, "ended its stream without finishing")
        self._failed(job, source, exc)
        await self._close(source)
        errors = [f"{source.name}: {exc}"]
        for target in self._fault_targets(job, source):
            moved = await self._migrate(job, source, target, reason, relay)
            if moved is not None:
                return moved
            errors.append(f"{target}: {job.migrations[-1]['error']}")
        if len(errors) == 1:
            raise exc
        raise BackendError(
            f"the answer failed mid-way and no endpoint could continue it ({'; '.join(errors)})", exc.status, None
        )

    async def _migrate(
        self, job: Job, source: Attempt, target: str, reason: str, relay: Relay, restart: bool = False
    ) -> tuple[Attempt, TokenEvent] | None:
        """Start `target` from exactly the delivered prefix (`restart`: from the start, the client having seen none
        of the answer); once its first token is here, stop the source. If the target fails or stays silent first, it
        is closed, the trace says why, and None is returned: a healthy source (a cost migration) still holds its
        stream, unread, and the answer goes on there."""
        prefix = relay.prefix()
        produced = prefix.tokens
        if restart:
            attempt = self._open(job, target, job.gen, job.prompt_tokens, False)
        else:
            gen, held = self._continuation(job, prefix, target)
            attempt = self._open(job, target, gen, job.prompt_tokens + produced, True, produced, held)
        log.info(
            "request %s: %s %s -> %s at token %d (%s)",
            job.id,
            "restarting" if restart else "migrating",
            source.name,
            target,
            produced,
            reason,
        )
        record = {
            "at_token": produced,
            "from": source.name,
            "to": target,
            "reason": reason,
            "restart": restart,  # the target wrote the answer from its start; the source's tokens were dropped
            "at_ms": ms(attempt.started - job.started),
            # How far the client's reader was behind what it had been sent (the buffer a migration hides behind).
            "lead_tokens": round(relay.lead(attempt.started), 2),
            "prefix_ids": not restart and prefix.ids is not None and self._takes_ids(target),
            "dialect": attempt.dialect,
        }
        job.migrations.append(record)
        self.events.publish("migration.started", request_id=job.id, **record)
        # A target that stays silent: after a fault the device may need long for a long context; a cost move
        # was predicted to fit the client's buffer, so waiting longer than a stall only starves the reader.
        patience = self.stall_of(target) if reason == "cost" else self.stall_of(target) + 60
        try:
            event = await asyncio.wait_for(anext(attempt.stream), patience)
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                exc = BackendError(f"migration target {target} sent nothing for {patience:g} s", 504, target)
            exc = _backend_error(target, exc)
            self._failed(job, attempt, exc)
            await self._close(attempt)
            record["error"] = str(exc)
            self.events.publish("migration.failed", request_id=job.id, **record)
            self.metrics.failed_migrations.labels(source=source.role, target=attempt.role, reason=reason).inc()
            log.warning("request %s: migration %s -> %s failed: %s", job.id, source.name, target, exc)
            return None
        if source.outcome in ("running", "won"):
            source.outcome = "migrated-from"
            source.ended_at = time.monotonic()
            self._publish_attempt("endpoint.migrated-from", job, source, decode_tokens=source.decode_tokens)
        await self._close(source)
        self.metrics.migrations.labels(source=source.role, target=attempt.role, reason=reason).inc()
        self._won(job, attempt, event)
        relay.limit_to(job.gen.max_tokens)  # the target's window may leave the answer less than the source's did
        record["t_m_ms"] = ms(event.t - attempt.started)
        job.backend = target
        self.events.publish("migration.completed", request_id=job.id, **record)
        return attempt, event

    # -- traces ------------------------------------------------------------------------------------
    def remember(self, job: Job, final: bool = True) -> None:
        """Keep the job's trace (and write its line to the trace file when it finished)."""
        trace = self.traces[job.id] = trace_of(job)
        if self.keep_trace is not None:
            self.keep_trace(job.id, trace)
        while len(self.traces) > self.history:
            self.traces.popitem(last=False)
        if final:
            kind = "request.finished" if job.finish_reason is not None else "request.failed"
            self.events.publish(kind, request_id=job.id, trace=trace)
        if final and self._trace_out is not None and job.finish_reason is not None:
            self._trace_out.write(json.dumps(replay_row(job)) + "\n")

    def close(self) -> None:
        if self._trace_out is not None:
            self._trace_out.close()


def _delivered(job: Job) -> int:
    """The answer's tokens delivered so far (or held back by the relay): where the endpoints that wrote it reached."""
    return max((a.from_token + a.decode_tokens for a in job.attempts if a.first_at is not None), default=0)


def _backend_error(name: str, exc: BaseException, ended: str = "produced nothing") -> BackendError:
    """Whatever a backend's stream raised, as a BackendError (a bug in a backend is a fault like any other:
    it fails over or migrates, and the client gets an answer or an error in the OpenAI envelope)."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, StopAsyncIteration):
        return BackendError(f"{name} {ended}", 502, name)
    log.error("backend %s raised", name, exc_info=exc)
    return BackendError(f"{name} failed: {type(exc).__name__}: {exc}", 500, name)
