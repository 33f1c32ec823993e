"""The head's end of the node link, in process: refusals, the handshake cap, bad frames, register and relay."""

import contextlib

import pytest
from channels.testing import WebsocketCommunicator

from fleet.links import registry
from nodes.link.handshake import Initiator, parse_token
from nodes.link.messages import Heartbeat, Register, Registered
from nodes.models import Node
from nodes.services import fleet_token_create, fleet_token_revoke

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


_open: list[WebsocketCommunicator] = []


def communicator(peer: str = "127.0.0.1") -> WebsocketCommunicator:
    from fleet.asgi import application

    comm = WebsocketCommunicator(application, "/ws/node/")
    comm.scope["client"] = [peer, 50000]
    _open.append(comm)
    return comm


@pytest.fixture(autouse=True)
async def _disconnect_all():
    """Every test's sockets end, as a real server ends them, so the handshake count starts at zero."""
    yield
    while _open:
        comm = _open.pop()
        with contextlib.suppress(Exception):  # already closed by the server
            await comm.disconnect()


async def closed_with(comm) -> int:
    output = await comm.receive_output(timeout=5)
    while output["type"] != "websocket.close":
        output = await comm.receive_output(timeout=5)
    return output["code"]


async def handshake(comm, token: str | None):
    token_id, psk = parse_token(token) if token else (None, None)
    initiator = Initiator(token_id, psk)
    await comm.send_to(bytes_data=initiator.first_frame())
    return initiator.read_reply(await comm.receive_from(timeout=5))


REGISTER = Register(identity="gpu-7", models=[{"name": "smollm2", "context_window": 4096}], lanes=4,
                    context_window=4096, capabilities={"chat": True}, engine="mock", engine_version="1", version="t")


async def test_loopback_node_without_token_registers_and_heartbeats():
    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm, None)
    await comm.send_to(bytes_data=channel.seal(REGISTER))
    reply = channel.open(await comm.receive_from(timeout=5))
    assert isinstance(reply, Registered) and reply.model_names == ["smollm2"]
    node = await Node.objects.aget(identity="gpu-7")
    assert node.state == Node.State.ONLINE and node.lanes == 4
    assert registry().placement.models() == ["smollm2"]
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=1, lanes=4)))
    await comm.disconnect()
    await node.arefresh_from_db()
    assert node.state == Node.State.OFFLINE and registry().placement.models() == []


async def test_remote_node_without_token_is_refused_4002():
    comm = communicator("10.0.0.7")
    await comm.connect()
    await comm.send_to(bytes_data=Initiator(None, None).first_frame())
    assert await closed_with(comm) == 4002


async def test_unknown_revoked_and_wrong_secret_tokens_are_refused_4001():
    from asgiref.sync import sync_to_async

    token, full = await sync_to_async(fleet_token_create)(name="t")
    from nodes.link.handshake import format_token, make_secret

    wrong = format_token(full.split(".")[0], make_secret())
    revoked_row, revoked = await sync_to_async(fleet_token_create)(name="r")
    await sync_to_async(fleet_token_revoke)(token=revoked_row)
    for bad in (wrong, revoked, "abcdef123456." + "A" * 43):
        comm = communicator("10.0.0.7")
        await comm.connect()
        token_id, psk = parse_token(bad)
        await comm.send_to(bytes_data=Initiator(token_id, psk).first_frame())
        assert await closed_with(comm) == 4001, bad


async def test_remote_node_with_a_good_token_joins():
    from asgiref.sync import sync_to_async

    _, full = await sync_to_async(fleet_token_create)(name="t")
    comm = communicator("10.0.0.7")
    await comm.connect()
    channel = await handshake(comm, full)
    await comm.send_to(bytes_data=channel.seal(REGISTER))
    assert isinstance(channel.open(await comm.receive_from(timeout=5)), Registered)
    await comm.disconnect()


@pytest.mark.parametrize("frame", [b"garbage before the handshake", b"FLEET1\x00\xff", b"\x00", "text frame"])
async def test_garbage_before_the_handshake_closes_4003(frame):
    comm = communicator()
    await comm.connect()
    if isinstance(frame, str):
        await comm.send_to(text_data=frame)
    else:
        await comm.send_to(bytes_data=frame)
    assert await closed_with(comm) == 4003


async def test_tampered_frame_after_the_handshake_closes_4003():
    comm = communicator()
    await comm.connect()
    channel = await handshake(comm, None)
    frame = bytearray(channel.seal(REGISTER))
    frame[-1] ^= 0x01
    await comm.send_to(bytes_data=bytes(frame))
    assert await closed_with(comm) == 4003


async def test_replayed_frame_closes_4003():
    comm = communicator()
    await comm.connect()
    channel = await handshake(comm, None)
    frame = channel.seal(REGISTER)
    await comm.send_to(bytes_data=frame)
    await comm.receive_from(timeout=5)
    await comm.send_to(bytes_data=frame)
    assert await closed_with(comm) == 4003


async def test_at_most_eight_handshakes_at_once(settings):
    comms = [communicator() for _ in range(settings.FLEET_MAX_HANDSHAKES)]
    for comm in comms:
        assert (await comm.connect())[0]
    ninth = communicator()
    assert await ninth.connect() == (False, 4008)
    _open.remove(ninth)
    for comm in comms:
        await comm.disconnect()
    _open.clear()
    again = communicator()
    assert (await again.connect())[0]  # the slots are free again
