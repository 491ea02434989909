"""Prometheus metrics of one gateway. Each gateway gets its own registry so several can
live in one process (tests) without colliding in the global default registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.in_flight = Gauge("tandem_in_flight_requests", "Generations in progress", registry=r)
        self.ttft = Histogram(
            "tandem_ttft_seconds", "Time to first token", ["backend"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "tandem_inter_token_seconds", "Gap between two tokens", ["backend"], buckets=_ITL_BUCKETS, registry=r
        )
        self.errors = Counter("tandem_backend_errors", "Backend failures", ["backend", "kind"], registry=r)
        self.tokens = Counter("tandem_tokens", "Tokens processed", ["backend", "phase"], registry=r)
        self.backend_active = Gauge(
            "tandem_backend_active_streams",
            "Backend generations still running (incl. queued)",
            ["backend"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
