"""OpenTelemetry traces of the gateway's requests, on the GenAI semantic conventions, built from the event bus.

Off unless `[telemetry] enabled = true` (or TANDEM_TELEMETRY__ENABLED): then, and only then, the OpenTelemetry SDK
is imported (the `telemetry` extra), a BatchSpanProcessor exports over OTLP/HTTP on its own thread, and a listener on
the bus (app/serving/events.py) turns the orchestrator's events into spans. Off, nothing here runs and nothing is
imported: the bus has no listener.

The spans of one request:
- the request: `{operation} {model}` (SERVER), `gen_ai.operation.name` (chat | text_completion),
  `gen_ai.request.model` (what the client asked for), `gen_ai.response.id` = the request id = `x-request-id`,
  `gen_ai.usage.input_tokens` / `output_tokens`, `gen_ai.response.finish_reasons`, time to first chunk; DiSCo's
  decisions and the cost under `tandem.*` (the conventions have no cost attribute); one event per migration.
- one child per endpoint attempt (a race's two starts, a fallback, each migration leg): `{operation} {model}` of
  that endpoint's model, INTERNAL on the device, CLIENT to a cloud or a HAT worker; `gen_ai.provider.name`, its
  prefill as `gen_ai.usage.input_tokens` (of which `gen_ai.usage.cache_read.input_tokens` from its own KV cache), its
  decode as `output_tokens`, a `gen_ai.first_token` event, `tandem.outcome` (lost | failed | finished | cancelled |
  migrated-from), and for a migration leg a link to the leg it continues.
- on a HAT leg, one child span per session with a worker (`tandem.hat.session`, CLIENT: a failover opens a second):
  `server.address` / `server.port` of the worker used, its μ, the draft shape, the context it prefilled, and at close
  the draft-verify rounds and the accept length (tokens per round); the leg gets a `tandem.hat.session.opened`
  event naming the worker. A session closes when its stream is closed, just after the leg's last token: its span
  may end a few milliseconds after its parent's, as OpenTelemetry allows.

No span carries prompt or answer text: the events they are built from carry none.

The SDK reads the standard OTEL_* variables for what `[telemetry]` leaves unset (OTEL_EXPORTER_OTLP_ENDPOINT /
_TRACES_ENDPOINT, _HEADERS, _TIMEOUT, OTEL_BSP_*, OTEL_RESOURCE_ATTRIBUTES); OTEL_SDK_DISABLED=true turns it off.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from app.serving.events import Event, EventBus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TelemetryOptions:
    enabled: bool = False
    endpoint: str = ""  # the OTLP/HTTP traces URL; "" = the OTEL_EXPORTER_OTLP_* variables' (else localhost:4318)
    service_name: str = "tandem-gateway"


@dataclass
class _Request:
    span: Any
    operation: str
    legs: list[Any] = field(default_factory=list)  # (backend, span) of every attempt, in order
    serving: Any = None  # the leg whose tokens the client is reading
    sessions: dict[str, Any] = field(default_factory=dict)  # HAT session id -> its span, while open


def start_telemetry(options: TelemetryOptions, bus: EventBus, model_name: str) -> RequestSpans | None:
    """Spans of every request published on `bus`, exported over OTLP/HTTP; None when telemetry is off."""
    if not options.enabled or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            f"[telemetry] enabled needs the OpenTelemetry SDK: pip install -e '.[telemetry]' ({exc})"
        ) from exc
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: options.service_name}))
    exporter = OTLPSpanExporter(endpoint=options.endpoint or None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    spans = RequestSpans(provider, model_name)
    bus.listen(spans.on_event)
    log.info("OpenTelemetry traces: OTLP/HTTP to %s", options.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
    return spans


class RequestSpans:
    """The bus listener: request and endpoint spans as the events come (synchronous, on the publisher's thread)."""

    def __init__(self, provider, model_name: str):
        from opentelemetry import trace
        from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
        from opentelemetry.semconv.attributes import error_attributes, server_attributes

        self.provider = provider
        self.tracer = provider.get_tracer("tandem.gateway")
        self.model_name = model_name
        self.trace = trace
        self.gen_ai = gen_ai
        self.error_type = error_attributes.ERROR_TYPE
        self.server = server_attributes
        self.requests: dict[str, _Request] = {}
        self._handlers = {
            "request.planned": self._planned,
            "endpoint.started": self._leg_started,
            "endpoint.won": self._leg_won,
            "migration.started": self._migration,
            "migration.completed": self._migration,
            "migration.failed": self._migration,
            "request.finished": self._request_ended,
            "request.failed": self._request_ended,
            "hat.session.opened": self._hat_opened,
            "hat.session.closed": self._hat_closed,
        }
        for outcome in ("lost", "failed", "finished", "cancelled", "migrated-from"):
            self._handlers[f"endpoint.{outcome}"] = self._leg_ended

    def on_event(self, event: Event) -> None:
        handler = self._handlers.get(event["type"])
        if handler is not None and (event["type"] == "request.planned" or event.get("request_id") in self.requests):
            handler(event)

    def close(self) -> None:
        """End what is still open and flush the exporter (the gateway's shutdown)."""
        for request in list(self.requests.values()):
            request.span.end()
        self.requests.clear()
        self.provider.shutdown()

    # -- handlers ----------------------------------------------------------------------------------------------------
    @staticmethod
    def _ns(event: Event) -> int:
        return int(event["time"] * 1e9)

    def _operation(self, request_id: str) -> str:
        values = self.gen_ai.GenAiOperationNameValues
        return (values.TEXT_COMPLETION if request_id.startswith("cmpl-") else values.CHAT).value

    def _planned(self, event: Event) -> None:
        g = self.gen_ai
        request_id = event["request_id"]
        operation = self._operation(request_id)
        model = event["pinned"] or self.model_name
        span = self.tracer.start_span(
            f"{operation} {model}",
            kind=self.trace.SpanKind.SERVER,
            start_time=self._ns(event),
            attributes={
                g.GEN_AI_OPERATION_NAME: operation,
                g.GEN_AI_REQUEST_MODEL: model,
                g.GEN_AI_REQUEST_MAX_TOKENS: event["max_tokens"],
                g.GEN_AI_RESPONSE_ID: request_id,
                "tandem.request_id": request_id,
                "tandem.policy": event["policy"],
                "tandem.plan": event["plan"],
                "tandem.plan.policy": event["plan_policy"],
                "tandem.plan.reason": event["reason"],
                "tandem.privacy": event["privacy"],
                **({"tandem.plan.device_delay_ms": event["device_delay_ms"]} if event["device_delay_ms"] else {}),
            },
        )
        self.requests[request_id] = _Request(span, operation)

    def _leg_started(self, event: Event) -> None:
        g = self.gen_ai
        request = self.requests[event["request_id"]]
        links = []
        if event["migration"] and request.serving is not None:
            links.append(self.trace.Link(request.serving.get_span_context(), {"tandem.link": "continues"}))
        kind = self.trace.SpanKind.INTERNAL if event["locality"] == "device" else self.trace.SpanKind.CLIENT
        provider = {"device": "tandem.device", "split": "tandem.hat"}.get(
            event["locality"], g.GenAiProviderNameValues.OPENAI.value
        )
        span = self.tracer.start_span(
            f"{request.operation} {event['model']}",
            context=self.trace.set_span_in_context(request.span),
            kind=kind,
            links=links,
            start_time=self._ns(event),
            attributes={
                g.GEN_AI_OPERATION_NAME: request.operation,
                g.GEN_AI_PROVIDER_NAME: provider,
                g.GEN_AI_REQUEST_MODEL: event["model"],
                "tandem.endpoint": event["endpoint"],
                "tandem.backend": event["backend"],
                "tandem.locality": event["locality"],
                "tandem.migration": event["migration"],
                "tandem.from_token": event["from_token"],
            },
        )
        request.legs.append((event["backend"], span))

    def _leg(self, event: Event):
        for backend, span in reversed(self.requests[event["request_id"]].legs):
            if backend == event["backend"] and span.is_recording():
                return span
        return None

    def _leg_won(self, event: Event) -> None:
        g = self.gen_ai
        span = self._leg(event)
        if span is None:
            return
        self.requests[event["request_id"]].serving = span
        span.set_attribute(g.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, event["ttft_ms"] / 1e3)
        span.set_attribute(g.GEN_AI_USAGE_INPUT_TOKENS, event["prefill_tokens"] + event["cached_tokens"])
        span.set_attribute(g.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, event["cached_tokens"])
        span.add_event("gen_ai.first_token", timestamp=self._ns(event))

    def _leg_ended(self, event: Event) -> None:
        span = self._leg(event)
        if span is None:
            return
        outcome = event["type"].removeprefix("endpoint.")
        span.set_attribute("tandem.outcome", outcome)
        if "decode_tokens" in event:
            span.set_attribute(self.gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS, event["decode_tokens"])
        if outcome == "failed":
            span.set_attribute(self.error_type, str(event.get("status", "error")))
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, event.get("error")))
        span.end(end_time=self._ns(event))

    def _migration(self, event: Event) -> None:
        request = self.requests[event["request_id"]]
        attributes = {
            "tandem.migration.from": event["from"],
            "tandem.migration.to": event["to"],
            "tandem.migration.reason": event["reason"],
            "tandem.migration.at_token": event["at_token"],
            "tandem.migration.lead_tokens": event["lead_tokens"],
        }
        if "t_m_ms" in event:
            attributes["tandem.migration.t_m_ms"] = event["t_m_ms"]
        if "error" in event:
            attributes[self.error_type] = event["error"][:200]
        request.span.add_event(f"tandem.{event['type']}", attributes, timestamp=self._ns(event))

    def _hat_opened(self, event: Event) -> None:
        request = self.requests[event["request_id"]]
        leg = self._leg(event)
        parent = leg if leg is not None else request.span
        worker = urllib.parse.urlsplit(event["worker"])
        at = self._ns(event)
        parent.add_event("tandem.hat.session.opened", {"tandem.hat.session": event["session"]}, timestamp=at)
        request.sessions[event["session"]] = self.tracer.start_span(
            "tandem.hat.session",
            context=self.trace.set_span_in_context(parent),
            kind=self.trace.SpanKind.CLIENT,
            start_time=at,
            attributes={
                self.server.SERVER_ADDRESS: worker.hostname or event["worker"],
                **({self.server.SERVER_PORT: worker.port} if worker.port else {}),
                "tandem.backend": event["backend"],
                "tandem.hat.session": event["session"],
                "tandem.hat.worker": event["worker"],
                "tandem.hat.mu": event["mu"],
                "tandem.hat.m": event["m"],
                "tandem.hat.draft_shape": event["draft_shape"],
                "tandem.hat.context_tokens": event["context_tokens"],
            },
        )

    def _hat_closed(self, event: Event) -> None:
        span = self.requests[event["request_id"]].sessions.pop(event["session"], None)
        if span is None:
            return
        span.set_attribute("tandem.hat.rounds", event["rounds"])
        if event["accept_length"] is not None:
            span.set_attribute("tandem.hat.accept_length", event["accept_length"])
        span.end(end_time=self._ns(event))

    def _request_ended(self, event: Event) -> None:
        g = self.gen_ai
        request = self.requests.pop(event["request_id"])
        trace = event["trace"]
        span = request.span
        span.set_attribute(g.GEN_AI_USAGE_INPUT_TOKENS, trace["prompt_tokens"])
        span.set_attribute(g.GEN_AI_USAGE_OUTPUT_TOKENS, trace["completion_tokens"])
        if trace["ttft_ms"] is not None:
            span.set_attribute(g.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, trace["ttft_ms"] / 1e3)
        if trace["finish_reason"] is not None:
            span.set_attribute(g.GEN_AI_RESPONSE_FINISH_REASONS, [trace["finish_reason"]])
        span.set_attribute("tandem.cost_usd", trace["cost_usd"])
        span.set_attribute("tandem.migrations", len(trace["migrations"]))
        span.set_attribute("tandem.delayed_tokens", trace["delayed_tokens"])
        winners = [e["backend"] for e in trace["endpoints"] if e["first_token_ms"] is not None]
        if winners:
            span.set_attribute("tandem.served_by", winners)
        for leg in [*(leg for _, leg in request.legs), *request.sessions.values()]:
            if leg.is_recording():
                leg.end(end_time=self._ns(event))
        if event["type"] == "request.failed":
            span.set_attribute(self.error_type, "request_failed")
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, trace.get("error") or "abandoned"))
        span.end(end_time=self._ns(event))
