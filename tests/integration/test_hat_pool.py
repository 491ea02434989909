"""A HAT device half over a pool of two real workers (`worker_urls`, clients/hat/pool.py).

Real parts: two real worker apps on loopback (uvicorn, each in a thread, as in test_hat.py: SmolLM2-135M, the loaded
model shared, so nothing loads twice), one shut down mid-decode, its sessions' connections closed under them; the
device half in this process. Sessions spread by the placement rule; a worker
killed mid-answer costs nothing: the session moves to the other worker, which prefills the delivered context
again, and the greedy answer equals plain U-shape greedy decoding token for token (up to test_hat.py's
documented near-tie rule); with both workers dead the stream fails after what it delivered, repeating nothing,
for the gateway's fault migration to carry on; workers announced in a real store (app/worker/registry.py) join a
pool that names the registry, and leave it within their TTL once they stop heartbeating. The tests run in order:
each kills what the next finds dead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from clients.base import BackendError, GenerationRequest, TokenEvent
from clients.hat.device import HATBackend
from clients.hat.options import HATOptions
from tests.integration.hf_fixtures import SMOL, load
from tests.integration.test_hat import TOKEN, WorkerServer, check_against_reference, prompt_ids, u_shape_greedy

N = 16  # tokens per answer
KILL_AFTER = 6  # tokens delivered before the serving worker is killed


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    return load(SMOL)


@pytest.fixture(scope="module")
def reference(smol) -> tuple[list[int], list[float]]:
    return u_shape_greedy(smol[0], prompt_ids(smol[1]), N)


@pytest.fixture(scope="module")
def workers(smol) -> Iterator[list[WorkerServer]]:
    started: list[WorkerServer] = []
    try:
        for _ in range(2):
            started.append(WorkerServer(smol[0], SMOL, max_sessions=4, idle_timeout=60).start())
        yield started
    finally:
        for worker in started:
            if worker.thread.is_alive():
                worker.stop()


def kill(worker: WorkerServer) -> None:
    """The worker goes away mid-session: its server stops, every connection to it closed."""
    worker.stop()
    assert not worker.thread.is_alive()


async def device_half(smol, workers: list[WorkerServer]) -> HATBackend:
    options = HATOptions(worker_urls=tuple(w.ws for w in workers), auth_token=TOKEN, chunk_size=16, round_timeout=10)
    backend = HATBackend(options, model_id=SMOL, model=smol[0], tokenizer=smol[1])
    await backend.start()
    return backend


def request(smol) -> GenerationRequest:
    return GenerationRequest(prompt_text="", prompt_ids=tuple(prompt_ids(smol[1])), max_tokens=N, temperature=0.0)


def serving(backend: HATBackend) -> list[int]:
    return [i for i, w in enumerate(backend.pool.workers) if w.sessions]


async def test_sessions_spread_over_the_pool_by_predicted_delay(smol, workers, reference) -> None:
    backend = await device_half(smol, workers)
    try:
        streams = [backend.stream(request(smol)) for _ in range(2)]
        firsts = [await anext(s) for s in streams]  # both sessions open at once
        assert sorted(serving(backend)) == [0, 1]  # the second went where nobody was waiting
        for first, stream in zip(firsts, streams, strict=True):
            tokens = [first.token_id] + [e.token_id async for e in stream]
            check_against_reference(tokens, *reference)
        described = backend.pool.describe()
        assert all(w["failures"] == 0 and w["rtt_ms"] > 0 for w in described)
    finally:
        await backend.close()


async def test_a_worker_killed_mid_decode_moves_the_session_and_greedy_is_unchanged(smol, workers, reference) -> None:
    backend = await device_half(smol, workers)
    try:
        events: list[TokenEvent] = []
        async for event in backend.stream(request(smol)):
            events.append(event)
            if len(events) == KILL_AFTER:
                [index] = serving(backend)
                kill(workers[index])
                t_kill = time.monotonic()
            if len(events) == KILL_AFTER + 1:
                resumed = time.monotonic() - t_kill
        tokens = [e.token_id for e in events]
        check_against_reference(tokens, *reference)  # nothing lost, nothing repeated, the same greedy answer
        assert "".join(e.text for e in events) == smol[1].decode(tokens)
        assert backend.stats.failovers == 1 and backend.pool.workers[index].failures == 1
        print(f"resumed on the other worker {resumed * 1e3:.0f} ms after the kill ({KILL_AFTER} tokens delivered)")
    finally:
        await backend.close()


async def test_with_every_worker_dead_the_stream_fails_after_what_it_delivered(smol, workers, reference) -> None:
    alive = [w for w in workers if w.thread.is_alive()]
    assert len(alive) == 1  # the previous test killed the other
    backend = await device_half(smol, workers)
    delivered: list[int] = []
    try:
        with pytest.raises(BackendError) as caught:
            async for event in backend.stream(request(smol)):
                delivered.append(event.token_id)
                if len(delivered) == KILL_AFTER:
                    kill(alive[0])
        assert caught.value.status in (502, 503, 504)
        assert KILL_AFTER <= len(delivered) < N and delivered == reference[0][: len(delivered)]
    finally:
        await backend.close()


async def test_workers_join_the_pool_from_the_registry_and_leave_it_within_their_ttl(
    smol, store_server, reference
) -> None:
    """A worker announced in a real store is placed on; one that stops heartbeating is gone within its TTL."""
    beat = 0.2
    registry = {"registry_url": store_server.url, "registry_prefix": "hatpool:", "heartbeat_seconds": beat}
    announced = [WorkerServer(smol[0], SMOL, max_sessions=4, **registry).start() for _ in range(2)]
    options = HATOptions(
        worker_registry=store_server.url, worker_registry_prefix="hatpool:", auth_token=TOKEN, chunk_size=16
    )
    backend = HATBackend(options, model_id=SMOL, model=smol[0], tokenizer=smol[1])
    backend.pool.refresh_seconds = 0.0
    await backend.start()
    try:
        assert backend.pool.workers == []  # nothing until the registry is read
        tokens = [e.token_id async for e in backend.stream(request(smol))]
        check_against_reference(tokens, *reference)
        assert sorted(w.url for w in backend.pool.workers) == sorted(w.ws for w in announced)
        assert all(w.info["max_sessions"] == 4 and len(w.info["g"]) == 2 for w in backend.pool.workers)
        announced[0].app.state.worker.heartbeat.halt()  # hung: no goodbye
        halted = time.monotonic()
        while len(backend.pool.workers) == 2:
            assert time.monotonic() - halted < 3 * beat + 1.0, "still listed after its TTL"
            await backend.pool.refresh()
            await asyncio.sleep(0.05)
        assert [w.url for w in backend.pool.workers] == [announced[1].ws]
        announced[1].stop()  # a clean stop leaves at once
        await backend.pool.refresh()
        assert backend.pool.workers == []
        with pytest.raises(BackendError, match="no HAT worker"):
            [e async for e in backend.stream(request(smol))]
    finally:
        await backend.close()
        for worker in announced:
            if worker.thread.is_alive():
                worker.stop()
