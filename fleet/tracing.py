"""The head's spans of a generation (OpenTelemetry; on only when OTEL_EXPORTER_OTLP_ENDPOINT is set, nodes.link.trace).

    fleet.request            the /v1 request or generate frame (its API, key, model; usage and finish at the end);
                             the child of the client's traceparent when it sent one
      fleet.admission        the key's quota
      fleet.queue            waiting for a lane; ends with a `fleet.placement` event (the node, each candidate's cost);
                             a `fleet.loading` event when it waited for a node to load its model on demand
      fleet.attempt          one attempt on a node (its spans are this span's children); `first_token` event;
                             a failover ends it with a `fleet.failover` event naming why
    celery.task <name>       a batch run or maintenance task; a batch line's fleet.request links to its batch's

Every hook takes the generation's `GenTrace` (None while tracing is off, so each call site costs a test of None)
and is called at a few points: the /v1 wrapper (api.v1), `api.generation.Run`, and fleet.dispatch.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from nodes.link import trace

# The request span the /v1 wrapper started, for the Run its view makes to take over (and end when it ends).
_pending: ContextVar[GenTrace | None] = ContextVar("fleet_trace_pending", default=None)
OPERATIONS = {"chat": "chat", "completion": "text_completion"}


class GenTrace:
    __slots__ = ("request", "attempt", "queue", "owned", "attempts", "gen_id")

    def __init__(self, request: Any) -> None:
        self.request, self.attempt, self.queue, self.owned, self.attempts = request, None, None, False, 0
        self.gen_id = ""


def setup(service: str) -> None:
    """At a head's or Celery worker's start (fleet.asgi, fleet.celery): spans exported when the environment asks
    for them (OTEL_SERVICE_NAME names the service, else `service`); Celery's tasks traced."""
    if trace.setup(service):
        _trace_celery()


def request_begin(headers: Any, api: str) -> GenTrace | None:
    """A request's span, child of the client's trace context (`headers`: the HTTP headers, or a generate frame)."""
    if not trace.ENABLED:
        return None
    ctx = trace.parent(headers.get("traceparent"), headers.get("tracestate"))
    span = trace.tracer().start_span("fleet.request", context=ctx, kind=trace.otel.SpanKind.SERVER,
                                     attributes={"fleet.api": api})
    gen = GenTrace(span)
    _pending.set(gen)
    return gen


def request_key(gen: GenTrace | None, api_key: Any, batch_line: bool = False) -> None:
    if gen is not None and api_key is not None:
        gen.request.set_attributes({"fleet.api_key_id": str(api_key.pk), "fleet.batch_line": batch_line})


@contextmanager
def admission(gen: GenTrace | None):
    """The key's quota check, as a span."""
    if gen is None:
        yield
        return
    span = trace.tracer().start_span("fleet.admission", context=trace.under(gen.request))
    try:
        yield
    except Exception as exc:
        trace.fail(span, str(exc))
        raise
    finally:
        span.end()


def request_end(gen: GenTrace | None, status: int) -> None:
    """The view answered: its span ends here unless a generation took it over (it ends with the generation)."""
    if gen is None:
        return
    gen.request.set_attribute("http.response.status_code", status)
    if not gen.owned:
        if status >= 500:
            trace.fail(gen.request, f"HTTP {status}")
        gen.request.end()


def generation_begin(run: Any, gen: GenTrace | None = None) -> GenTrace | None:
    """A Run starts: it takes the span of the request that made it (or `gen`, or a new one), and its stream too."""
    if not trace.ENABLED:
        return None
    if gen is None:
        gen = _pending.get()
        if gen is None or gen.owned:
            gen = request_begin({}, "internal")
    gen.owned = True
    _pending.set(None)
    request, spec = run.request, run.request.spec
    gen.request.set_attributes({
        "gen_ai.operation.name": OPERATIONS.get(request.kind, request.kind), "gen_ai.request.model": spec.model,
        "gen_ai.request.max_tokens": spec.max_tokens, "gen_ai.request.temperature": spec.temperature,
        "gen_ai.request.top_p": spec.top_p, "fleet.gen_id": spec.gen_id, "fleet.stream": request.stream,
        "fleet.batch_line": request.batch,
    })
    if spec.seed is not None:
        gen.request.set_attribute("gen_ai.request.seed", spec.seed)
    gen.gen_id = spec.gen_id
    run.stream.trace = gen
    run.stream.outcome.trace_id = trace.ids(gen.request)[0]
    trace.track(spec.gen_id, gen.request)
    return gen


def queue_begin(gen: GenTrace | None) -> None:
    if gen is not None and gen.queue is None:
        gen.queue = trace.tracer().start_span("fleet.queue", context=trace.under(gen.request))


def loading(gen: GenTrace | None, model: str, node: str) -> None:
    """No node served its model: it waits (in the queue span) while a node loads it on demand."""
    if gen is not None:
        (gen.queue or gen.request).add_event("fleet.loading", {"fleet.model": model, "fleet.node": node})


def placed(gen: GenTrace | None, evidence: dict) -> None:
    """A lane was reserved: the queue span ends with the placement evidence (the node, every candidate's cost)."""
    if gen is None:
        return
    costs = [{"node": r.get("node"), "cost": r.get("cost"), "reread_tokens": r.get("reread_tokens"),
              "load_tokens": r.get("load_tokens")} for r in evidence.get("ranking") or []]
    attrs = {"fleet.node": evidence.get("node") or "", "fleet.placement.cost": evidence.get("cost") or 0,
             "fleet.placement.matched_tokens": evidence.get("matched_tokens") or 0,
             "fleet.placement.candidates": json.dumps(costs)}
    span = gen.queue or gen.request
    span.add_event("fleet.placement", attrs)
    queue_end(gen)


