"""The live fleet page's socket (/ws/fleet/) and what feeds it: staff only, a snapshot on connect and after each
change a node makes (join, heartbeat, leave), throttled pushes, and the link history those changes write."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from fleet import live, names
from nodes.link.messages import Heartbeat
from nodes.models import LinkEvent
from nodes.services import fleet_token_create, fleet_token_revoke
from tests.test_node_consumer import (  # noqa: F401 - the fixtures apply here too
    LOCAL_TOKEN,
    _disconnect_all,
    _local_token,
    _refused,
    closed_with,
    communicator,
    handshake,
    joined,
)
from tests.test_playground import session_cookie

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


async def page_socket(cookie=None, origin="http://testserver") -> WebsocketCommunicator:
    from fleet.asgi import application

    headers = [(b"host", b"testserver")] + ([(b"cookie", cookie.encode())] if cookie else [])
    headers += [(b"origin", origin.encode())] if origin else []
    comm = WebsocketCommunicator(application, "/ws/fleet/", headers=headers)
    assert (await comm.connect())[0]
    return comm


async def staff_page() -> WebsocketCommunicator:
    return await page_socket(await sync_to_async(session_cookie)(is_staff=True))


async def snapshot_where(comm, predicate, *, frames: int = 20) -> dict:
    """The first pushed snapshot that satisfies `predicate` (earlier ones may predate the change)."""
    for _ in range(frames):
        frame = await comm.receive_json_from(timeout=5)
        assert frame["type"] == "fleet", frame
        if predicate(frame):
            return frame
    raise AssertionError("no pushed snapshot showed the change")


def node_named(frame: dict, identity: str) -> dict | None:
    return next((n for n in frame["nodes"] if n["identity"] == identity), None)


@pytest.mark.parametrize("user_fields, origin, code, words", [
    (None, "http://testserver", 4401, "log in"),
    ({"is_staff": False}, "http://testserver", 4403, "only staff"),
    ({"is_staff": True}, "http://evil.example", 4403, "this site's own pages"),
])
async def test_the_page_socket_takes_only_a_staff_session_from_this_site(user_fields, origin, code, words):
    cookie = await sync_to_async(session_cookie)(**user_fields) if user_fields else None
    comm = await page_socket(cookie, origin)
    error = await comm.receive_json_from(timeout=3)
    assert error["type"] == "error" and words in error["message"]
    closed = await comm.receive_output(timeout=3)
    assert closed == {"type": "websocket.close", "code": code, "reason": error["message"]}
    await comm.disconnect()


async def test_a_node_joining_heartbeating_and_leaving_is_pushed_to_an_open_page():
    page = await staff_page()
    first = await page.receive_json_from(timeout=5)
    assert first["type"] == "fleet" and first["seq"] == 1 and first["nodes"] == []

    node, channel = await joined()
    frame = await snapshot_where(page, lambda f: node_named(f, "gpu-7"))
    assert node_named(frame, "gpu-7")["state"] == "online"
    assert frame["models"] == [{"name": "smollm2", "nodes": 1, "lanes": 4, "busy": 0, "waiting": 0}]

    await node.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=3, lanes=4, kv_used=512, kv_total=2048,
                                                         tokens_per_s=12.5)))
    frame = await snapshot_where(page, lambda f: node_named(f, "gpu-7")["tokens_per_s"])
    shown = node_named(frame, "gpu-7")
    assert (shown["lanes_busy"], shown["kv_used"], shown["kv_total"]) == (3, 512, 2048)
    assert [tps for _, tps in shown["history"]] == [12.5]

    await node.disconnect()
    frame = await snapshot_where(page, lambda f: node_named(f, "gpu-7")["state"] == "offline")
    assert frame["models"] == [] and frame["totals"]["online"] == 0
    assert [f["seq"] for f in (first, frame)] == sorted({first["seq"], frame["seq"]})
    await page.disconnect()


async def test_a_node_pulling_and_loading_a_deployed_model_is_pushed_with_its_progress():
    from nodes.link.messages import ModelState
    from nodes.models import Model

    await Model.objects.acreate(name="qwen-tiny", sha256="ab" * 32, size=1000, architecture="llama",
                                quantization="Q8_0", context_length=8192, kv_bytes_per_token=23040)
    node, channel = await joined()
    page = await staff_page()
    await snapshot_where(page, lambda f: node_named(f, "gpu-7"))
    for state, progress, shown in [("pulling", 0.43, 43), ("loading", 0.5, 50)]:
        await node.send_to(bytes_data=channel.seal(ModelState(model="qwen-tiny", state=state, progress=progress)))
        frame = await snapshot_where(page, lambda f, s=state: node_named(f, "gpu-7")["preparing"]
                                     and node_named(f, "gpu-7")["preparing"][0]["state"] == s)
        assert node_named(frame, "gpu-7")["preparing"] == [
            {"model": "qwen-tiny", "state": state, "progress": progress, "percent": shown}]
    await node.send_to(bytes_data=channel.seal(ModelState(model="qwen-tiny", state="serving")))
    await snapshot_where(page, lambda f: node_named(f, "gpu-7")["preparing"] == [])
    await page.disconnect()
    await node.disconnect()


async def say_preparing(state: str, progress: float, key=None) -> int:
    """A node's `preparing` report, sent as node_join sends it before it joins; the close code the head answers."""
    from nodes.link.messages import Preparing
    from tests.test_node_consumer import NODE_KEY

    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm, key=key or NODE_KEY)
    await comm.send_to(bytes_data=channel.seal(Preparing(identity="gpu-7", model="smollm2", state=state,
                                                         progress=progress)))
    return await closed_with(comm)


