"""A node's lanes, busy lanes, tokens/s and each model's window, as every page and API shows them: the live fleet page
(its snapshot and its first render), the node's page, /api/nodes/, /api/fleet/ and /metrics read one computation
(nodes.selectors.node_figures), so they agree for a node that serves several models.

The node is driven through a real link (the node-link consumer) with the messages a node sends: it joins with its own
`--model` (4 lanes of 8,192 tokens), then loads a deployed model (4 lanes of 2,048) and an on-demand one (2 lanes of
1,024), and heartbeats while five lanes stream."""

import asyncio
import dataclasses
import re

import pytest
from asgiref.sync import sync_to_async
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from nodes.link.messages import Heartbeat, Models
from tests.factories import UserFactory
from tests.test_fleet_live import node_named, snapshot_where, staff_page
from tests.test_node_consumer import (  # noqa: F401 - the fixtures apply here too
    REGISTER,
    _disconnect_all,
    _local_token,
    joined,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

OWN = {"name": "smollm2", "context_window": 8192, "lanes": 4}
DEPLOYED = {"name": "dep-m", "context_window": 2048, "lanes": 4}
ON_DEMAND = {"name": "od-m", "context_window": 1024, "lanes": 2}
# What the node's engines said (nodes.agent.model_set.ModelSet.stats): each model's own, and the node's sums
PER_MODEL = {
    "smollm2": {"lanes": 4, "lanes_busy": 4, "kv_used": 900, "kv_total": 32768, "tokens_per_s": 40.0,
                "context_window": 8192},
    "dep-m": {"lanes": 4, "lanes_busy": 1, "kv_used": 100, "kv_total": 8192, "tokens_per_s": 10.5,
              "context_window": 2048, "idle_s": 0.0},
    "od-m": {"lanes": 2, "lanes_busy": 0, "kv_used": 0, "kv_total": 2048, "tokens_per_s": 0.0,
             "context_window": 1024, "idle_s": 3.0},
}
BEAT = Heartbeat(lanes_busy=5, lanes=10, kv_used=1000, kv_total=43008, tokens_per_s=50.5, models=PER_MODEL)
# what every surface must show: the node's (busy, lanes) and each model's (lanes, busy, window)
NODE = (5, 10)
MODELS = {"smollm2": (4, 4, 8192), "dep-m": (4, 1, 2048), "od-m": (2, 0, 1024)}


async def three_model_node():
    node, channel = await joined(register=dataclasses.replace(REGISTER, models=[OWN], lanes=4, context_window=8192))
    await node.send_to(bytes_data=channel.seal(Models(models=[OWN, DEPLOYED, ON_DEMAND], lanes=10,
                                                      context_window=8192)))
    await node.send_to(bytes_data=channel.seal(BEAT))
    return node


def staff_client() -> Client:
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


def cells(html: str, table_id: str) -> list[list[str]]:
    """The text of each body row's cells of the table with this id."""
    body = html.split(f'id="{table_id}"')[1].split("</table>")[0].split("<tbody>")[1]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)] for row in rows]


def pages(node_id: str) -> dict:
    """What the HTTP surfaces show, read as a staff user."""
    client = staff_client()
    node_page = client.get(f"/admin/nodes/node/{node_id}/change/").content.decode()
    overview = client.get("/admin/fleet/").content.decode()
    scraped = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").content.decode())}
    return {"node_page": node_page, "overview": overview, "metrics": scraped,
            "nodes": client.get("/api/nodes/").json()["results"], "fleet": client.get("/api/fleet/").json()}


def gauge(families: dict, name: str, model: str) -> float:
    return next(s.value for s in families[name].samples if s.labels == {"model": model, "node": "gpu-7"})


