"""What a node runs on (issue 47), from its register and heartbeats to what the operator sees: the Node row, the admin's
node list and page, the live page's snapshot, /api/nodes/ and /metrics. A real link in process (Channels'
communicator through the Noise handshake), and an older node that sends no device."""

from __future__ import annotations

import dataclasses

import pytest
from asgiref.sync import sync_to_async
from prometheus_client.parser import text_string_to_metric_families

from nodes.link.messages import Heartbeat, Register
from nodes.models import Node
from tests.factories import UserFactory
from tests.test_node_consumer import (  # noqa: F401  (the autouse fixtures: the local token, sockets closed)
    _beat_of,
    _disconnect_all,
    _fleet_log_reaches_caplog,
    _local_token,
    joined,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

H100 = {"name": "NVIDIA H100 80GB", "total": 79_600_000_000, "free": 61_200_000_000}
CUDA = {"backend": "cuda", "devices": [H100], "layers": 33, "layers_total": 33, "host_gpus": ["NVIDIA H100 80GB"]}
REGISTER = Register(identity="gpu-1", models=[{"name": "smollm2", "context_window": 4096}], lanes=4,
                    context_window=4096, capabilities={"chat": True}, engine="llama.cpp", engine_version="0.3.36",
                    version="t", device=CUDA)
METRICS_TOKEN = "scrape-secret-device"


@pytest.fixture
def staff(client, settings):
    settings.FLEET_METRICS_TOKEN = METRICS_TOKEN
    client.force_login(UserFactory(username="operator"))
    return client


async def _get(client, path: str, **headers):
    response = await sync_to_async(client.get)(path, **headers)
    assert response.status_code == 200, response.content[:300]
    return response


async def _metrics(client) -> dict:
    response = await _get(client, "/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}")
    return {f.name: f for f in text_string_to_metric_families(response.content.decode())}


def _value(families: dict, family: str, **labels) -> float | None:
    return next((s.value for s in families[family].samples if s.name == family and s.labels == labels), None)


async def _api_node(client, identity: str) -> dict:
    rows = (await _get(client, "/api/nodes/")).json()["results"]
    return next(row for row in rows if row["identity"] == identity)


async def test_a_gpu_nodes_device_reaches_its_row_the_pages_the_api_and_metrics(staff):
    comm, channel = await joined(register=REGISTER)
    node = await Node.objects.aget(identity="gpu-1")
    assert node.device == CUDA  # stored as it registered
    line = "CUDA: NVIDIA H100 80GB, 33/33 layers, 61.2 of 79.6 GB free"
    device = (await _api_node(staff, "gpu-1"))["device"]
    assert device["backend"] == "cuda" and device["line"] == line and device["cpu_fallback"] is False

    # a heartbeat brings the GPU's memory now: the API, the pages and /metrics show it, not the registered figure
    beat_device = {**CUDA, "devices": [{**H100, "free": 20_000_000_000}]}
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=1, lanes=4, device=beat_device)))
    await _beat_of(str(node.pk))
    now = "CUDA: NVIDIA H100 80GB, 33/33 layers, 20.0 of 79.6 GB free"
    assert (await _api_node(staff, "gpu-1"))["device"]["line"] == now
    page = (await _get(staff, f"/admin/nodes/node/{node.pk}/change/")).content.decode()
    assert f'<p id="node-device">{now}</p>' in page
    assert line in (await _get(staff, "/admin/nodes/node/")).content.decode()  # the list: as registered

    from fleet.selectors import fleet_live

    live = await sync_to_async(fleet_live)(waiting={})
    row = next(n for n in live["nodes"] if n["identity"] == "gpu-1")
    assert row["device"] == now and row["device_backend"] == "cuda" and row["cpu_fallback"] is False

    got = await _metrics(staff)
    assert _value(got, "fleet_node_info", node="gpu-1", backend="cuda") == 1
    memory = {"node": "gpu-1", "index": "0", "device": "NVIDIA H100 80GB"}
    assert _value(got, "fleet_node_device_memory_bytes", **memory, kind="free") == 20_000_000_000
    assert _value(got, "fleet_node_device_memory_bytes", **memory, kind="total") == 79_600_000_000
    assert _value(got, "fleet_node_layers_offloaded", node="gpu-1") == 33
    assert _value(got, "fleet_node_layers", node="gpu-1") == 33
    assert _value(got, "fleet_node_cpu_fallback", node="gpu-1") == 0


async def test_a_node_on_the_cpu_beside_a_gpu_is_flagged_on_its_page_in_the_api_and_metrics(staff):
    cpu = {"backend": "cpu", "devices": [], "layers": 0, "layers_total": 31, "host_gpus": ["NVIDIA L4"]}
    await joined(register=dataclasses.replace(REGISTER, identity="cpu-1", device=cpu))
    node = await Node.objects.aget(identity="cpu-1")
    device = (await _api_node(staff, "cpu-1"))["device"]
    assert device["cpu_fallback"] is True and device["line"] == "CPU although the host has NVIDIA L4 (--cpu)"
    page = (await _get(staff, f"/admin/nodes/node/{node.pk}/change/")).content.decode()
    assert "this node does not use its GPU" in page
    got = await _metrics(staff)
    assert _value(got, "fleet_node_cpu_fallback", node="cpu-1") == 1
    assert _value(got, "fleet_node_info", node="cpu-1", backend="cpu") == 1
    assert _value(got, "fleet_node_layers_offloaded", node="cpu-1") == 0


async def test_an_older_node_that_sends_no_device_still_links_and_shows_as_unknown(staff):
    comm, channel = await joined(register=dataclasses.replace(REGISTER, identity="old-1", device={}))
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))
    node = await Node.objects.aget(identity="old-1")
    await _beat_of(str(node.pk))
    assert node.state == Node.State.ONLINE and node.device == {}
    device = (await _api_node(staff, "old-1"))["device"]
    assert device["backend"] == "unknown" and device["line"] == "unknown (the node does not report its device)"
    got = await _metrics(staff)
    assert _value(got, "fleet_node_info", node="old-1", backend="unknown") == 1
    assert _value(got, "fleet_node_cpu_fallback", node="old-1") == 0


async def test_a_damaged_device_report_is_kept_only_as_far_as_it_is_understood(staff):
    odd = {"backend": "quantum", "devices": [{"name": 7}, {"name": "GPU A", "total": -1, "free": "lots"}],
           "layers": True, "layers_total": 33}
    await joined(register=dataclasses.replace(REGISTER, identity="odd-1", device=odd))
    node = await Node.objects.aget(identity="odd-1")
    assert node.device == {"backend": "unknown", "devices": [{"name": "GPU A", "total": 0, "free": 0}], "layers": 0,
                           "layers_total": 33, "host_gpus": []}
