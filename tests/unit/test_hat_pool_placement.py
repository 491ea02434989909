"""The HAT worker pool's placement and circuit breakers (clients/hat/pool.py), pure: the times are arguments."""

from __future__ import annotations

from clients.hat.pool import MAX_BACKOFF_SECONDS, WorkerPool

A, B, C = "ws://a:1", "ws://b:1", "ws://c:1"
INFO = {"mu": 4.0, "g": [0.001, 0.01], "sessions": 0, "max_sessions": 4}


def test_an_unopened_worker_is_tried_before_a_known_one():
    pool = WorkerPool([A, B])
    first = pool.place(now=0)
    pool.opened(first, 0.002, INFO)
    assert pool.place(now=0).url != first.url


def test_placement_takes_the_lowest_predicted_delay():
    pool = WorkerPool([A, B, C])
    a, b, c = pool.workers
    pool.opened(a, 0.050, INFO)  # far away
    pool.opened(b, 0.002, INFO)
    pool.opened(c, 0.002, {**INFO, "sessions": 4})  # full when it last answered
    assert pool.place(now=0) is b
    b.sessions = 20  # busy with this device's sessions: g(mu + 1) per session it serves
    assert pool.place(now=0) is a
    assert pool.place(exclude={A, B}, now=0) is c and pool.place(exclude={A, B, C}, now=0) is None


def test_a_failing_worker_is_kept_out_with_a_doubling_backoff_and_back_after_an_open():
    pool = WorkerPool([A, B])
    a, b = pool.workers
    pool.opened(a, 0.001, INFO)
    pool.opened(b, 0.010, INFO)
    pool.failed(a, now=100)
    assert pool.place(now=100.5) is b and pool.place(now=101) is a  # 1 s
    pool.failed(a, now=101)
    assert pool.place(now=102.5) is b and pool.place(now=103) is a  # 2 s
    for _ in range(10):
        pool.failed(a, now=200)
    assert a.closed_until == 200 + MAX_BACKOFF_SECONDS
    pool.opened(a, 0.001, INFO)
    assert a.failures == 0 and pool.place(now=200) is a


def test_with_every_breaker_open_the_first_to_close_is_tried():
    pool = WorkerPool([A, B])
    a, b = pool.workers
    pool.failed(a, now=0)
    pool.failed(a, now=0)  # open until 2
    pool.failed(b, now=0)  # open until 1
    assert pool.place(now=0.5) is b


def test_concurrency_sums_the_open_workers_pipelines_and_sessions():
    pool = WorkerPool([A, B, C])
    assert (pool.concurrency(now=0).lanes, pool.concurrency(now=0).limit) == (1, None)  # nothing known yet
    a, b, _unopened = pool.workers
    pool.opened(a, 0.002, {**INFO, "pipeline": 2})  # a 2-stage worker: two sessions in flight
    pool.opened(b, 0.002, {**INFO, "pipeline": 1, "max_sessions": 8})
    assert (pool.concurrency(now=0).lanes, pool.concurrency(now=0).limit) == (3, 12)  # c has not answered yet
    pool.failed(b, now=0)  # its breaker is open: no lanes there until it closes
    assert (pool.concurrency(now=0).lanes, pool.concurrency(now=0).limit) == (2, 4)
