"""Deployments on the head's end of the link, in process: a node that joins later gets what its deployments say, a
changed deployment reaches a linked node at once, and what the node answers (models, model_state) moves placement
and each pair's state."""

from dataclasses import replace

import pytest
from asgiref.sync import sync_to_async

from fleet.links import registry
from nodes import deployments
from nodes.link.messages import Deploy, Models, ModelState
from nodes.models import Model, NodeModel
from tests.test_node_consumer import REGISTER, _disconnect_all, _local_token, joined  # noqa: F401 - fixtures

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

NAME = "qwen-tiny"


def _model() -> Model:
    return Model.objects.create(name=NAME, sha256="ab" * 32, size=1000, architecture="llama", quantization="Q8_0",
                                context_length=8192, kv_bytes_per_token=23040)


async def test_a_node_that_joins_later_gets_its_deployments_and_one_without_the_label_gets_none():
    model = await sync_to_async(_model)()
    await sync_to_async(deployments.deployment_create)(model=model, nodes=[], labels={"gpu": "a100"}, lanes=2)
    comm, channel = await joined(register=replace(REGISTER, labels={"gpu": "a100", "zone": "eu"}))
    deploy = channel.open(await comm.receive_from(timeout=5))
    assert isinstance(deploy, Deploy)
    assert deploy.models == [{"name": NAME, "sha256": "ab" * 32, "lanes": 2, "context": 0}]
    other, _ = await joined(register=replace(REGISTER, identity="cpu-1", labels={}))
    assert await other.receive_nothing(timeout=0.3)


async def test_a_changed_deployment_reaches_the_linked_node_and_its_answers_move_placement_and_the_pair():
    model = await sync_to_async(_model)()
    comm, channel = await joined()
    assert await comm.receive_nothing(timeout=0.3)  # registered, with nothing deployed here yet
    await sync_to_async(deployments.deployment_create)(model=model, nodes=["gpu-7"], labels={}, lanes=2)
    deploy = channel.open(await comm.receive_from(timeout=5))
    assert isinstance(deploy, Deploy) and [m["name"] for m in deploy.models] == [NAME]
    await comm.send_to(bytes_data=channel.seal(ModelState(model=NAME, state="pulling", progress=0.43)))
    await comm.send_to(bytes_data=channel.seal(Models(models=[{"name": "smollm2", "context_window": 4096, "lanes": 4},
                                                              {"name": NAME, "context_window": 1024, "lanes": 2}],
                                                      lanes=6, context_window=4096)))
    await comm.send_to(bytes_data=channel.seal(ModelState(model=NAME, state="serving")))
    assert await comm.receive_nothing(timeout=0.5)  # (the frames were read in order before this returned)
    assert registry().placement.models() == sorted(["smollm2", NAME])
    pair = await NodeModel.objects.select_related("node").aget(model=NAME)
    assert (pair.node.identity, pair.describe(), pair.node.models_served) == ("gpu-7", "serving", ["smollm2", NAME])
