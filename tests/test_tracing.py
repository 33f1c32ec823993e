"""Tracing in process: off without an endpoint, log lines in their trace, the node's spans from its events, Celery's
tasks and a batch line's link, the trace id on the generation's admin page (the real path: test_tracing_e2e.py)."""

import asyncio
import io
import json
import logging

import pytest
from django.contrib.contenttypes.models import ContentType
from django.urls import reverse

from fleet import tracing
from nodes.agent import tracing as node_tracing
from nodes.link import logs, trace
from nodes.link.messages import Accepted, Done, Error, TokenBatch
from nodes.link.spec import GenerateSpec
from tests.factories import GenerationFactory, UserFactory

pytest_plugins = ["tests.api_fixtures"]

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def by_name(exporter):
    return {s.name: s for s in exporter.get_finished_spans()}


def test_tracing_is_off_without_an_endpoint_and_costs_nothing():
    assert not trace.wanted({})
    assert trace.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert trace.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    assert not trace.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert not trace.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"})
    assert not trace.ENABLED and tracing.request_begin({"traceparent": PARENT}, "/v1/chat/completions") is None
    assert trace.parent("00-not-a-trace") is None


def test_the_nodes_spans_come_from_its_events_under_the_heads_attempt(exported):
    spec = GenerateSpec(gen_id="g1", model="m", prompt="hi", max_tokens=4, traceparent=PARENT)
    node_tracing.received(spec, "node-a")
    node_tracing.submitted("g1", 4242)
    events = [Accepted(gen_id="g1", prompt_tokens=7, cached_tokens=3, lane=1),
              *[TokenBatch(gen_id="g1", seq=i, text=["x"], ids=[1]) for i in (1, 2, 3)],
              Done(gen_id="g1", seq=4, finish_reason="length", timings={"ttft_ms": 5.0},
                   usage={"prompt_tokens": 7, "cached_tokens": 3, "completion_tokens": 3})]
    for event in events:
        node_tracing.event(event)
    spans = by_name(exported)
    root = spans["node.generation"]
    assert root.parent.span_id == 0x00f067aa0ba902b7 and root.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert root.attributes["gen_ai.usage.output_tokens"] == 3 and root.attributes["fleet.cached_tokens"] == 3
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert {n: s.parent.span_id for n, s in spans.items() if n != "node.generation"} == dict.fromkeys(
        ("node.admission", "node.prefill", "node.decode", "engine.worker"), root.context.span_id)
    assert spans["node.admission"].attributes["fleet.prompt_tokens"] == 7
    assert spans["node.prefill"].end_time <= spans["node.decode"].start_time
    assert len(exported.get_finished_spans()) == 5 and not trace.spans  # one decode span, not one per batch

    node_tracing.received(GenerateSpec(gen_id="g2", model="m", prompt="hi"), "node-a")
    node_tracing.event(Error(gen_id="g2", code="engine_crashed", message="the engine worker died"))
    failed = [s for s in exported.get_finished_spans() if s.context.trace_id != root.context.trace_id]
    assert {s.name for s in failed} == {"node.generation", "node.admission"}
    assert all(s.status.status_code.name == "ERROR" for s in failed)


