"""The placement and lifecycle tests again, on the placement state several head processes share through Redis."""

import os
import uuid

import pytest

import tests.test_placement as base
from tests.test_placement import *  # noqa: F403 - the same tests, collected here against Redis

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")


@pytest.fixture(autouse=True)
def redis_placement(monkeypatch):
    from fleet.placement_redis import RedisPlacementState

    made = []

    def factory(load_tokens: int | None = None, max_keys: int = 200_000):
        state = RedisPlacementState(os.environ["REDIS_URL"], prefix=f"fleet-rt-{uuid.uuid4().hex[:8]}:",
                                    load_tokens=load_tokens, max_keys=max_keys)
        made.append(state)
        return state

    monkeypatch.setattr(base, "PlacementState", factory)
    yield
    for state in made:
        state.clear()


async def test_a_lane_freed_in_another_head_process_wakes_the_generation_waiting_here():
    """Waiters sleep until an event (no timer): a lane freed by another process arrives on the lanes channel."""
    import asyncio

    from fleet.links import LaneSignal
    from fleet.placement_redis import RedisPlacementState
    from fleet.waiting import RANKS, Waiter
    from nodes.link.placement import NodeSlot

    prefix = f"fleet-rt-{uuid.uuid4().hex[:8]}:"
    here, there = (RedisPlacementState(os.environ["REDIS_URL"], prefix=prefix) for _ in range(2))
    there.node_up(NodeSlot("a", "node-a", ["m"], 1))
    assert there.choose("m", [], gen_id="g1").node_id == "a"
    lanes = LaneSignal(here.aio.free_lanes, listen=here.aio.listen)
    key = Waiter("g2", RANKS["normal"], 1.0)
    lanes.join("m", key)
    while here.r.pubsub_numsub(here.lanes_channel)[0][1] == 0:  # the listener has subscribed
        await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(lanes.wait(key, 3600))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    there.release("a", "g1")
    await asyncio.wait_for(waiting, 30)
    assert await here.aio.free_lanes("m") == 1
    lanes.leave("m", key)
    lanes._listener.cancel()
    here.clear()


def _two_heads():
    from fleet.placement_redis import RedisPlacementState

    prefix = f"fleet-rt-{uuid.uuid4().hex[:8]}:"
    return [RedisPlacementState(os.environ["REDIS_URL"], prefix=prefix) for _ in range(2)]


def test_a_node_linked_to_two_head_processes_has_its_lanes_counted_once():
    from nodes.link.placement import NodeSlot

    a, b = _two_heads()
    try:
        a.node_up(NodeSlot("n", "node", ["m"], 2), head="A")
        assert a.choose("m", [], gen_id="g1", only={"n"}, head="A").node_id == "n"
        b.node_up(NodeSlot("n", "node", ["m"], 2), cache_cleared=False, head="B")  # its second link
        assert b.choose("m", [], gen_id="g2", only={"n"}, head="B").node_id == "n"
        assert b.choose("m", [], gen_id="g3", only={"n"}, head="B") is None  # two lanes, both taken, fleet-wide
        assert set(a.links_of("n")) == {"A", "B"}  # no URLs announced in this test: the processes' ids
        assert b.node_down("n", "B") == 1 and [s.running for s in a.nodes()] == [2]  # A's link still holds it
        a.release("n", "g1")
        assert b.choose("m", [], gen_id="g4", only=set(), head="B") is None  # B places only where it links
        assert a.choose("m", [], gen_id="g4", only={"n"}, head="A").node_id == "n"
        assert a.node_down("n", "A") == 0 and a.nodes() == []
    finally:
        a.clear()


def test_a_dead_head_process_is_reaped_with_the_lanes_and_links_it_held():
    import time

    from nodes.link.placement import NodeSlot

    a, b = _two_heads()
    try:
        a.node_up(NodeSlot("n", "node", ["m"], 2), head="A")
        b.node_up(NodeSlot("n", "node", ["m"], 2), cache_cleared=False, head="B")
        assert a.head_beat("A", "ws://a/ws/node/", 30) == ["ws://a/ws/node/"]
        assert b.head_beat("B", "ws://b/ws/node/", 0.2) == ["ws://a/ws/node/", "ws://b/ws/node/"]
        assert a.links_of("n").keys() == {"ws://a/ws/node/", "ws://b/ws/node/"}
        a.choose("m", [], gen_id="ga", only={"n"}, head="A")
        b.choose("m", [], gen_id="gb", only={"n"}, head="B")
        time.sleep(0.3)  # B's beats stopped (SIGKILL): A's next beat reaps it
        assert a.head_beat("A", "ws://a/ws/node/", 30) == ["ws://a/ws/node/"]
        assert [s.running for s in a.nodes()] == [1] and list(a.links_of("n")) == ["ws://a/ws/node/"]
    finally:
        a.clear()
