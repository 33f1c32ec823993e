"""A node's spans of a generation, children of the head's attempt span (its context comes in the GenerateSpec).

    node.generation          from the generate message to the end (usage, finish reason)
      node.admission         until the engine admits it to a lane (prompt and cached tokens)
      node.prefill           from the lane to the first token
      node.decode            from the first token to the end
      engine.worker          the engine worker process's side: from the pipe to the end (its pid, its replica)

Built from the events the agent relays anyway: the first token batch ends prefill, later ones cost a dict lookup
and no span work. Every hook is called only when `trace.ENABLED`.
"""

from __future__ import annotations

from typing import Any

from nodes.link import trace
from nodes.link.messages import Accepted, Done, Error, TokenBatch


class _Generation:
    __slots__ = ("root", "phase", "worker", "decoding")

    def __init__(self, root: Any) -> None:
        self.root, self.phase, self.worker, self.decoding = root, None, None, False


_running: dict[str, _Generation] = {}


def received(spec: Any, node: str) -> None:
    """The head's generate message was read: the node's spans start."""
    tracer = trace.tracer()
    root = tracer.start_span("node.generation", context=trace.parent(spec.traceparent, spec.tracestate),
                             kind=trace.otel.SpanKind.SERVER,
                             attributes={"gen_ai.request.model": spec.model, "fleet.gen_id": spec.gen_id,
                                         "fleet.node": node, "gen_ai.request.max_tokens": spec.max_tokens,
                                         "fleet.resumed_tokens": len(spec.resume_ids)})
    gen = _running[spec.gen_id] = _Generation(root)
    gen.phase = tracer.start_span("node.admission", context=trace.under(root))
    trace.track(spec.gen_id, root)


def submitted(gen_id: str, pid: int | None) -> None:
    """Sent down an engine worker's pipe."""
    gen = _running.get(gen_id)
    if gen is not None and gen.worker is None:
        gen.worker = trace.tracer().start_span("engine.worker", context=trace.under(gen.root),
                                               attributes={"fleet.worker.pid": pid or 0})


def event(msg: Any) -> None:
    """An engine event on its way to the head."""
    gen = _running.get(msg.gen_id)
    if gen is None:
        return
    if isinstance(msg, TokenBatch):
        if not gen.decoding:  # the first batch: prefill is over
            gen.decoding = True
            _next_phase(gen, "node.decode")
    elif isinstance(msg, Accepted):
        attrs = {"fleet.prompt_tokens": msg.prompt_tokens, "fleet.cached_tokens": msg.cached_tokens,
                 "fleet.lane": msg.lane, "fleet.replica": msg.replica}
        gen.phase.set_attributes(attrs)
        gen.root.set_attributes(attrs)
        if gen.worker is not None:
            gen.worker.set_attribute("fleet.replica", msg.replica)
        _next_phase(gen, "node.prefill")
    elif isinstance(msg, Done | Error):
        _end(msg, gen)


def _next_phase(gen: _Generation, name: str) -> None:
    gen.phase.end()
    gen.phase = trace.tracer().start_span(name, context=trace.under(gen.root))


def _end(msg: Done | Error, gen: _Generation) -> None:
    del _running[msg.gen_id]
    trace.spans.pop(msg.gen_id, None)
    root = gen.root
    if isinstance(msg, Done):
        usage = msg.usage or {}
        root.set_attributes({
            "gen_ai.usage.input_tokens": usage.get("prompt_tokens", 0),
            "gen_ai.usage.output_tokens": usage.get("completion_tokens", 0),
            "fleet.cached_tokens": usage.get("cached_tokens", 0),
            "gen_ai.response.finish_reasons": [msg.finish_reason],
            **{f"fleet.timings.{k}": v for k, v in (msg.timings or {}).items() if isinstance(v, int | float)},
        })
        gen.phase.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens", 0))
    else:
        root.set_attribute("error.type", msg.code)
        for span in (root, gen.phase, gen.worker):
            if span is not None:
                trace.fail(span, msg.message)
    for span in (gen.phase, gen.worker, root):
        if span is not None:
            span.end()
