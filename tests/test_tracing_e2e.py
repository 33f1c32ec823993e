"""One OpenTelemetry trace per generation, from the client through a real head to real nodes, as a real OTLP/HTTP
receiver gets it (decoded with opentelemetry-proto): parented span by span, under the client's trace id, and
across a failover to a second node."""

import json
import signal
import uuid

import httpx
import pytest
from openai import OpenAI

from tests.live import make_head, start_node
from tests.otlp import OtlpReceiver, tracing_env

pytestmark = pytest.mark.slow

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = OtlpReceiver().start()
    head = make_head(tmp_path_factory.mktemp("tracing"), extra_env=tracing_env(receiver, "fleet-head"))
    head.start()
    nodes = {name: start_node(head, "--max-batch", "2", identity=name, extra_env=tracing_env(receiver, name))
             for name in ("node-a", "node-b")}
    try:
        head.wait_nodes(2, timeout=240)
        yield head, nodes, receiver
    finally:
        for node in nodes.values():
            node.stop()
        head.stop()
        receiver.stop()


def one(spans, name, **where):
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in where.items())]
    assert len(found) == 1, f"{name} {where}: {[(s.service, s.name, s.attributes) for s in spans]}"
    return found[0]


def generation(head, gen_id: str) -> dict:
    response = httpx.get(f"{head.url}/api/generations/{uuid.UUID(gen_id)}/",
                         headers={"Authorization": f"Bearer {head.api_key}"}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_generation_is_one_trace_under_the_clients_from_head_to_node(traced):
    head, _, receiver = traced
    client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120,
                    default_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"})
    answer = client.chat.completions.with_raw_response.create(
        model="smollm2", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hi"}])
    gen_id = answer.headers["x-fleet-generation"]
    usage = answer.parse().usage
    spans = receiver.wait(lambda: (s := receiver.trace(CLIENT_TRACE)) and any(x.name == "node.generation" for x in s)
                          and any(x.name == "fleet.request" for x in s) and s)

    request = one(spans, "fleet.request")
    assert request.service == "fleet-head" and request.parent_span_id == CLIENT_SPAN
    assert request.attributes["gen_ai.request.model"] == "smollm2"
    assert request.attributes["gen_ai.operation.name"] == "chat"
    assert request.attributes["fleet.api"] == "/v1/chat/completions"
    assert request.attributes["fleet.api_key_id"]
    assert request.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert request.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert request.attributes["gen_ai.response.finish_reasons"] == ["length"]
    for name in ("fleet.admission", "fleet.queue", "fleet.attempt"):
        assert one(spans, name).parent_span_id == request.span_id
    placement = dict(one(spans, "fleet.queue").events)["fleet.placement"]
    candidates = json.loads(placement["fleet.placement.candidates"])
    assert placement["fleet.node"] in ("node-a", "node-b") and placement["fleet.node"] == candidates[0]["node"]
    assert {c["node"] for c in candidates} <= {"node-a", "node-b"} and all("cost" in c for c in candidates)
    attempt = one(spans, "fleet.attempt")
    assert attempt.attributes["fleet.node"] == placement["fleet.node"]
    assert "first_token" in dict(attempt.events)

    node = one(spans, "node.generation")  # the node's spans: children of the head's attempt span
    assert node.service == placement["fleet.node"] and node.parent_span_id == attempt.span_id
    assert node.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert node.attributes["fleet.gen_id"] == gen_id
    for name in ("node.admission", "node.prefill", "node.decode", "engine.worker"):
        assert one(spans, name).parent_span_id == node.span_id
    assert one(spans, "node.admission").attributes["fleet.prompt_tokens"] == usage.prompt_tokens
    assert one(spans, "node.prefill").end_ns <= one(spans, "node.decode").start_ns
    assert one(spans, "engine.worker").attributes["fleet.worker.pid"] > 0
    assert generation(head, gen_id)["trace_id"] == CLIENT_TRACE  # the record names its trace


def test_failover_adds_the_second_nodes_spans_to_the_same_trace(traced):
    """Killed mid-stream, the first node's exported spans and the second node's are in the one trace, each under
    its own attempt span; the first attempt ends with a failover event naming why."""
    head, nodes, receiver = traced
    trace_id = uuid.uuid4().hex
    client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120,
                    default_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
    stream = client.chat.completions.create(
        model="smollm2", max_tokens=32, temperature=0, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Count from one to one hundred, in words, one per line."}])
    text, victim = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if victim is None and len(text) > 10:
            victim = chunk.system_fingerprint.removeprefix("fleet:")
            # killed once its ended spans are out (they leave a schedule delay after they end)
            receiver.wait(lambda v=victim: any(s.service == v and s.name == "node.prefill" for s in receiver.trace(
                trace_id)), timeout=10)
            nodes[victim].stop(signal.SIGKILL)
    assert victim is not None
    survivor = ({"node-a", "node-b"} - {victim}).pop()
    spans = receiver.wait(lambda: (s := receiver.trace(trace_id)) and any(x.name == "fleet.request" for x in s)
                          and any(x.name == "node.generation" and x.service == survivor for x in s) and s)

    request = one(spans, "fleet.request")
    first, second = one(spans, "fleet.attempt", **{"fleet.attempt": 1}), one(spans, "fleet.attempt",
                                                                            **{"fleet.attempt": 2})
    assert (first.attributes["fleet.node"], second.attributes["fleet.node"]) == (victim, survivor)
    assert first.parent_span_id == second.parent_span_id == request.span_id
    why = dict(first.events)["fleet.failover"]
    assert why["fleet.node"] == victim and why["error.type"] == "node_lost"
    assert second.attributes["fleet.resumed_tokens"] > 0
    assert request.attributes["fleet.nodes_used"] == [victim, survivor]
    # the killed node exported what had ended before the kill: its admission and prefill, under one parent (its
    # node.generation, cut short by the kill, never exported)
    cut = [s for s in spans if s.service == victim]
    assert {s.name for s in cut} >= {"node.admission", "node.prefill"}
    assert len({s.parent_span_id for s in cut if s.name.startswith("node.")}) == 1
    resumed = one(spans, "node.generation")
    assert resumed.service == survivor and resumed.parent_span_id == second.span_id
