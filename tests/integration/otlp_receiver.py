"""A real OTLP/HTTP trace receiver on loopback: what an OpenTelemetry collector's otlphttp receiver does for traces
(the collector itself is not on the package registries). POST /v1/traces with a protobuf
ExportTraceServiceRequest (gzip or not) is decoded with opentelemetry-proto and its spans kept as plain dicts."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

_KINDS = {v: k.removeprefix("SPAN_KIND_") for k, v in Span.SpanKind.items()}


def value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(items) -> dict:
    return {a.key: value(a.value) for a in items}


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.posts = 0
        self.resources: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        self.posts += 1
        for rs in request.resource_spans:
            self.resources.append(attributes(rs.resource.attributes))
            for scope in rs.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex() or None,
                            "kind": _KINDS[s.kind],
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attributes": attributes(s.attributes),
                            "events": [(e.name, attributes(e.attributes)) for e in s.events],
                            "links": [(link.span_id.hex(), attributes(link.attributes)) for link in s.links],
                            "status": s.status.code,
                        }
                    )

    def wait_for(self, predicate, timeout: float = 15.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.spans):
                return self.spans
            time.sleep(0.05)
        raise AssertionError(f"the receiver did not get the expected spans in {timeout} s; it has {self.spans}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
