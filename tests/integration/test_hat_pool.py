"""A HAT device half over a pool of two real workers (`worker_urls`, clients/hat/pool.py).

Real parts: two real worker apps on loopback (uvicorn, each in a thread, as in test_hat.py: SmolLM2-135M, the loaded
model shared, so nothing loads twice), one shut down mid-decode, its sessions' connections closed under them; the
device half in this process. Sessions spread by the placement rule; a worker
killed mid-answer costs nothing: the session moves to the other worker, which prefills the delivered context
again, and the greedy answer equals plain U-shape greedy decoding token for token (up to test_hat.py's
documented near-tie rule); with both workers dead the stream fails after what it delivered, repeating nothing,
and through a real `tandem serve` (whose HAT endpoint has the two workers as its pool) the gateway's fault migration
finishes the answer on the device from the delivered token ids; a draining worker hands over what it cannot finish
in its time, or finishes its session while refusing new ones and leaving the registry; workers announced in a real
store (app/worker/registry.py) join a pool that names the registry, and leave it within their TTL once they stop
heartbeating. The tests run in order: each kills what the next finds dead, and one that needs both workers up
starts the dead ones again on their ports (`revived`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from app.worker.registry import TTL_BEATS
from clients.base import BackendError, GenerationRequest, TokenEvent
from clients.hat import wire
from clients.hat.device import HATBackend
from clients.hat.options import HATOptions
from tests.integration.disco_helpers import independent_continuation, stream_chunks, trace
from tests.integration.hf_fixtures import SMOL, check_against_reference, load
from tests.integration.test_hat import TOKEN, WorkerServer, prompt_ids, u_shape_greedy

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


def revived(smol, workers: list[WorkerServer]) -> list[WorkerServer]:
    """Every worker of the pool up: one an earlier test killed starts again on its port, as a supervisor restarts it
    (the loaded model is shared: a start is the split and the engine's self-check)."""
    for i, worker in enumerate(workers):
        if not worker.thread.is_alive():
            port = worker.settings.port
            workers[i] = WorkerServer(smol[0], SMOL, port=port, max_sessions=4, idle_timeout=60).start()
    return workers


@pytest.fixture(scope="module")
def pool_gateway(smol, workers) -> Iterator[GatewayProcess]:
    """A real `tandem serve` whose HAT endpoint (SmolLM2's device half) has the two workers as its pool, with the
    device model (SmolLM2 on llama.cpp, the same vocabulary: migrations go by token ids) to fall back on."""
    urls = ", ".join(f'"{w.ws}"' for w in revived(smol, workers))
    gw = start_gateway(
        f"""
[gateway]
policy = "cloud"
cloud = "hat"
state_file = ""
stall_timeout = 60
[device]
model = "{SMOL}"
reproducible = true   # the continuation is compared with the device's own greedy answer: one evaluation path
n_ctx = 2048
n_threads = 1  # the workers and this process share the cores: llama.cpp's threads would wait on each other
[disco]
profile_device = false
migration = false
[clouds.hat]
kind = "hat"
model = "{SMOL}"
worker_urls = [{urls}]
auth_token = "{TOKEN}"
chunk_size = 16
round_timeout = 10
""",
        wait_for=("device", "hat"),
    )
    yield gw
    stop_gateway(gw)


async def until(condition: Callable[[], bool], limit: float = 60.0) -> None:
    """Wait for an event the test cannot be told of: polled, with a limit only a hang reaches (a loaded machine may
    take seconds, never a minute)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the condition was not reached"
        await asyncio.sleep(0.02)


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
        assert KILL_AFTER <= len(delivered) < N
        check_against_reference(delivered, reference[0][: len(delivered)], reference[1])
    finally:
        await backend.close()


def dies_after_drafts(worker: WorkerServer, drafts: int) -> Callable[[bytes | None, bytes], None]:
    """A frame hook: the worker goes away (its server stopped, every connection closed) once it has received
    `drafts` DRAFT frames, i.e. mid-answer, wherever the pool placed the session."""
    seen: list[bytes] = []

    def hook(sid: bytes | None, data: bytes) -> None:
        if sid is not None and wire.peek_kind(data) == wire.Kind.DRAFT:
            seen.append(sid)
            if len(seen) == drafts:
                threading.Thread(target=worker.stop, daemon=True).start()

    return hook


def test_with_the_whole_pool_killed_mid_answer_the_gateway_finishes_on_the_device(smol, workers, pool_gateway):
    """Through the real gateway: the session's worker dies mid-answer, the session moves to the other worker, which
    dies too; the device half then fails after what it delivered and the gateway's fault migration carries the answer
    on on the device from the delivered token ids. The client sees one answer: nothing lost, nothing repeated."""
    revived(smol, workers)
    for worker in workers:
        worker.on_frame = dies_after_drafts(worker, 2)
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    rid, pieces, finish = stream_chunks(pool_gateway, messages, max_tokens=24)
    for worker in workers:
        worker.thread.join(15)
        assert not worker.thread.is_alive()
    t = trace(pool_gateway, rid)
    assert [(m["from"], m["to"], m["reason"]) for m in t["migrations"]] == [("hat", "device", "error")], t
    assert [e["backend"] for e in t["endpoints"]] == ["hat", "device"] and t["endpoints"][-1]["outcome"] == "finished"
    assert finish in ("stop", "length")
    k = t["migrations"][0]["at_token"]
    assert 0 < k < len(pieces)  # the answer moved mid-way, with what HAT had delivered
    prefix, rest = "".join(pieces[:k]), "".join(pieces[k:])
    # The device continued exactly from the delivered prefix: its own greedy continuation of prompt + prefix.
    assert independent_continuation(pool_gateway, "device", messages, prefix, len(pieces) - k, model=SMOL) == rest
    (hat,) = [e for e in httpx.get(pool_gateway.v1 + "/endpoints", timeout=10).json()["data"] if e["name"] == "hat"]
    assert [w["failures"] for w in hat["hat"]["workers"]] == [1, 1], hat  # both sessions' workers were lost


async def test_a_draining_worker_hands_over_what_it_has_not_finished_in_its_time(smol, workers, reference) -> None:
    """Told to drain with no time to finish, the worker hands its session over (an ERROR 503): the device moves it to
    the other worker with the context it delivered, and the greedy answer is the uninterrupted one."""
    revived(smol, workers)
    backend = await device_half(smol, workers)
    try:
        events: list[TokenEvent] = []
        async for event in backend.stream(request(smol)):
            events.append(event)
            if len(events) == KILL_AFTER:
                [index] = serving(backend)
                async with httpx.AsyncClient(timeout=10) as http:
                    r = await http.post(
                        workers[index].http + "/v1/drain",
                        json={"timeout": 0},
                        headers={"Authorization": f"Bearer {TOKEN}"},
                    )
                assert r.status_code == 202, r.text
        check_against_reference([e.token_id for e in events], *reference)
        assert backend.stats.failovers == 1
        worker_state = workers[index].app.state.worker
        await until(lambda: worker_state.drained is not None)  # set on the worker's loop once the hand-over is done
        assert worker_state.drained == {"finished": 0, "handed_over": 1}, worker_state.drained
    finally:
        await backend.close()


async def test_workers_join_the_pool_from_the_registry_a_draining_one_finishes_its_session_and_leaves(
    smol, store_server, reference
) -> None:
    """Workers announced in a real store are placed on. One told to drain mid-answer leaves the registry at once,
    refuses new sessions (a second session goes to the other worker, and an OPEN sent to it straight is refused),
    finishes the session it has, and says it is drained; one that stops heartbeating is gone within its TTL."""
    # The default beat: a TTL of 3 s, which a loaded machine's stalls do not reach while a worker lives (0.2 s beats
    # made its 0.6 s: a worker thread starved that long dropped out of the registry).
    beat = 1.0
    registry = {"registry_url": store_server.url, "registry_prefix": "hatpool:", "heartbeat_seconds": beat}
    announced = [WorkerServer(smol[0], SMOL, max_sessions=4, **registry).start() for _ in range(2)]
    options = HATOptions(
        worker_registry=store_server.url, worker_registry_prefix="hatpool:", auth_token=TOKEN, chunk_size=16
    )
    backend = HATBackend(options, model_id=SMOL, model=smol[0], tokenizer=smol[1])
    backend.pool.refresh_seconds = 0.0
    await backend.start()
    store = redis.Redis.from_url(store_server.url, decode_responses=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert backend.pool.workers == []  # nothing until the registry is read
        tokens = [e.token_id async for e in backend.stream(request(smol))]
        check_against_reference(tokens, *reference)
        assert sorted(w.url for w in backend.pool.workers) == sorted(w.ws for w in announced)
        assert all(w.info["max_sessions"] == 4 and len(w.info["g"]) == 2 for w in backend.pool.workers)

        events: list[TokenEvent] = []
        async for event in backend.stream(request(smol)):
            events.append(event)
            if len(events) == KILL_AFTER:
                [index] = serving(backend)  # the pool's order is the registry's, not `announced`'s
                [draining] = [w for w in announced if w.ws == backend.pool.workers[index].url]
                [other] = [w for w in announced if w is not draining]
                async with httpx.AsyncClient(timeout=10) as http:
                    anonymous = await http.post(draining.http + "/v1/drain", json={"timeout": 60})  # no token
                    assert anonymous.status_code == 401 and not draining.app.state.worker.draining
                    r = await http.post(draining.http + "/v1/drain", json={"timeout": 60}, headers=auth)
                    assert r.status_code == 202 and r.json()["draining"], r.text
                    assert (await http.get(draining.http + "/health/ready")).json()["status"] == "draining"
                    # Out of the registry by its goodbye, not by a lapse: its id leaves the members set, where a
                    # lapsed announcement's stays until a pool's read drops it (none reads the registry meanwhile).
                    goodbye = draining.app.state.worker.heartbeat
                    await until(lambda h=goodbye: not store.sismember(h.members, h.id))
                    assert not store.exists(goodbye.key)
                second = [e.token_id async for e in backend.stream(request(smol))]  # placed on the other worker
                check_against_reference(second, *reference)
                assert [w.url for w in backend.pool.workers] == [other.ws]
                alone = HATBackend(
                    HATOptions(worker_urls=(draining.ws,), auth_token=TOKEN, chunk_size=16),
                    model_id=SMOL,
                    model=smol[0],
                    tokenizer=smol[1],
                )
                await alone.start()
                try:
                    with pytest.raises(BackendError, match="draining") as refused:
                        [e async for e in alone.stream(request(smol))]
                    assert refused.value.status == 503
                finally:
                    await alone.close()
        check_against_reference([e.token_id for e in events], *reference)  # finished where it was
        assert backend.stats.failovers == 0
        async with httpx.AsyncClient(timeout=5) as http:
            await until(lambda: draining.app.state.worker.drained is not None)
            health = (await http.get(draining.http + "/health")).json()
        assert health["drained"] == {"finished": 1, "handed_over": 0} and health["sessions"] == 0

        # Hung: no goodbye. Its announcement lapses within three beats of the last (each beat renews its TTL), and
        # the pool's next read of the registry leaves it out.
        heartbeat = other.app.state.worker.heartbeat
        heartbeat.halt()
        ttl = store.pttl(heartbeat.key)
        assert ttl == -2 or 0 < ttl <= TTL_BEATS * beat * 1000, ttl  # -2: lapsed already
        await until(lambda: not store.exists(heartbeat.key))
        assert [w.url for w in backend.pool.workers] == [other.ws]  # listed until the pool reads the registry
        await backend.pool.refresh()
        assert backend.pool.workers == []
        with pytest.raises(BackendError, match="no HAT worker"):
            [e async for e in backend.stream(request(smol))]
    finally:
        store.close()
        await backend.close()
        for worker in announced:
            if worker.thread.is_alive():
                worker.stop()
