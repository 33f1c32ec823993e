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