def test_a_json_log_line_about_a_generation_carries_its_trace(exported):
    span = trace.tracer().start_span("fleet.request", context=trace.parent(PARENT))
    trace.track("g1", span)
    out = io.StringIO()
    handler = logs.handler("json")
    handler.stream = out
    logger = logging.getLogger("test.tracing")
    logger.addHandler(handler)
    try:
        with logs.generation_context("g1"):
            logger.warning("about g1")
        logger.warning("about nothing")
    finally:
        logger.removeHandler(handler)
    about, nothing = (json.loads(line) for line in out.getvalue().splitlines())
    assert about["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and about["span_id"] == trace.ids(span)[1]
    assert "trace_id" not in nothing


def test_celery_tasks_are_spans_and_a_batch_line_links_to_its_batch(exported):
    from celery import shared_task

    tracing._trace_celery()  # as tracing.setup does on a worker

    @shared_task(name="tests.tracing_probe")
    def probe():
        return tracing.current()

    batch = probe.apply().get()  # eager: Celery's signals fire as on a worker
    task = by_name(exported)["celery.task tests.tracing_probe"]
    assert batch.span_id == task.context.span_id and task.attributes["celery.state"] == "SUCCESS"
    with tracing.batch_line(batch, 3) as headers:
        pass
    line = by_name(exported)["fleet.batch.line"]
    assert headers["traceparent"].split("-")[1] == f"{line.context.trace_id:032x}" != f"{batch.trace_id:032x}"
    assert [link.context.span_id for link in line.links] == [task.context.span_id]


@pytest.mark.django_db
def test_the_generations_admin_page_shows_its_trace_id(client):
    client.force_login(UserFactory(username="operator"))
    generation = GenerationFactory(trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    response = client.get(reverse("admin:inference_sessions_generation_change", args=[generation.pk]))
    assert "4bf92f3577b34da6a3ce929d0e0e4736" in response.content.decode()
    ContentType.objects.clear_cache()  # as it was: test_admin pins the page's queries, the content type's among them


@pytest.mark.django_db(transaction=True)
async def test_a_generate_frames_trace_goes_to_each_node_tried_with_the_failover_named(exported, bearer):
    """The websocket's frame carries the client's traceparent; each attempt's context reaches its node in the spec,
    and the lost node's attempt ends with a failover event."""
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from fleet.routing import websocket_urlpatterns
    from tests.api_support import FakeLink, Script, add_fake_node

    def script(spec):  # the first node is lost after two tokens; the second finishes
        return Script(per_batch=1, lose_after=None if spec.get("resume_ids") else 2)

    nodes = [add_fake_node(FakeLink(node_id=f"{n}" * 8 + "-1111-1111-1111-111111111111", identity=f"fake-{n}",
                                    script=script)) for n in (1, 2)]
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/v1/generate",
                                 headers=[(b"authorization", f"Bearer {bearer}".encode())])
    assert (await comm.connect())[0]
    await comm.send_json_to({"type": "generate", "id": "a", "model": "smollm2", "traceparent": PARENT,
                             "messages": [{"role": "user", "content": "Hi"}]})
    while (frame := await comm.receive_json_from(timeout=5))["type"] not in ("done", "error"):
        pass
    assert frame["type"] == "done", frame
    for _ in range(100):  # the request span ends once the generation is recorded, just after its done frame
        spans = exported.get_finished_spans()
        if any(s.name == "fleet.request" for s in spans):
            break
        await asyncio.sleep(0.05)
    await comm.disconnect()
    request = next(s for s in spans if s.name == "fleet.request")
    assert request.parent.span_id == 0x00f067aa0ba902b7 and request.attributes["fleet.api"] == "/ws/v1/generate"
    attempts = sorted((s for s in spans if s.name == "fleet.attempt"), key=lambda s: s.attributes["fleet.attempt"])
    lost, took_over = attempts
    assert [e.name for e in lost.events] == ["first_token", "fleet.failover"]
    assert lost.events[1].attributes["error.type"] == "node_lost" and lost.status.status_code.name == "ERROR"
    assert [e.name for e in request.events] == ["fleet.failover"]
    sent = {link.identity: link.specs[0]["traceparent"] for link in nodes}  # each node got its attempt's context
    assert sent[lost.attributes["fleet.node"]].split("-")[2] == f"{lost.context.span_id:016x}"
    assert sent[took_over.attributes["fleet.node"]].split("-")[2] == f"{took_over.context.span_id:016x}"
    assert request.attributes["gen_ai.usage.output_tokens"] == frame["usage"]["completion_tokens"] > 2
