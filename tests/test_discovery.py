"""mDNS: the head announces `_fleet._tcp` with its models, and a node with no address finds it."""

import asyncio

from fleet.discovery import Announcer
from nodes.agent import keys
from nodes.agent.discovery import find_heads
from nodes.link.handshake import make_secret
from tests.live import free_port
from tests.test_head_pin import SECRET, FakeHead, node


def test_a_node_finds_the_announced_head():
    port = free_port()
    announcer = Announcer(port)
    announcer.start(["smollm2"])
    try:
        found = find_heads(timeout=8)
    finally:
        announcer.stop()
    assert any(head.endswith(f":{port}") for head in found), found


def test_no_head_announced_finds_nothing_quickly():
    assert find_heads(timeout=1.5) == []


async def test_an_mdns_announcer_that_is_not_the_head_is_tried_and_left_unpinned(tmp_path):
    """Two announce `_fleet._tcp`: a responder without the token's secret (tried first) and the head. The node
    joins the one that proves the token and pins its key; the impostor's answer leaves nothing behind."""
    async with FakeHead(make_secret(), "refuse") as impostor, FakeHead(SECRET) as head:
        announcers = [Announcer(int(h.address.rsplit(":", 1)[1]), "127.0.0.1") for h in (impostor, head)]
        for announcer in announcers:  # in threads: zeroconf started on a running loop would wait on it
            await asyncio.to_thread(announcer.start, ["smollm2"])
        try:
            found = await asyncio.to_thread(find_heads, 8, 2.0)
        finally:
            for announcer in announcers:
                await asyncio.to_thread(announcer.stop)
        assert {impostor.address, head.address} <= set(found), found
        ordered = sorted(found, key=lambda h: h != impostor.address)  # the impostor first, as if it answered first
        answer = await node(tmp_path, ordered).request_pull("m")
        assert answer is not None and answer[0] == head.address
        assert impostor.frames_3 == 1 and keys.pinned_head(tmp_path) == head.key


def test_a_node_given_no_address_joins_a_daphne_head_found_by_mdns(tmp_path):
    """A production head (daphne, not `manage.py up`) with FLEET_ANNOUNCE set is found by a node with no address."""
    import pytest

    from tests.live import make_head, start_node, wait_for

    port = free_port()
    head = make_head(tmp_path, port=port, extra_env={"FLEET_MDNS": "1", "FLEET_ANNOUNCE": f"127.0.0.1:{port}"})
    head.start()
    node = None
    try:
        node = start_node(head, "--max-batch", "1", identity="found-by-mdns", discover=True)
        head.wait_nodes(1, timeout=180)
        wait_for(lambda: "joined" in node.log(), 30, "no join line")  # logged once Registered arrives
        assert head.address.split(":")[1] in node.log()
    except AssertionError:
        pytest.fail(f"the node did not find the head by mDNS: {node.log() if node else ''}\nhead: {head.log()}")
    finally:
        if node is not None:
            node.stop()
        head.stop()