async def test_a_node_pulling_and_loading_its_own_model_before_it_joins_shows_on_an_open_page():
    from nodes.link.noise import generate_static

    page = await staff_page()
    assert (await page.receive_json_from(timeout=5))["nodes"] == []
    for state, progress in [("pulling", 0.25), ("loading", 0.5)]:
        assert await say_preparing(state, progress) == 1000
        frame = await snapshot_where(page, lambda f, s=state: node_named(f, "gpu-7")
                                     and node_named(f, "gpu-7")["preparing"][0]["state"] == s)
        shown = node_named(frame, "gpu-7")
        assert (shown["state"], shown["url"], shown["preparing"]) == ("joining", "", [
            {"model": "smollm2", "state": state, "progress": progress, "percent": int(progress * 100)}])
    node, _ = await joined()  # it registers: in the fleet now, on its way in no longer
    await snapshot_where(page, lambda f: node_named(f, "gpu-7")["state"] == "online")
    assert await say_preparing("pulling", 0.9, key=generate_static()) == 4004  # not under another node's name
    await node.disconnect()
    frame = await snapshot_where(page, lambda f: node_named(f, "gpu-7")["state"] == "offline")
    assert [(n["identity"], n["preparing"]) for n in frame["nodes"]] == [("gpu-7", [])]
    await page.disconnect()


async def test_the_page_sums_every_processs_waiting_generations_per_priority_and_key():
    page = await staff_page()
    await page.receive_json_from(timeout=5)
    for process, classes in (("one", {"priority": {"high": 1, "normal": 2}, "key": {"fk-a": 3}}),
                             ("two", {"priority": {"normal": 1}, "key": {"fk-a": 1}})):
        await get_channel_layer().group_send(names.fleet_page_group(), {
            "type": "fleet.changed", "process": process, "waiting": {"smollm2": 1}, "classes": classes})
    frame = await snapshot_where(page, lambda f: f["totals"]["waiting_by_key"].get("fk-a") == 4)
    assert frame["totals"]["waiting_by_priority"] == {"high": 1, "normal": 3}
    await page.disconnect()


async def test_a_burst_of_changes_is_one_push_now_and_one_at_the_end_of_the_interval():
    layer = get_channel_layer()
    watcher = await layer.new_channel()
    await layer.group_add(names.fleet_page_group(), watcher)
    live.fleet_changed()
    first = await asyncio.wait_for(layer.receive(watcher), 5)  # at once
    for _ in range(100):  # within the interval that just began
        live.fleet_changed()
    second = await asyncio.wait_for(layer.receive(watcher), 5)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(layer.receive(watcher), live.GROUP_EVERY_S * 2)
    assert first == second == {"type": "fleet.changed", "process": live.PROCESS_ID, "waiting": {},
                               "classes": {"priority": {}, "key": {}}}
    await layer.group_discard(names.fleet_page_group(), watcher)


async def test_joins_refusals_and_drops_are_the_nodes_link_history():
    token, secret = await sync_to_async(fleet_token_create)(name="history")
    node, _ = await joined(token=secret)
    await sync_to_async(fleet_token_revoke)(token=token)
    await node.receive_output(timeout=5)  # the revocation closes the link
    await node.disconnect()
    assert await _refused(secret) == 4006
    rows = await sync_to_async(lambda: list(LinkEvent.objects.order_by("created_at").values_list(
        "identity", "kind", "code", "node__identity")))()
    assert rows == [("gpu-7", "joined", None, "gpu-7"), ("gpu-7", "refused", 4006, "gpu-7"),
                    ("gpu-7", "dropped", 4006, "gpu-7"), ("", "refused", 4006, None)]  # dropped as the head closed it
    assert LOCAL_TOKEN  # the local token fixture stays in force for joined()'s default
