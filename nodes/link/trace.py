"""OpenTelemetry tracing, shared by the head and a node: on when OTEL_EXPORTER_OTLP_ENDPOINT is set, else nothing.

`setup(service)` makes a tracer provider exporting by OTLP/HTTP (the SDK reads the standard OTEL_* variables: the
endpoint, headers, timeout, sampler, OTEL_BSP_SCHEDULE_DELAY, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES); until
it has run, `ENABLED` is False and every caller's hook is one flag check. The W3C trace context travels as a
`traceparent` and `tracestate` pair of strings (client headers, a generate frame, the link's GenerateSpec).

`spans` maps a generation's id to its current span on this side, so log lines about a generation carry its
trace_id and span_id (nodes.link.logs) without a context being attached on every event. Django-free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

ENABLED = False
_provider: Any = None
_tracer: Any = otel.NoOpTracer()
_propagator = TraceContextTextMapPropagator()
spans: dict[str, Any] = {}  # gen_id -> this side's current span of that generation (for log lines)
MAX_TRACKED = 10_000  # a bound on `spans`, should an end ever be missed


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for traces exported by OTLP."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(service: str, exporter: Any = None) -> bool:
    """Start tracing for this process as `service` (unless OTEL_SERVICE_NAME names it) when the environment asks
    for it, or with `exporter` (tests). Idempotent; True when tracing is on."""
    global ENABLED, _provider, _tracer
    if ENABLED or (exporter is None and not wanted()):
        return ENABLED
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter())  # off the hot path: a thread exports in batches
    else:
        processor = SimpleSpanProcessor(exporter)
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service})
    _provider = TracerProvider(resource=resource)  # flushes at exit too (shutdown_on_exit)
    _provider.add_span_processor(processor)
    otel.set_tracer_provider(_provider)
    _tracer = _provider.get_tracer("fleet")
    ENABLED = True
    log.info("tracing: exporting spans as %s", resource.attributes.get("service.name"))
    return True


def shutdown() -> None:
    """Export what is left (the process is stopping)."""
    if _provider is not None:
        try:
            _provider.shutdown()
        except Exception:  # a receiver gone away must not stop the process from exiting
            log.debug("tracing: shutdown failed", exc_info=True)


def tracer() -> Any:
    return _tracer


def parent(traceparent: Any, tracestate: Any = "") -> Context | None:
    """The context a W3C traceparent (and tracestate) names; None when there is none or it is malformed."""
    if not traceparent or not isinstance(traceparent, str):
        return None
    carrier = {"traceparent": traceparent}
    if tracestate and isinstance(tracestate, str):
        carrier["tracestate"] = tracestate
    ctx = _propagator.extract(carrier)
    return ctx if otel.get_current_span(ctx).get_span_context().is_valid else None


def under(span: Any) -> Context:
    """A context whose parent is `span`."""
    return otel.set_span_in_context(span)


def carrier(span: Any) -> dict[str, str]:
    """`span`'s W3C traceparent (and tracestate) to hand on."""
    out: dict[str, str] = {}
    _propagator.inject(out, context=otel.set_span_in_context(span))
    return out


def ids(span: Any) -> tuple[str, str]:
    """(trace_id, span_id) in hex; empty strings for a span that is not recorded."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return "", ""
    return otel.format_trace_id(ctx.trace_id), otel.format_span_id(ctx.span_id)


def track(gen_id: str, span: Any) -> None:
    if len(spans) >= MAX_TRACKED:
        spans.pop(next(iter(spans)))
    spans[gen_id] = span


def log_ids(gen_id: str | None) -> tuple[str, str]:
    """The ids a log line carries: the span of the generation it is about, else the current span (a Celery task)."""
    span = spans.get(gen_id) if gen_id is not None else None
    return ids(span if span is not None else otel.get_current_span())


def fail(span: Any, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message))
