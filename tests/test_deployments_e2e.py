"""Deployments with real processes: a head (daphne) with the bundled SmolLM2 file added to its registry under a new
name, two `manage.py node_join` nodes serving their own model, and /api/deployments/ putting the new name on both (by
label), then moving it from one node to the other while a client streams, with no request failing."""

from __future__ import annotations

import itertools
import threading

import httpx
import openai
import pytest

from nodes.agent.engine.local import bundled_model_path
from tests.live import make_head, start_node, wait_for

pytestmark = pytest.mark.slow

NAME = "smol-deployed"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A head with the model in its registry and two nodes labelled pool=blue, each with a FLEET_HOME of its own."""
    tmp = tmp_path_factory.mktemp("deploy")
    head = make_head(tmp)
    head.manage("model_add", bundled_model_path(), "--name", NAME)  # the registry service, under a new name
    head.start()
    nodes = [start_node(head, "--max-batch", "2", "--max-context", "1024", "--label", "pool=blue", identity=name,
                        offline=False, extra_env={"FLEET_HOME": str(tmp / name)}) for name in ("dep-a", "dep-b")]
    try:
        head.wait_nodes(2, timeout=240)
        yield head, nodes
    finally:
        for node in nodes:
            node.stop()
        head.stop()


def api(head) -> httpx.Client:
    return httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"}, timeout=60)


def states(head, deployment_id: str) -> dict[str, str]:
    """node -> its pair's summary (pulling 43%, serving, failed: why) as /api/deployments/ shows it."""
    with api(head) as client:
        body = client.get(f"/api/deployments/{deployment_id}/").json()
    return {pair["node"]: pair["summary"] for pair in body["states"]}


def wait_states(head, nodes, deployment_id: str, want: dict[str, str], timeout: float = 180) -> None:
    wait_for(lambda: states(head, deployment_id) == want, timeout,
             f"states {states(head, deployment_id)} never became {want}: {[n.log() for n in nodes]}")


def ask(head, client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    """(the node that served it, the answer) for one streamed chat completion of the deployed model."""
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, max_tokens=8, temperature=0, stream=True, messages=[{"role": "user", "content": prompt}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    return raw.headers.get("x-fleet-node") or node_of(head, raw.headers["x-fleet-generation"]), text


def node_of(head, gen_id: str) -> str:
    """The node a generation ran on, from its record (written when it ended)."""
    def recorded():
        with api(head) as client:
            answer = client.get(f"/api/generations/{gen_id}/")
        return answer.status_code == 200 and answer.json()["node_identity"]
    return wait_for(recorded, 30, f"generation {gen_id} has no record")


def test_a_model_deployed_by_label_is_served_by_both_nodes_then_moves_without_failing_a_request(fleet):
    head, nodes = fleet
    client = openai.OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120)
    with api(head) as rest:
        made = rest.post("/api/deployments/", json={"model": NAME, "labels": {"pool": "blue"}, "lanes": 2,
                                                    "context": 1024})
    assert made.status_code == 201, made.text
    deployment = made.json()["id"]
    wait_states(head, nodes, deployment, {"dep-a": "serving", "dep-b": "serving"})
    assert NAME in [m.id for m in client.models.list().data]
    served_by: set[str] = set()
    for i in range(6):  # different prompts, so none is cheaper anywhere: the least routed node takes each
        served_by.add(ask(head, client, f"Name a colour, number {i}.")[0])
        if len(served_by) == 2:
            break
    assert served_by == {"dep-a", "dep-b"}

    # From both to dep-a only, then from dep-a to dep-b while a client streams.
    with api(head) as rest:
        assert rest.patch(f"/api/deployments/{deployment}/", json={"labels": {}, "nodes": ["dep-a"]}).status_code == 200
    wait_states(head, nodes, deployment, {"dep-a": "serving"})
    results, failures, stop, takes = [], [], threading.Event(), itertools.count()

    def stream() -> None:
        while not stop.is_set():
            try:
                results.append(ask(head, client, f"Say a word about the sea, take {next(takes)}."))
            except Exception as exc:  # a failed request is what this test is about
                failures.append(repr(exc))

    def watch_models() -> None:  # what a client choosing a model sees: the name is never missing from /v1/models
        while not stop.wait(0.1):
            if NAME not in [m.id for m in client.models.list().data]:
                failures.append(f"{NAME} missing from /v1/models")

    streamers = [threading.Thread(target=stream, daemon=True) for _ in range(2)]  # one always starts a new request
    streamers.append(threading.Thread(target=watch_models, daemon=True))
    for streamer in streamers:
        streamer.start()
    try:
        wait_for(lambda: len(results) >= 2, 60, f"the client got no answers: {failures}")
        with api(head) as rest:
            moved = rest.patch(f"/api/deployments/{deployment}/", json={"nodes": ["dep-b"]})
        assert moved.status_code == 200, moved.text
        wait_states(head, nodes, deployment, {"dep-b": "serving"})
        after = len(results)
        wait_for(lambda: len(results) >= after + 2, 60, f"no answers after the move: {failures}")
    finally:
        stop.set()
        for streamer in streamers:
            streamer.join(120)
    assert failures == []
    assert {node for node, _ in results} == {"dep-a", "dep-b"}
    assert results[-1][0] == "dep-b"
    assert all(text for _, text in results)
