"""Outline-based parallel decoding (Jupiter §V-B) on top of the orchestrator.

The gate (policies/outline.py) lets a list-style question through; the endpoint DiSCo picks writes a short outline;
each point is then expanded by a sub-request of its own (the outline's conversation plus one turn asking for that
point, so its prompt's prefix is what the outline's endpoint already holds in its KV cache) through the same
orchestrator — so dispatch, fallback, migration, privacy, accounting and traces apply per point — pinned to the
endpoint predicted to finish it first, all at once. An endpoint that runs several points side by side counts that
many lanes (a HAT endpoint on a staged worker: its pipeline's P stages, so the points fill the pipeline as Jupiter
injects them), and one that takes only so many at once (a HAT worker's sessions; a device model, whose generations
queue on its thread anyway, one) gets the rest as earlier ones finish: none is refused for being one too many, and
none waits in a queue where the relay's stall check would time it. The answer streams in order: point 1 live, each
later point flushed when the ones before it are done. An outline that does not parse falls back to the normal
answer. Closing the stream cancels every sub-request. What is not shared: on a HAT endpoint each point is a session
of its own that prefills the question and outline again (the worker keeps no prefix across sessions).

Sub-requests' ids are the request's with `-outline` and `-p<i>`; the request's own trace lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from app.serving.job import Job
from app.serving.relay import Delta
from app.serving.requests import ChatInput
from clients.base import BackendError, Usage
from policies.outline import assign, parse_outline

_OUTLINE_PROMPT = (
    "Plan the answer to the user's request as an outline: a numbered list of 3 to 8 short points (at most eight "
    "words each) that a complete answer would cover, in a sensible order. Write only the list."
)
# A point's request continues the outline's conversation (system, question, the outline as written), so its prompt
# begins with exactly the tokens the endpoint that wrote the outline holds in its KV cache, and points on one endpoint
# share all of it: llama.cpp (device and stand-in cloud alike) reuses the longest cached prefix, and only this last
# turn is prefilled per point.
_POINT_PROMPT = (
    'Now write the part of the answer for point {number} only ("{point}"), in two to four sentences. Do not repeat '
    "its title and do not cover the other points."
)
_OUTLINE_TOKENS = 120


@dataclass
class OutlineRequest:
    """What outline decoding needs of a request whose gate said yes (set by ServingCore when it prepares it)."""

    request: ChatInput
    question: str


def _head(points: list[str], i: int) -> str:
    return ("\n\n" if i else "") + f"{i + 1}. **{points[i]}**\n"


def _message(role: str, text: str) -> dict:
    return {"role": role, "content": text}


class OutlineDecoding:
    def __init__(self, core) -> None:
        self.core = core  # app/serving/core.py's ServingCore: prepares the sub-requests
        self.orchestrator = core.orchestrator

    async def _sub_job(
        self, job: Job, suffix: str, messages: tuple[dict, ...], max_tokens: int, endpoint: str | None = None
    ) -> Job:
        """A sub-request routed like the request (`endpoint` None) or started on `endpoint` (with the request's
        fallback and migration rules still applying). It keeps the request's model, key, temperature, top_p, top_k,
        seed and fields beyond the core (extras: forwarded or applied on each point's endpoint); nothing else of it
        (the gate only lets plain requests through)."""
        request = job.outline.request
        route = {"policy": request.policy, "cloud": request.cloud}
        if endpoint is not None:
            route["policy"] = "device" if endpoint == self.orchestrator.device else "cloud"
            route["cloud"] = job.cloud if endpoint == self.orchestrator.device else endpoint
        sub = ChatInput(
            model=request.model,
            key_privacy=request.key_privacy,
            privacy=job.privacy,
            decoding="sequential",
            messages=messages,
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            extras=request.extras,
            **route,
        )
        part = await self.core.prepare(sub)
        part.id = f"{job.id}-{suffix}"
        return part

    async def generate(self, job: Job) -> AsyncIterator[Delta]:
        plan = job.outline
        asked = (_message("system", _OUTLINE_PROMPT), _message("user", plan.question))
        outline_job = await self._sub_job(job, "outline", asked, _OUTLINE_TOKENS)
        parts = [outline_job]
        job.decoding["outline_request"] = outline_job.id
        outline = await self._collect(outline_job)
        points = parse_outline(outline)
        if points is None:
            job.decoding.update(outline=False, reason="the outline did not parse: answered normally")
            async for delta in self.orchestrator.generate(job):
                yield delta
            return
        job.backend = outline_job.backend
        conversation = (*asked, _message("assistant", outline))  # the outline as written: its tokens are cached
        per_point = max(48, min(256, job.gen.max_tokens // len(points)))
        rates = self._rates(job)
        concurrency = {name: self.orchestrator.backends[name].concurrency() for name in rates}
        where = assign(len(points), per_point, rates, {}, {name: c.lanes for name, c in concurrency.items()})
        job.decoding["lanes"] = {name: c.lanes for name, c in concurrency.items()}
        slots = {name: asyncio.Semaphore(c.limit) for name, c in concurrency.items() if c.limit is not None}
        point_jobs = []
        for i, (point, endpoint) in enumerate(zip(points, where, strict=True)):
            turn = _message("user", _POINT_PROMPT.format(number=i + 1, point=point))
            point_jobs.append(await self._sub_job(job, f"p{i}", (*conversation, turn), per_point, endpoint))
        parts += point_jobs
        job.decoding["points"] = [
            {"id": p.id, "endpoint": e, "title": t} for p, e, t in zip(point_jobs, where, points, strict=True)
        ]
        finish = "stop"
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in point_jobs]
        pumps = [
            asyncio.ensure_future(self._pump(part, queue, slots.get(endpoint)))
            for part, queue, endpoint in zip(point_jobs, queues, where, strict=True)
        ]
        try:
            for i, queue in enumerate(queues):
                head = _head(points, i)
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item.finish_reason == "length":
                        finish = "length"
                    text = head + item.text
                    head = ""
                    if item.finish_reason is not None:
                        if i == len(queues) - 1:
                            self._account(job, parts, finish)
                            yield Delta(text, finish)
                            return
                        if text:
                            yield Delta(text)
                        break
                    if text:
                        yield Delta(text)
        finally:
            for pump in pumps:
                pump.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pumps, return_exceptions=True)
            if job.finish_reason is None:
                self._account(job, parts, None)

    async def _collect(self, part: Job) -> str:
        texts = []
        stream = self.orchestrator.generate(part)
        try:
            async for delta in stream:
                texts.append(delta.text)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        return "".join(texts)

    async def _pump(self, part: Job, queue: asyncio.Queue, slot: asyncio.Semaphore | None) -> None:
        """Read one point's stream to its end into `queue` (a llama.cpp device computes a token only once the last
        was read, so every point is read as it comes, whether or not it is its turn to be sent), once its endpoint
        has a slot free (`slot`: the points it takes at once; the waiters are woken in point order)."""
        async with slot or contextlib.nullcontext():
            stream = self.orchestrator.generate(part)
            try:
                async for delta in stream:
                    queue.put_nowait(delta)
            except Exception as exc:
                queue.put_nowait(exc if isinstance(exc, BackendError) else BackendError(str(exc), 500))
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await stream.aclose()

    def _rates(self, job: Job) -> dict[str, float]:
        """Tokens per second of the endpoints the points may run on — the request's DiSCo pair, as far as its
        privacy level allows (measured; 1 where nothing is known yet)."""
        if job.pinned is not None:
            names = [job.pinned]
        else:
            names = [n for n in (self.orchestrator.device, job.cloud) if self.orchestrator._serves(job, n)]
        rates = {}
        for name in names:
            seconds = self.orchestrator.token_seconds[name].get(0.0)
            rates[name] = 1.0 / seconds if seconds > 0 else 1.0
        return rates

    def _account(self, job: Job, parts: list[Job], finish: str | None) -> None:
        """The request's usage and cost are its sub-requests' sums; its trace lists them."""
        job.usage = Usage(sum(p.usage.prompt_tokens for p in parts), sum(p.usage.completion_tokens for p in parts))
        job.cost = sum(p.cost for p in parts)
        job.finish_reason = finish
        job.decoding["parts"] = [p.id for p in parts]
        job.decoding["endpoints"] = sorted({p.backend for p in parts if p.backend})
        if finish is None:
            job.error = job.error or "cancelled or failed"
        self.orchestrator.remember(job)
