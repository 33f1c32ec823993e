"""A real OTLP/HTTP trace receiver on loopback: what a head and its nodes export, decoded with opentelemetry-proto.

Used by the tracing test and bench/relay.py (tracing on, exporting somewhere real)."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[str]  # the trace ids it links to
    status_code: int


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attrs(pairs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0

    def start(self) -> OtlpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="otlp-receiver").start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take(self, request: ExportTraceServiceRequest) -> None:
        self.requests += 1
        for resource_spans in request.resource_spans:
            service = _attrs(resource_spans.resource.attributes).get("service.name", "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    self.spans.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        links=[link.trace_id.hex() for link in s.links], status_code=s.status.code))

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    def wait(self, predicate, timeout: float = 30.0) -> Any:
        """Wait until `predicate()` is true (spans arrive in batches, a schedule delay apart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.1)
        raise AssertionError(f"spans never arrived; received: {[(s.service, s.name) for s in self.spans]}")


def tracing_env(receiver: OtlpReceiver, service: str) -> dict[str, str]:
    """The standard variables that turn a head's or node's tracing on, exporting to `receiver` quickly."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": service,
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
