"""Deployments without processes: the services (which nodes a deployment chooses, make before break when it moves),
`/api/deployments/` (validation, each pair's state), and the node's Deployer over fake engine workers (it announces a
loaded model before saying it serves it, drains one it unloads, refuses one that does not fit with the figures)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from nodes import deployments
from nodes.agent.deploy import Deployer, DeployRefused, deployed_window
from nodes.agent.engine.local import bundled_model_path
from nodes.agent.model_set import ModelSet
from nodes.link.codes import ModelPhase
from nodes.link.messages import Deploy, Done, Models, ModelState
from nodes.link.spec import GenerateSpec
from nodes.models import Model, NodeModel
from tests.factories import NodeFactory, UserFactory

pytest_plugins = ["tests.api_fixtures"]

NAME = "qwen-tiny"


def registry_model(name: str = NAME) -> Model:
    return Model.objects.create(name=name, sha256="ab" * 32, size=1000, architecture="llama", quantization="Q8_0",
                                context_length=8192, kv_bytes_per_token=23040)


# --- the head ---------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_deployment_chooses_nodes_by_name_or_by_all_its_labels():
    model = registry_model()
    a = NodeFactory(identity="a", labels={"gpu": "a100", "zone": "eu"})
    b = NodeFactory(identity="b", labels={"gpu": "a100"})
    c = NodeFactory(identity="c")
    deployments.deployment_create(model=model, nodes=["c"], labels={"gpu": "a100", "zone": "eu"}, lanes=2)
    wanted = {node.identity: deployments.node_deployments(node_id=node.pk) for node in (a, b, c)}
    assert wanted["a"] == wanted["c"] == [{"name": NAME, "sha256": "ab" * 32, "lanes": 2, "context": 0}]
    assert wanted["b"] == []


@pytest.mark.django_db
def test_a_moved_model_stays_on_its_old_node_until_a_node_it_moved_to_serves_it():
    model = registry_model()
    old, new = NodeFactory(identity="old"), NodeFactory(identity="new")
    deployment = deployments.deployment_create(model=model, nodes=["old"], labels={})
    deployments.node_model_record(node_id=old.pk, model=NAME, state="serving")
    deployments.deployment_update(deployment=deployment, nodes=["new"])
    assert [m["name"] for m in deployments.node_deployments(node_id=old.pk)] == [NAME]  # kept: nobody else serves it
    deployments.node_model_record(node_id=new.pk, model=NAME, state="loading")
    assert [m["name"] for m in deployments.node_deployments(node_id=old.pk)] == [NAME]
    to_tell = deployments.node_model_record(node_id=new.pk, model=NAME, state="serving")
    assert to_tell == [str(old.pk)]
    # said again (at every deploy it gets): nobody is told again, or two nodes would tell each other forever
    assert deployments.node_model_record(node_id=new.pk, model=NAME, state="serving") == []
    assert deployments.node_deployments(node_id=old.pk) == []  # let go: its node drains it
    deployments.node_model_record(node_id=old.pk, model=NAME, state="unloaded")
    assert list(NodeModel.objects.values_list("node__identity", "state")) == [("new", "serving")]


@pytest.mark.django_db
def test_the_api_makes_deployments_and_shows_each_pair_as_pulling_serving_or_failed(staff):
    registry_model()
    a, b = NodeFactory(identity="a"), NodeFactory(identity="b")
    made = staff.post("/api/deployments/", {"model": NAME, "nodes": ["a", "b"], "lanes": 2}, format="json")
    assert made.status_code == 201, made.content
    deployments.node_model_record(node_id=a.pk, model=NAME, state="pulling", progress=0.43)
    deployments.node_model_record(node_id=b.pk, model=NAME, state="failed", detail="not enough memory: 1.0 GB")
    shown = staff.get(f"/api/deployments/{made.json()['id']}/").json()
    assert {s["node"]: s["summary"] for s in shown["states"]} == {"a": "pulling 43%",
                                                                  "b": "failed: not enough memory: 1.0 GB"}


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "says"), [
    ({"model": NAME, "lanes": 2}, "choose the nodes"),
    ({"model": "nope", "nodes": ["a"]}, "does not exist"),
    ({"model": NAME, "nodes": ["a"], "lanes": 0}, "lanes must be from 1"),
    ({"model": NAME, "labels": {"": "x"}}, "labels must map"),
    ({"model": NAME, "labels": {"g\u0000": "a"}}, "labels must map"),  # PostgreSQL's jsonb refuses NUL
    ({"model": NAME, "labels": {"gpu": "a\u0000"}}, "Null characters are not allowed"),
    ({"model": "a\u0000", "nodes": ["a"]}, "cannot contain a NUL"),  # PostgreSQL cannot look it up: was a 500
])
def test_a_deployment_that_cannot_be_made_is_a_400_saying_why(staff, body, says):
    registry_model()
    answer = staff.post("/api/deployments/", body, format="json")
    assert answer.status_code == 400
    assert says in str(answer.json())


def test_a_nul_in_a_node_name_or_label_value_is_refused_by_the_service_too():  # the admin's JSON fields reach it
    with pytest.raises(deployments.DeploymentError, match="nodes must be a list"):
        deployments.deployment_check(nodes=["a\x00"], labels={}, lanes=1, context=0)
    with pytest.raises(deployments.DeploymentError, match="labels must map"):
        deployments.deployment_check(nodes=[], labels={"gpu": "a\x00"}, lanes=1, context=0)


@pytest.mark.django_db
def test_deployments_are_for_staff_only():
    api = APIClient()
    api.force_authenticate(UserFactory(username="someone", is_staff=False, is_superuser=False))
    assert api.get("/api/deployments/").status_code == 403


# --- the node ---------------------------------------------------------------------------------------------------


class FakeWorker:
    def __init__(self, name: str, lanes: int = 2) -> None:
        self.name, self.lanes, self.stopped, self.submitted = name, lanes, False, []

    def info(self):
        return {"model_name": self.name, "context_window": 1024, "lanes": self.lanes}

    def stats(self):
        return {"lanes": self.lanes, "lanes_busy": 0}

    alive = True

    async def start(self, on_progress=None):
        if on_progress is not None:
            on_progress(0.5)  # llama.cpp's load progress, reported on the loop
            await asyncio.sleep(0)
        return self.info()

    async def submit(self, spec):
        self.submitted.append(spec.gen_id)

    async def stop(self):
        self.stopped = True


async def _deploy_then_unload(monkeypatch) -> tuple[list, ModelSet, FakeWorker]:
    import nodes.agent.deploy as deploy

    monkeypatch.setattr(deploy, "DRAIN_GRACE_S", 0.05)
    monkeypatch.setattr(deploy, "deployed_window", lambda path, **kw: 1024)
    sent, made = [], []
    models = ModelSet(FakeWorker("own", lanes=4))

    async def fetch(name, progress):
        progress(0.5)  # called on the pull's thread, as pull.pull does: reported from the loop
        await asyncio.sleep(0)
        return Path("/models/x.gguf")

    def make_worker(config):
        made.append(FakeWorker(config.model_name, config.lanes))
        return made[-1]

    deployer = Deployer(models, fetch=fetch, send=sent.append, make_worker=make_worker)
    deployer.apply(Deploy(models=[{"name": NAME, "lanes": 2, "context": 0}]))
    await deployer.tasks[NAME]
    await models.submit(GenerateSpec(gen_id="g1", model=NAME, prompt="hi"))
    deployer.apply(Deploy(models=[]))
    await asyncio.sleep(0.2)
    assert not made[0].stopped  # g1 still runs there: drained first
    models.on_event(Done(gen_id="g1", seq=1, finish_reason="stop", usage={}, timings={}))
    await deployer.tasks[NAME]
    return sent, models, made[0]


def test_the_node_announces_a_deployed_model_before_serving_it_and_drains_it_before_unloading(monkeypatch):
    sent, models, worker = asyncio.run(_deploy_then_unload(monkeypatch))
    states = [(m.state, m.progress) if isinstance(m, ModelState) else [r["name"] for r in m.models] for m in sent]
    assert states[:2] == [("pulling", 0.0), ("pulling", 0.5)]
    assert states[2:] == [("loading", 0.0), ("loading", 0.5), ["own", NAME], ("serving", 0.0), ["own"],
                          ("draining", 0.0), ("unloaded", 0.0)]
    assert isinstance(sent[4], Models) and sent[4].lanes == 6  # its own 4 lanes and the deployed 2
    assert worker.submitted == ["g1"] and worker.stopped


def test_a_model_that_does_not_fit_is_refused_with_the_figures():
    with pytest.raises(DeployRefused, match=r"not enough memory for 2 lanes of 8,192 tokens: .*GB of RAM available"):
        deployed_window(Path(bundled_model_path()), lanes=2, context=8192, available=300_000_000)
    assert deployed_window(Path(bundled_model_path()), lanes=2, context=0, available=64_000_000_000) == 8192
    assert ModelPhase.SERVING == "serving"


@pytest.mark.django_db
def test_the_admin_adds_a_deployment_and_lists_each_pairs_state(client):
    model = registry_model()
    node = NodeFactory(identity="gpu-1", labels={"gpu": "a100"})
    client.force_login(UserFactory(username="operator"))
    form = client.get("/admin/nodes/deployment/add/").content.decode()
    assert 'type="checkbox" name="nodes" value="gpu-1"' in form  # the nodes are choices, not JSON to type
    added = client.post("/admin/nodes/deployment/add/", {"model": model.pk, "labels": "gpu=a100",
                                                         "lanes": "2", "context": "0"})
    assert added.status_code == 302, added.content.decode()[-2000:]
    assert deployments.node_deployments(node_id=node.pk) == [{"name": NAME, "sha256": "ab" * 32, "lanes": 2,
                                                              "context": 0}]
    deployments.node_model_record(node_id=node.pk, model=NAME, state="pulling", progress=0.43)
    assert "gpu-1: pulling 43%" in client.get("/admin/nodes/deployment/").content.decode()
    deployments.node_model_record(node_id=node.pk, model=NAME, state="loading", progress=0.4)
    assert "gpu-1: loading 40%" in client.get("/admin/nodes/deployment/").content.decode()
    deployments.node_model_record(node_id=node.pk, model=NAME, state="serving")
    node.state = "offline"
    node.save()
    assert "gpu-1: serving (node offline)" in client.get("/admin/nodes/deployment/").content.decode()
    refused = client.post("/admin/nodes/deployment/add/", {"model": model.pk, "labels": "", "lanes": "2",
                                                           "context": "0"})
    assert "choose the nodes" in refused.content.decode()
    garbled = client.post("/admin/nodes/deployment/add/", {"model": model.pk, "labels": "gpu", "lanes": "2",
                                                           "context": "0"})
    assert "write each label as key=value" in garbled.content.decode()
    by_name = client.post("/admin/nodes/deployment/add/", {"model": registry_model("other").pk, "nodes": ["gpu-1"],
                                                           "labels": "", "lanes": "2", "context": "0"})
    assert by_name.status_code == 302 and deployments.Deployment.objects.get(model__name="other").nodes == ["gpu-1"]


@pytest.mark.django_db
def test_deleting_a_deployed_registry_model_tells_every_online_node(monkeypatch, django_capture_on_commit_callbacks):
    from nodes import registry

    told = []
    monkeypatch.setattr(deployments, "tell_nodes", told.extend)
    model, node = registry_model(), NodeFactory(identity="a")
    deployments.deployment_create(model=model, nodes=["a"], labels={})
    deployments.node_model_record(node_id=node.pk, model=NAME, state="serving")
    with django_capture_on_commit_callbacks(execute=True):
        registry.model_delete(model=model)
    assert told == [str(node.pk)]
    assert deployments.node_deployments(node_id=node.pk) == []
    deployments.node_model_record(node_id=node.pk, model=NAME, state="unloaded")  # the pair goes with it
    assert not NodeModel.objects.exists()


def test_placement_follows_a_nodes_new_model_list_and_keeps_the_lanes_it_placed():
    """On whichever state this run uses (in process, or Redis with REDIS_URL): the name a node loaded is placed there,
    the lane taken before stays taken, and an unloaded name is placed there no more."""
    from fleet.links import registry
    from nodes.link.placement import NodeSlot

    placement = registry().placement
    placement.node_up(NodeSlot("n1", "gpu-1", ["smollm2"], 2))
    assert placement.choose("smollm2", [], gen_id="g1") is not None
    placement.node_models("n1", ["smollm2", NAME], 4)
    assert placement.choose(NAME, [], gen_id="g2").node_id == "n1"
    assert (placement.nodes()[0].lanes, placement.nodes()[0].running) == (4, 2)
    placement.node_models("n1", ["smollm2"], 2)
    assert placement.choose(NAME, [], gen_id="g3") is None and placement.models() == ["smollm2"]


def test_the_heartbeat_carries_each_models_own_engine_figures_and_an_older_one_still_decodes():
    import msgpack

    from nodes.agent.dialer import heartbeat_of
    from nodes.link.messages import PROTOCOL_VERSION, Heartbeat, decode, encode

    class Busy(FakeWorker):
        def info(self):
            return {**super().info(), "context_window": 4096}

        def stats(self):
            return {"lanes": self.lanes, "lanes_busy": self.lanes, "kv_used": 10, "kv_total": 100 * self.lanes,
                    "tokens_per_s": 7.5}

    models = ModelSet(Busy("own", lanes=4))
    models.add("deployed", FakeWorker("deployed", lanes=8))
    beat = decode(encode(heartbeat_of(models.stats(), engine_ready=True)))
    assert (beat.lanes, beat.lanes_busy, beat.kv_total) == (12, 4, 400)  # the node's totals, as before
    assert beat.models == {"own": {"lanes": 4, "lanes_busy": 4, "kv_used": 10, "kv_total": 400, "tokens_per_s": 7.5,
                                   "context_window": 4096},
                           "deployed": {"lanes": 8, "lanes_busy": 0, "kv_used": 0, "kv_total": 0, "tokens_per_s": 0,
                                        "context_window": 1024,  # the window its own lanes run with
                                        "idle_s": 0.0}}  # since it last ran a generation (on-demand keep-alive)
    older = msgpack.packb({"t": "heartbeat", "v": PROTOCOL_VERSION, "lanes_busy": 1, "lanes": 4})
    assert decode(older) == Heartbeat(lanes_busy=1, lanes=4)
