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
    from nodes.link.placement import NodeSlot

    prefix = f"fleet-rt-{uuid.uuid4().hex[:8]}:"
    here, there = (RedisPlacementState(os.environ["REDIS_URL"], prefix=prefix) for _ in range(2))
    there.node_up(NodeSlot("a", "node-a", ["m"], 1))
    assert there.choose("m", [], gen_id="g1").node_id == "a"
    lanes = LaneSignal(here.aio.free_lanes, listen=here.aio.listen)
    key = (False, 1.0, "g2")
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
