"""The node agent's dialer on its own: when it redials, and when it tells the head its engine is down or back."""

import asyncio

import pytest
from websockets.exceptions import ConnectionClosedError

from nodes.agent.dialer import AgentConfig, NodeAgent
from nodes.link.handshake import LOCAL_TOKEN_ID, format_token, make_secret
from nodes.link.messages import Bundle, Heartbeat, TokenBatch, unbundle
from tests.test_link_channel import _connect

pytestmark = pytest.mark.asyncio


class FakeEngine:
    alive = True

    def stats(self):
        return {"lanes": 2, "lanes_busy": 0}


def agent(tmp_path, engine=None) -> NodeAgent:
    config = AgentConfig(head="127.0.0.1:1", token=format_token(LOCAL_TOKEN_ID, make_secret()), home=tmp_path,
                         backoff_start=1.0, backoff_max=16.0)
    return NodeAgent(config, engine or FakeEngine())


async def delays_between(node: NodeAgent, sessions, monkeypatch) -> list[float]:
    """Run the dial loop over scripted sessions ("fail": refused before joining, "drop": joined, then the link
    dropped) and return the pause before each redial, without the jitter."""
    pauses: list[float] = []
    script = iter(sessions)

    async def session(head):
        kind = next(script)
        if kind == "drop":
            node.joined = True
        raise ConnectionClosedError(None, None)

    async def sleep(seconds):
        pauses.append(seconds)
        if len(pauses) == len(sessions):
            raise asyncio.CancelledError

    monkeypatch.setattr(node, "_session", session)
    monkeypatch.setattr("nodes.agent.dialer.asyncio.sleep", sleep)
    monkeypatch.setattr("nodes.agent.dialer.random.random", lambda: 0.5)  # no jitter: factor 1.0
    with pytest.raises(asyncio.CancelledError):
        await node.run()
    return pauses


async def test_the_backoff_doubles_while_dialing_fails_and_starts_over_after_a_session_that_ran(tmp_path, monkeypatch):
    pauses = await delays_between(agent(tmp_path), ["fail", "fail", "fail", "drop", "fail", "fail"], monkeypatch)
    assert pauses == [1.0, 2.0, 4.0, 1.0, 2.0, 4.0]


async def test_the_head_hears_at_once_when_the_engine_goes_down_and_comes_back(tmp_path):
    engine = FakeEngine()
    node = agent(tmp_path, engine)
    node.heartbeat_s = 60.0  # far longer than the test: only a change of the engine's state sends one
    node.outbox = asyncio.Queue()
    task = asyncio.ensure_future(node._heartbeat())
    try:
        first = await asyncio.wait_for(node.outbox.get(), 1)
        assert isinstance(first, Heartbeat) and first.engine_ready is True
        engine.alive = False
        down = await asyncio.wait_for(node.outbox.get(), 1)
        assert down.engine_ready is False
        engine.alive = True
        assert (await asyncio.wait_for(node.outbox.get(), 1)).engine_ready is True
    finally:
        task.cancel()


class FrameSink:
    def __init__(self):
        self.frames: list[bytes] = []

    async def send(self, frame: bytes) -> None:
        self.frames.append(frame)


@pytest.mark.parametrize("bundle", [True, False])
async def test_what_the_outbox_holds_at_once_goes_as_one_bundle_to_a_head_that_takes_them(tmp_path, bundle):
    node = agent(tmp_path)
    node.outbox = asyncio.Queue()
    sent = [TokenBatch(gen_id=f"g{i}", seq=1, text=["x"], ids=[1]) for i in range(5)]
    for msg in sent:  # an engine step's events, put in by one callback
        node.outbox.put_nowait(msg)
    ws, (node_channel, head_channel) = FrameSink(), _connect()
    task = asyncio.ensure_future(node._send(ws, node_channel, bundle))
    try:
        for _ in range(50):
            await asyncio.sleep(0.01)
            if node.outbox.empty():
                break
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
    opened = [head_channel.open(frame) for frame in ws.frames]
    if bundle:
        assert len(opened) == 1 and isinstance(opened[0], Bundle)
        assert [msg for msg, _ in unbundle(opened[0])] == sent
    else:
        assert opened == sent  # an older head: one message a frame


class ClosingSink(FrameSink):
    def __init__(self):
        super().__init__()
        self.closed = None

    async def close(self, code, reason=""):
        self.closed = code

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(3600)  # a head with nothing to say


async def test_a_node_stopped_on_purpose_says_goodbye_and_closes_normally(tmp_path):
    from nodes.link.messages import Bye

    node = agent(tmp_path)
    node.heartbeat_s = 60.0
    ws, (node_channel, head_channel) = ClosingSink(), _connect()
    task = asyncio.ensure_future(node._serve(ws, node_channel))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    opened = [head_channel.open(frame) for frame in ws.frames]
    assert isinstance(opened[-1], Bye) and ws.closed == 1000
