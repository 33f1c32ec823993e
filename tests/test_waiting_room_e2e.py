"""The waiting room on a real head: a daphne head of this module's own (on the session's shared one a node whose
model the head does not serve takes the head's only model's name, and the shared head's other tests would place on
it), a mock-engine node of one lane (two for a key that takes a lane from one over its share), keys made in the
head's database."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.live import make_head, wait_for
from tests.mock_node import start_mock_node

MODEL = "waiting-room-mock"
_KEYS = """
import json
from django.contrib.auth import get_user_model
from api.services import api_key_create
admin = get_user_model().objects.get(username="admin")
print(json.dumps({name: api_key_create(owner=admin, name=f"waiting-room {name}", quotas=share)[1]
                  for name, share in {"normal": {}, "high": {"priority": "high"}, "light": {}}.items()}))
"""


def _served(tmp_path_factory, name: str, lanes: int, **env):
    head = make_head(tmp_path_factory.mktemp(name), extra_env=env)
    head.start()
    node = start_mock_node(head, f"{name}-node", model=MODEL, lanes=lanes, decode_tps=20.0)
    served = lambda: MODEL in httpx.get(f"{head.url}/v1/models",  # noqa: E731
                                        headers={"Authorization": f"Bearer {head.api_key}"}).text
    try:
        wait_for(served, 120, f"the mock node never served {MODEL}")
    except AssertionError as exc:  # its log as it stands then, not as it stood when the node started
        node.stop()
        head.stop()
        raise AssertionError(f"{exc}: {node.log()}") from None
    return head, node


@pytest.fixture(scope="module")
def one_lane(tmp_path_factory):
    head, node = _served(tmp_path_factory, "waiting-room", 1)
    yield head
    node.stop()
    head.stop()


@pytest.fixture(scope="module")
def two_lanes_shared(tmp_path_factory):
    """Two lanes, where a key under its share of the `normal` class takes a lane from a key over it."""
    head, node = _served(tmp_path_factory, "share-preempting", 2, FLEET_SHARE_PREEMPTING_CLASSES="normal")
    yield head
    node.stop()
    head.stop()


async def first_token_at(client: httpx.AsyncClient, key: str, tokens: int) -> float:
    return (await streamed(client, key, tokens))[0]


async def streamed(client: httpx.AsyncClient, key: str, tokens: int, content: str = "hello"):
    """When its first token came, when its stream ended, and its text."""
    body = {"model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True, "seed": 7,
            "messages": [{"role": "user", "content": content}]}
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200, await resp.aread()
        at, text = None, ""
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and (piece := json.loads(line[6:])["choices"][0]["delta"].get("content")):
                at, text = at or time.monotonic(), text + piece
        return at, time.monotonic(), text


async def test_a_high_priority_key_gets_the_next_lane_before_normal_ones_that_came_first(one_lane):
    keys = json.loads(one_lane.manage("shell", "-c", _KEYS).stdout.strip().splitlines()[-1])
    async with httpx.AsyncClient(base_url=one_lane.url, timeout=60) as client:
        blocker = asyncio.create_task(first_token_at(client, keys["normal"], 30))  # holds the lane 1.5 s
        await asyncio.sleep(0.5)
        normals = [asyncio.create_task(first_token_at(client, keys["normal"], 4)) for _ in range(3)]
        await asyncio.sleep(0.3)
        high = asyncio.create_task(first_token_at(client, keys["high"], 4))
        await asyncio.gather(blocker, high, *normals)
    assert high.result() < min(n.result() for n in normals)


async def test_a_light_key_takes_a_lane_from_a_flooding_key_whose_answer_goes_on_unchanged(two_lanes_shared):
    keys = json.loads(two_lanes_shared.manage("shell", "-c", _KEYS).stdout.strip().splitlines()[-1])
    async with httpx.AsyncClient(base_url=two_lanes_shared.url, timeout=60) as client:
        floods = [asyncio.create_task(streamed(client, keys["normal"], 30, f"flood {i}")) for i in range(2)]
        await asyncio.sleep(0.5)  # both lanes busy for about 1.5 s more
        light = await streamed(client, keys["light"], 4)
        flooded = await asyncio.gather(*floods)
        alone = [await streamed(client, keys["normal"], 30, f"flood {i}") for i in range(2)]
    assert light[0] < min(end for _, end, _ in flooded)  # it did not wait for a flood's lane to free
    assert [text for _, _, text in flooded] == [text for _, _, text in alone]  # the one it preempted went on exactly
