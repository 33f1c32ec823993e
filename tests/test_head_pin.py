"""When the node pins the head's key: only once the head proved it holds the token's secret (its first sealed frame
opened). In Noise_XXpsk3 the PSK enters at message 3, so anything that answers frame 1 sends a valid frame 2 with
its own static key: these responders lack the secret, and must leave no pin on a fresh node home."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from nodes.agent import keys
from nodes.agent.dialer import AgentConfig, HeadLink, NodeAgent, Refused
from nodes.link.codes import CloseCode
from nodes.link.handshake import Responder, TokenRefused, format_token, make_secret
from nodes.link.messages import LinkError, Pull, PullGrant, Register, Registered
from nodes.link.noise import generate_static, public_key
from tests.live import PYTHON, ROOT

SECRET = make_secret()
TOKEN = format_token("a1b2c3d4e5f6", SECRET)
ROGUE_BEHAVIOURS = ["close", "refuse", "garbage"]


class FakeHead:
    """A responder on a real websocket. With the token's secret it answers a pull with a grant and a register with
    `registered`; without it (a rogue: any PSK of its own), message 3 fails and it does `rogue` instead."""

    def __init__(self, psk: bytes, rogue: str = "close"):
        self.psk, self.rogue = psk, rogue
        self.static = generate_static()
        self.key = public_key(self.static)
        self.frames_3 = 0  # frames 3 it received: did a node prove itself to it?
        self.received: list = []  # the nodes' first messages
        self.server = None

    async def __aenter__(self) -> FakeHead:
        self.server = await websockets.serve(self.handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, ws) -> None:
        responder = Responder(self.static)
        try:
            responder.read_hello(await ws.recv())
            await ws.send(responder.respond(self.psk))
            final = await ws.recv()
        except ConnectionClosed:
            return
        self.frames_3 += 1
        try:
            channel = responder.finish(final)
        except TokenRefused:
            await self.misbehave(ws)
            return
        msg = channel.open(await ws.recv())
        self.received.append(msg)
        if isinstance(msg, Pull):
            await ws.send(channel.seal(PullGrant(model=msg.model, sha256="ab" * 32, size=1, path="/x", grant="g")))
        elif isinstance(msg, Register):
            await ws.send(channel.seal(Registered(node_id="n1", model_names=["m"], heartbeat_s=5.0)))
        await ws.close()

    async def misbehave(self, ws) -> None:
        if self.rogue == "refuse":  # a close code the real head uses for a wrong secret: unauthenticated
            await ws.close(int(CloseCode.TOKEN_REFUSED), "token refused")
        elif self.rogue == "garbage":  # a "transport frame" it cannot seal without the PSK
            await ws.send(os.urandom(64))
            await ws.wait_closed()
        else:
            await ws.close()


class FakeEngine:
    alive = True
    warm: list[str] = []  # generations whose parked lanes it restored (`--park`)

    def info(self):
        return {"model_name": "m", "context_window": 512, "lanes": 1, "capabilities": {}, "engine": "mock",
                "engine_version": "0", "warm_generations": self.warm}

    def stats(self):
        return {"lanes": 1}


def node(home, heads) -> NodeAgent:
    config = AgentConfig(head=None, token=TOKEN, home=home, identity="pin-test")
    return NodeAgent(config, FakeEngine(), resolve_head=lambda: heads)


@pytest.mark.parametrize("rogue", ROGUE_BEHAVIOURS)
async def test_a_responder_without_the_token_leaves_no_pin_on_a_fresh_node(tmp_path, rogue):
    async with FakeHead(make_secret(), rogue) as head:
        agent = node(tmp_path, head.address)
        if rogue == "refuse":  # its refusal is believed (it is the only head), but it pinned nothing
            with pytest.raises(Refused) as refused:
                await agent.request_pull("m")
            assert refused.value.proven is False
        else:
            assert await agent.request_pull("m") is None
        with pytest.raises((Refused, LinkError, ConnectionClosed)):
            await agent._session(HeadLink(head.address))  # the register path: the same proof
        assert head.frames_3 == 2  # the node went as far as message 3 (which proves the node, not the head)
    assert keys.pinned_head(tmp_path) is None
    assert not keys.head_pin_path(tmp_path).exists()


async def test_a_head_with_the_token_is_pinned_once_its_first_sealed_frame_opens(tmp_path):
    async with FakeHead(SECRET) as head:
        agent = node(tmp_path, head.address)
        answer = await agent.request_pull("m")
    assert answer is not None and answer[1].grant == "g"
    assert keys.pinned_head(tmp_path) == head.key


async def test_a_pinned_node_stops_before_proving_itself_to_a_head_with_another_key(tmp_path):
    """Frame 2 under another key proves nothing either way (a new head key, or an impostor): the node sends no
    frame 3, keeps its pin, and says both; with --accept-new-head the new key is pinned only after the proof."""
    pinned = public_key(generate_static())
    keys.pin_head(tmp_path, pinned)
    async with FakeHead(SECRET) as head:
        with pytest.raises(Refused) as refused:
            await node(tmp_path, head.address).request_pull("m")
        assert refused.value.proven is False and "--accept-new-head" in str(refused.value)
        assert "not proved" in str(refused.value)
        assert head.frames_3 == 0 and keys.pinned_head(tmp_path) == pinned
        keys.forget_head(tmp_path)  # --accept-new-head
        async with FakeHead(make_secret()) as rogue:
            assert await node(tmp_path, rogue.address).request_pull("m") is None
        assert keys.pinned_head(tmp_path) is None
        assert await node(tmp_path, head.address).request_pull("m") is not None
    assert keys.pinned_head(tmp_path) == head.key


@pytest.mark.parametrize("rogue", ROGUE_BEHAVIOURS)
async def test_of_the_heads_announced_the_node_joins_and_pins_the_one_that_proves_the_token(tmp_path, rogue):
    async with FakeHead(make_secret(), rogue) as impostor, FakeHead(SECRET) as head:
        answer = await node(tmp_path, [impostor.address, head.address]).request_pull("m")
        assert answer is not None and answer[0] == head.address
        assert impostor.frames_3 == 1  # it was tried first
        assert keys.pinned_head(tmp_path) == head.key


async def test_when_every_announced_head_refuses_before_proving_the_node_looks_again_later(tmp_path, caplog):
    """Announcers that refuse without proving the token may be no head at all (issue 50 item 11: a rogue one made a
    discovering node exit for good): the node says so and looks again; the address it was given ends it."""
    async with FakeHead(make_secret(), "refuse") as one, FakeHead(make_secret(), "refuse") as two:
        assert await node(tmp_path, [one.address, two.address]).request_pull("m") is None
        assert one.frames_3 == two.frames_3 == 1
        assert "every head found on the local network refused this node" in caplog.text
        with pytest.raises(Refused, match="refused this node's fleet token"):
            await node(tmp_path, one.address).request_pull("m")
    assert keys.pinned_head(tmp_path) is None


def test_node_join_against_a_rogue_head_exits_2_and_pins_nothing(tmp_path):
    """The real command with a fresh FLEET_HOME: the rogue's refusal ends it before the model loads, unpinned."""
    loop = asyncio.new_event_loop()
    rogue = FakeHead(make_secret(), "refuse")
    loop.run_until_complete(rogue.__aenter__())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "FLEET_HOME": str(tmp_path), "FLEET_MDNS": "0"}
        done = subprocess.run(
            [PYTHON, str(ROOT / "manage.py"), "node_join", rogue.address, "--model", "smollm2", "--offline",
             "--token", TOKEN, "--identity", "rogue-test"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert done.returncode == 2, done.stderr
    assert rogue.frames_3 == 1 and "refused this node's fleet token" in done.stderr
    assert "Traceback" not in done.stderr
    assert not keys.head_pin_path(tmp_path).exists()


async def test_a_node_restarted_with_park_tells_the_head_its_warm_generations_once(tmp_path):
    """`--park` restores lanes from disk; the head keeps what those lanes hold in placement only if the register
    names them (and only the first register after the cache was cleared: a rejoin's lanes are not new)."""
    engine = FakeEngine()
    engine.warm = ["g-parked-1", "g-parked-2"]
    async with FakeHead(SECRET) as head:
        agent = NodeAgent(AgentConfig(head=head.address, token=TOKEN, home=tmp_path, identity="warm"), engine)
        for _ in range(2):
            with pytest.raises((LinkError, ConnectionClosed)):
                await agent._session(HeadLink(head.address))
    first, second = head.received
    assert isinstance(first, Register) and first.warm == ["g-parked-1", "g-parked-2"] and first.cache_cleared
    assert second.warm == [] and not second.cache_cleared


async def test_the_dial_loop_joins_the_head_that_proves_the_token_past_an_impostor_that_refuses(tmp_path):
    async with FakeHead(make_secret(), "refuse") as impostor, FakeHead(SECRET) as head:
        agent = node(tmp_path, [impostor.address, head.address])
        running = asyncio.ensure_future(agent.run())
        try:
            for _ in range(200):
                if head.received or running.done():
                    break
                await asyncio.sleep(0.05)
            assert not running.done(), running.exception()  # the impostor's refusal did not end the node
        finally:
            running.cancel()
    assert impostor.frames_3 == 1 and isinstance(head.received[0], Register)
    assert keys.pinned_head(tmp_path) == head.key


def test_a_node_key_being_written_is_never_read_half_made(tmp_path, monkeypatch):
    """Two node processes of one host starting at once (CI saw the second read an empty key file and exit 2): the
    second reads the first's whole key, and both use it."""
    other: list[bytes] = []
    fdopen = os.fdopen
    started = []

    def another_process_starts_meanwhile(fd, *args, **kwargs):
        if not started:  # the first key file is open, not yet written: the other process starts now
            started.append(True)
            other.append(keys.node_key(tmp_path))
        return fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(keys.os, "fdopen", another_process_starts_meanwhile)
    assert keys.node_key(tmp_path) == other[0]
    assert [p.name for p in (tmp_path / "fleet").iterdir()] == ["node_key"]  # no draft left behind
