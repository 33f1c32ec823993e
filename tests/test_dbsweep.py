"""Websocket frames to the node link and the client stream socket, and their connect, skip Channels' per-message
database sweep (a thread hop each); their other messages are still swept."""

from __future__ import annotations

import pytest

from api.consumers import ClientStreamConsumer
from nodes.consumers import NodeLinkConsumer


@pytest.fixture
def sweeps(monkeypatch):
    swept: list[int] = []

    async def sweep():
        swept.append(1)

    monkeypatch.setattr("channels.consumer.aclose_old_connections", sweep)
    return swept


def handled(consumer, name: str) -> list[dict]:
    got: list[dict] = []

    async def handler(message):
        got.append(message)

    setattr(consumer, name, handler)
    return got


@pytest.mark.parametrize("cls", [NodeLinkConsumer, ClientStreamConsumer])
async def test_a_websocket_frame_is_handled_without_the_sweep(cls, sweeps):
    consumer = cls()
    got = handled(consumer, "websocket_receive")
    frame = {"type": "websocket.receive", "bytes": b"\x00frame"}
    await consumer.dispatch(frame)
    assert got == [frame]
    assert sweeps == []


@pytest.mark.parametrize("cls", [NodeLinkConsumer, ClientStreamConsumer])
async def test_the_connect_is_handled_without_the_sweep(cls, sweeps):
    consumer = cls()
    got = handled(consumer, "websocket_connect")
    message = {"type": "websocket.connect"}
    await consumer.dispatch(message)
    assert got == [message]
    assert sweeps == []


@pytest.mark.parametrize("cls", [NodeLinkConsumer, ClientStreamConsumer])
async def test_other_messages_are_still_swept(cls, sweeps):
    consumer = cls()
    got = handled(consumer, "websocket_disconnect")
    message = {"type": "websocket.disconnect", "code": 1000}
    await consumer.dispatch(message)
    assert got == [message]
    assert sweeps == [1]