def queue_end(gen: GenTrace | None) -> None:
    if gen is not None and gen.queue is not None:
        gen.queue.end()
        gen.queue = None


def attempt_begin(gen: GenTrace | None, spec: Any, node: str) -> None:
    """An attempt on `node`: its span, whose context goes to the node in `spec` (the node's spans are children)."""
    if gen is None:
        return
    _attempt_end(gen, "fleet.preempted")  # a batch line placed again after its lane went to an interactive one
    gen.attempts += 1
    gen.attempt = trace.tracer().start_span("fleet.attempt", context=trace.under(gen.request),
                                            kind=trace.otel.SpanKind.CLIENT,
                                            attributes={"fleet.node": node, "fleet.attempt": gen.attempts,
                                                        "fleet.resumed_tokens": len(spec.resume_ids)})
    context = trace.carrier(gen.attempt)
    spec.traceparent, spec.tracestate = context.get("traceparent", ""), context.get("tracestate", "")
    trace.track(spec.gen_id, gen.attempt)


def first_token(gen: GenTrace | None) -> None:
    if gen is not None:
        (gen.attempt or gen.request).add_event("first_token")


def failover(gen: GenTrace | None, node: str, code: str, message: str) -> None:
    """The attempt's node failed: the attempt ends with why; the generation is placed again (or fails)."""
    if gen is None:
        return
    attrs = {"fleet.node": node, "error.type": code, "fleet.failover.reason": message}
    gen.request.add_event("fleet.failover", attrs)
    if gen.attempt is not None:
        gen.attempt.add_event("fleet.failover", attrs)
        trace.fail(gen.attempt, f"{code}: {message}")
    _attempt_end(gen)


def _attempt_end(gen: GenTrace, event: str = "") -> None:
    if gen.attempt is not None:
        if event:
            gen.attempt.add_event(event)
        gen.attempt.end()
        gen.attempt = None


def generation_end(gen: GenTrace | None, outcome: Any, status: str, code: str = "", error: str = "") -> None:
    """The generation is over (recorded): usage and the finish on the request span; every span of it ends."""
    if gen is None:
        return
    attrs = {"gen_ai.usage.input_tokens": outcome.prompt_tokens, "gen_ai.usage.output_tokens":
             outcome.completion_tokens, "fleet.cached_tokens": outcome.cached_tokens, "fleet.status": status,
             "fleet.nodes_used": list(outcome.nodes_used)}
    if outcome.finish_reason:
        attrs["gen_ai.response.finish_reasons"] = [outcome.finish_reason]
    if outcome.node:
        attrs["fleet.node"] = outcome.node
    if code:
        attrs["error.type"] = code
    gen.request.set_attributes(attrs)
    if gen.attempt is not None:
        gen.attempt.set_attributes({k: v for k, v in attrs.items() if k.startswith("gen_ai.usage")})
    if status == "failed":
        for span in (gen.request, gen.attempt):
            if span is not None:
                trace.fail(span, error or code)
    queue_end(gen)
    _attempt_end(gen)
    trace.spans.pop(gen.gen_id, None)
    gen.request.end()


# --- Celery ---------------------------------------------------------------------------------------------------


@contextmanager
def batch_line(parent: Any, index: int):
    """A batch line's request: a trace of its own, linked to its batch run's span; yields the headers to send."""
    if not trace.ENABLED:
        yield {}
        return
    links = [trace.otel.Link(parent)] if parent is not None and parent.is_valid else []
    span = trace.tracer().start_span("fleet.batch.line", context=trace.Context(), links=links,
                                     kind=trace.otel.SpanKind.CLIENT, attributes={"fleet.batch.line": index})
    try:
        yield trace.carrier(span)
    finally:
        span.end()


def current() -> Any:
    """The current span's context (a batch run's task), for its lines to link to; None while tracing is off."""
    return trace.otel.get_current_span().get_span_context() if trace.ENABLED else None


_tasks: dict[str, tuple[Any, Any]] = {}


def _trace_celery() -> None:
    """Each task a span, current while it runs (Celery's signals; the instrumentation package does the same)."""
    from celery import signals
    from opentelemetry import context

    def prerun(task_id=None, task=None, **_):
        if not trace.ENABLED:
            return
        span = trace.tracer().start_span(f"celery.task {task.name}", kind=trace.otel.SpanKind.CONSUMER,
                                         attributes={"celery.task_name": task.name, "celery.task_id": task_id})
        _tasks[task_id] = (span, context.attach(trace.under(span)))

    def failure(task_id=None, exception=None, **_):
        if task_id in _tasks:
            trace.fail(_tasks[task_id][0], repr(exception))

    def postrun(task_id=None, state=None, **_):
        span, token = _tasks.pop(task_id, (None, None))
        if span is not None:
            span.set_attribute("celery.state", state or "")
            context.detach(token)
            span.end()

    signals.task_prerun.connect(prerun, weak=False, dispatch_uid="fleet.tracing.prerun")
    signals.task_failure.connect(failure, weak=False, dispatch_uid="fleet.tracing.failure")
    signals.task_postrun.connect(postrun, weak=False, dispatch_uid="fleet.tracing.postrun")
