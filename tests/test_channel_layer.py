"""The Redis channel layer between head processes holds up under hundreds of sends at once."""

from __future__ import annotations

import asyncio
import os

import pytest
from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")


async def test_hundreds_of_sends_at_once_each_get_a_connection():
    """redis-py 8 caps an asyncio pool at 100 connections, and each send in flight holds one: two heads at 1,000
    streams raised MaxConnectionsError. The layer's pool is sized for the head's bursts."""
    layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)  # as configured; not the shared one, whose locks an
    try:  # earlier test's event loop may hold
        channel = await layer.new_channel()
        await asyncio.gather(*(layer.send(channel, {"type": "burst", "n": n}) for n in range(400)))
        received = [await layer.receive(channel) for _ in range(400)]
        assert sorted(m["n"] for m in received) == list(range(400))
    finally:
        await layer.close_pools()



async def test_the_head_parses_redis_replies_in_c():
    """Without hiredis, redis-py parses every reply in Python: at 500 streams on two heads that held a fifth of each
    head's time (docs/benchmarks.md, Scale). The project's install brings it, and the head's clients use it."""
    from redis._parsers import _AsyncHiredisParser

    from fleet.links import registry

    pool = registry().placement._async_client()[0].connection_pool
    connection = pool.connection_class(**pool.connection_kwargs)
    assert isinstance(connection._parser, _AsyncHiredisParser)
    assert await registry().aplacement.nodes() is not None  # that client, answering through it