async def test_a_node_serving_three_models_shows_the_same_lanes_everywhere():
    page = await staff_page()
    node = await three_model_node()
    frame = await snapshot_where(page, lambda f: (node_named(f, "gpu-7") or {}).get("tokens_per_s"))
    row = node_named(frame, "gpu-7")
    shown = await sync_to_async(pages)(row["id"])

    # the live page: the node's row, the top card, the Models table
    assert (row["lanes_busy"], row["lanes"]) == NODE
    assert (frame["totals"]["lanes_busy"], frame["totals"]["lanes_total"]) == NODE
    assert {m["name"]: (m["lanes"], m["busy"]) for m in frame["models"]} == {k: v[:2] for k, v in MODELS.items()}
    assert {name: (f["lanes"], f["lanes_busy"], f["context_window"]) for name, f in row["per_model"].items()} == MODELS
    assert row["tokens_per_s"] == 50.5  # the current rate while lanes stream
    # its first render, before the socket's snapshot
    assert re.search(r'id="card-lanes">5 / 10<', shown["overview"])
    node_row = next(r for r in cells(shown["overview"], "fleet-nodes") if r[0] == "gpu-7")
    assert node_row[3] == "5 / 10" and node_row[6] == "50.5"
    assert {r[0]: (int(r[2]), int(r[3])) for r in cells(shown["overview"], "fleet-models")} == {
        k: v[:2] for k, v in MODELS.items()}

    # the node's page: its heartbeat line and its Models table, each model with the window its lanes run with
    assert "Last heartbeat: 5 / 10 lanes busy" in shown["node_page"]
    table = {r[0]: (int(r[3]), int(r[4]), int(r[2])) for r in cells(shown["node_page"], "node-models")}
    assert table == MODELS

    # /api/nodes/
    (api_node,) = shown["nodes"]
    assert (api_node["lanes_busy"], api_node["lanes"]) == NODE
    assert {m["name"]: (m["lanes"], m["lanes_busy"], m["context_window"]) for m in api_node["models"]} == MODELS

    # /api/fleet/: each model's own lanes, not the node's repeated for each
    assert shown["fleet"]["lanes_total"] == NODE[1] and shown["fleet"]["nodes"][0]["lanes"] == NODE[1]
    assert {m["name"]: m["lanes"] for m in shown["fleet"]["models"]} == {k: v[0] for k, v in MODELS.items()}

    # /metrics
    for name, (lanes, busy, _) in MODELS.items():
        assert (gauge(shown["metrics"], "fleet_lanes", name), gauge(shown["metrics"], "fleet_lanes_busy", name)) \
            == (lanes, busy)
    await node.disconnect()
    await page.disconnect()


async def test_a_model_the_head_renamed_shows_the_figures_its_engine_reports(settings):
    """The head serves the node's model under its own name (another node serves the same file as `chat`); the
    node's heartbeat names it as the node knows it, and its figures still show under the fleet's name."""
    from nodes.models import Node
    from tests.factories import NodeFactory

    file = "d" * 64
    await sync_to_async(NodeFactory)(identity="chat-host", models_served=["chat"], model_files={"chat": file},
                                     state=Node.State.ONLINE, lanes=8)
    page = await staff_page()
    node, channel = await joined(register=dataclasses.replace(REGISTER, models=[OWN | {"file": file}], lanes=4,
                                                              context_window=8192))
    await node.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=4, lanes=4, kv_used=900, kv_total=32768,
                                                         tokens_per_s=40.0, models={"smollm2": PER_MODEL["smollm2"]})))
    frame = await snapshot_where(page, lambda f: (node_named(f, "gpu-7") or {}).get("tokens_per_s"))
    row = node_named(frame, "gpu-7")
    assert row["models"] == ["chat"]
    assert {name: (f["lanes"], f["lanes_busy"], f["context_window"]) for name, f in row["per_model"].items()} == {
        "chat": (4, 4, 8192)}
    assert frame["models"] == [{"name": "chat", "nodes": 2, "lanes": 4 + 8, "busy": 4, "waiting": 0}]  # the other's
    await node.disconnect()
    await page.disconnect()


async def test_before_its_first_heartbeat_a_node_shows_the_lanes_of_every_model_it_loaded():
    node, channel = await joined(register=dataclasses.replace(REGISTER, models=[OWN], lanes=4, context_window=8192))
    await node.send_to(bytes_data=channel.seal(Models(models=[OWN, DEPLOYED, ON_DEMAND], lanes=10,
                                                      context_window=8192)))
    from nodes.models import Node

    async def announced():
        while (await Node.objects.aget(identity="gpu-7")).models_served != ["smollm2", "dep-m", "od-m"]:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(announced(), 10)
    from fleet.selectors import fleet_overview

    overview = await sync_to_async(fleet_overview)()
    assert (overview["lanes_busy"], overview["lanes_total"]) == (0, 10)
    (api_node,) = (await sync_to_async(pages)(str((await Node.objects.aget(identity="gpu-7")).pk)))["nodes"]
    assert (api_node["lanes_busy"], api_node["lanes"]) == (None, 10)
    await node.disconnect()
