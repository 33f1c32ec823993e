"""The head's end of the node link, in process: refusals, key binding, the handshake cap, bad frames, register."""

import asyncio
import contextlib
import time
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from fleet.dispatch import generation_stream
from fleet.links import registry
from nodes.agent.vocab import BUILTINS, BYTES
from nodes.link.codes import CloseCode
from nodes.link.handshake import LOCAL_TOKEN_ID, Initiator, format_token, make_secret, parse_token
from nodes.link.messages import Bundle, Check, Generate, Heartbeat, Pull, Register, Registered, encode
from nodes.link.noise import generate_static
from nodes.link.spec import GenerateSpec
from nodes.models import Node
from nodes.services import fleet_token_create, fleet_token_revoke

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

LOCAL_TOKEN = format_token(LOCAL_TOKEN_ID, make_secret())
NODE_KEY = generate_static()


@pytest.fixture(autouse=True)
def _fleet_log_reaches_caplog(monkeypatch):
    """The `fleet` logger does not propagate (settings.LOGGING); caplog listens at the root. The ASGI application is
    loaded first: its `django.setup()` applies settings.LOGGING again, which would undo this in a run's first test."""
    import logging

    import fleet.asgi  # noqa: F401

    monkeypatch.setattr(logging.getLogger("fleet"), "propagate", True)


@pytest.fixture(autouse=True)
def _local_token(settings):
    """As under `manage.py up`: the head knows the run's local token."""
    settings.FLEET_LOCAL_NODE_TOKEN = LOCAL_TOKEN


_open: list[WebsocketCommunicator] = []


def communicator(peer: str = "127.0.0.1", headers: list | None = None) -> WebsocketCommunicator:
    from fleet.asgi import application

    comm = WebsocketCommunicator(application, "/ws/node/", headers=headers or [])
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


async def handshake(comm, token: str = LOCAL_TOKEN, key: bytes = NODE_KEY):
    token_id, psk = parse_token(token)
    initiator = Initiator(token_id, psk, key)
    await comm.send_to(bytes_data=initiator.first_frame())
    initiator.read_reply(await comm.receive_from(timeout=5))
    final, channel = initiator.finish()
    await comm.send_to(bytes_data=final)
    return channel


async def joined(token: str = LOCAL_TOKEN, key: bytes = NODE_KEY, peer: str = "127.0.0.1", register=None):
    """(communicator, channel) of a node that registered as `register` (REGISTER by default)."""
    comm = communicator(peer)
    assert (await comm.connect())[0]
    channel = await handshake(comm, token, key)
    await comm.send_to(bytes_data=channel.seal(register or REGISTER))
    assert isinstance(channel.open(await comm.receive_from(timeout=5)), Registered)
    return comm, channel


REGISTER = Register(identity="gpu-7", models=[{"name": "smollm2", "context_window": 4096}], lanes=4,
                    context_window=4096, capabilities={"chat": True}, engine="mock", engine_version="1", version="t")


async def test_the_local_node_registers_and_heartbeats():
    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm)
    await comm.send_to(bytes_data=channel.seal(REGISTER))
    reply = channel.open(await comm.receive_from(timeout=5))
    assert isinstance(reply, Registered) and reply.model_names == ["smollm2"]
    # the node may send several messages a frame, and the ends of generations cut from another head
    assert reply.features == ["bundle", "cut"]
    node = await Node.objects.aget(identity="gpu-7")
    assert node.state == Node.State.ONLINE and node.lanes == 4
    assert node.key_fingerprint and node.key_bound_at is not None
    assert registry().placement.models() == ["smollm2"]
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=1, lanes=4, prefill_tps=900.0,
                                                         decode_slowdown_ms=2.0)))
    beat = await _beat_of(str(node.pk))
    assert beat["lanes_busy"] == 1 and beat["prefill_tps"] == 900.0 and beat["decode_slowdown_ms"] == 2.0
    await comm.disconnect()
    await node.arefresh_from_db()
    assert node.state == Node.State.OFFLINE and registry().placement.models() == []


async def _beat_of(node_id: str) -> dict:
    """The heartbeat the head keeps for the node's pages (handled in order, so it lands soon after it is sent)."""
    from django.core.cache import cache

    from fleet.names import liveness_key

    for _ in range(100):
        beat = await cache.aget(liveness_key(node_id))
        if beat:
            return beat
        await asyncio.sleep(0.05)
    raise AssertionError("no heartbeat was kept")


async def _refused(token: str, peer: str = "10.0.0.7", headers: list | None = None) -> int:
    """The close code for a node that tries to join with `token` (through the whole handshake when it gets that far)."""
    comm = communicator(peer, headers)
    await comm.connect()
    token_id, psk = parse_token(token)
    initiator = Initiator(token_id, psk, NODE_KEY)
    await comm.send_to(bytes_data=initiator.first_frame())
    output = await comm.receive_output(timeout=5)
    if output["type"] == "websocket.close":
        return output["code"]
    initiator.read_reply(output["bytes"])
    await comm.send_to(bytes_data=initiator.finish()[0])
    return await closed_with(comm)


@pytest.mark.parametrize(
    ("peer", "headers"),
    [
        ("10.0.0.7", []),  # another host
        ("127.0.0.1", [(b"x-forwarded-for", b"203.0.113.9")]),  # a proxy on this host
        ("127.0.0.1", [(b"forwarded", b"for=203.0.113.9")]),
        ("127.0.0.1", [(b"x-real-ip", b"203.0.113.9")]),
    ],
    ids=["remote", "x-forwarded-for", "forwarded", "x-real-ip"],
)
async def test_the_local_token_is_refused_from_another_host_or_through_a_proxy(peer, headers):
    assert await _refused(LOCAL_TOKEN, peer, headers) == CloseCode.TOKEN_REQUIRED


async def test_the_local_token_is_refused_from_a_trusted_proxy_address(settings):
    settings.FLEET_TRUSTED_PROXIES = ["127.0.0.0/8"]
    assert await _refused(LOCAL_TOKEN, "127.0.0.1") == CloseCode.TOKEN_REQUIRED


async def test_without_manage_py_up_the_local_token_is_refused_even_on_loopback(settings):
    settings.FLEET_LOCAL_NODE_TOKEN = ""  # production: only `up` sets it
    assert await _refused(LOCAL_TOKEN, "127.0.0.1") == CloseCode.TOKEN_REQUIRED


async def test_a_wrong_local_secret_is_refused():
    assert await _refused(format_token(LOCAL_TOKEN_ID, make_secret()), "127.0.0.1") == CloseCode.TOKEN_REFUSED


async def test_unknown_wrong_secret_revoked_and_expired_tokens_each_get_their_code(caplog):
    from datetime import timedelta

    from django.utils import timezone

    _, full = await sync_to_async(fleet_token_create)(name="t")
    wrong = format_token(full.split(".")[0], make_secret())
    revoked_row, revoked = await sync_to_async(fleet_token_create)(name="r")
    await sync_to_async(fleet_token_revoke)(token=revoked_row)
    _, expired = await sync_to_async(fleet_token_create)(name="e", expires_at=timezone.now() - timedelta(seconds=1))
    cases = {"abcdef123456." + "A" * 43: CloseCode.TOKEN_REFUSED, wrong: CloseCode.TOKEN_REFUSED,
             revoked: CloseCode.TOKEN_REVOKED, expired: CloseCode.TOKEN_EXPIRED}
    for bad, code in cases.items():
        caplog.clear()
        assert await _refused(bad) == code, bad
        refusals = [r for r in caplog.records if "refused node" in r.getMessage()]
        assert len(refusals) == 1 and not refusals[0].exc_info, bad  # one line, no traceback


async def test_a_token_whose_stored_secret_is_unreadable_is_refused_with_a_logged_reason(settings, caplog):
    _, full = await sync_to_async(fleet_token_create)(name="t")
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "a-new-key-without-the-old-one", []
    assert await _refused(full) == CloseCode.TOKEN_UNREADABLE
    assert any("FLEET_SECRET_KEY_FALLBACKS" in r.getMessage() for r in caplog.records)


async def test_token_secrets_survive_a_secret_key_rotation_with_fallbacks(settings):
    _, full = await sync_to_async(fleet_token_create)(name="t")
    old = settings.SECRET_KEY
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "the-rotated-key", [old]
    comm, _ = await joined(full, peer="10.0.0.7")
    await comm.disconnect()


async def test_remote_node_with_a_good_token_joins_and_is_bound_to_its_key():
    _, full = await sync_to_async(fleet_token_create)(name="t")
    comm, _ = await joined(full, peer="10.0.0.7")
    node = await Node.objects.select_related("token").aget(identity="gpu-7")
    assert node.token is not None and node.token.name == "t" and node.public_key
    await comm.disconnect()


async def test_another_key_cannot_take_a_bound_identity_and_the_bound_node_keeps_its_link(caplog):
    _, full = await sync_to_async(fleet_token_create)(name="t")
    comm, channel = await joined(full, peer="10.0.0.7")
    caplog.clear()
    impostor = communicator("10.0.0.8")
    await impostor.connect()
    impostor_channel = await handshake(impostor, full, generate_static())
    await impostor.send_to(bytes_data=impostor_channel.seal(REGISTER))
    assert await closed_with(impostor) == CloseCode.IDENTITY_TAKEN
    assert [r.getMessage() for r in caplog.records if "refused node" in r.getMessage()][0].count("bound to key") == 1
    # The real node's link is untouched: it still heartbeats and holds the placement slot.
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))
    assert await comm.receive_nothing(timeout=0.3)
    node = await Node.objects.aget(identity="gpu-7")
    assert node.state == Node.State.ONLINE and str(node.pk) in registry().links
    await comm.disconnect()


async def test_a_check_answers_before_the_model_loads():
    comm, _ = await joined()
    await comm.disconnect()
    for key, code in ((NODE_KEY, CloseCode.NORMAL), (generate_static(), CloseCode.IDENTITY_TAKEN)):
        probe = communicator()
        await probe.connect()
        channel = await handshake(probe, LOCAL_TOKEN, key)
        await probe.send_to(bytes_data=channel.seal(Check(identity="gpu-7")))
        assert await closed_with(probe) == code


async def test_a_pull_is_answered_with_a_grant_or_why_not_and_only_for_the_bound_key():
    from nodes.models import Model
    from nodes.registry import model_grant_open

    comm, _ = await joined()
    await comm.disconnect()
    await Model.objects.acreate(name="tiny-chat", sha256="ab" * 32, size=1234, architecture="llama",
                                quantization="Q4_1", context_length=8192, kv_bytes_per_token=23040)
    answers = {}
    for model in ("tiny-chat", "nope"):
        probe = communicator()
        await probe.connect()
        channel = await handshake(probe)
        await probe.send_to(bytes_data=channel.seal(Pull(identity="gpu-7", model=model)))
        answers[model] = channel.open(await probe.receive_from(timeout=5))
        assert await closed_with(probe) == CloseCode.NORMAL
    granted = answers["tiny-chat"]
    assert (granted.sha256, granted.size, granted.error) == ("ab" * 32, 1234, "")
    assert granted.path == f"/models/blobs/{'ab' * 32}"
    assert model_grant_open(grant=granted.grant, sha256="ab" * 32).name == "ab" * 32
    assert answers["nope"].error.startswith("the head has no model named 'nope'") and not answers["nope"].grant
    impostor = communicator()
    await impostor.connect()
    channel = await handshake(impostor, LOCAL_TOKEN, generate_static())
    await impostor.send_to(bytes_data=channel.seal(Pull(identity="gpu-7", model="tiny-chat")))
    assert await closed_with(impostor) == CloseCode.IDENTITY_TAKEN


async def test_releasing_the_binding_lets_a_new_key_join():
    from nodes.services import node_release_key

    comm, _ = await joined()
    await comm.disconnect()
    node = await Node.objects.aget(identity="gpu-7")
    assert await sync_to_async(node_release_key)(node=node)
    new_key = generate_static()
    comm, _ = await joined(key=new_key)
    await node.arefresh_from_db()
    from nodes.link.noise import public_key

    assert node.public_key == public_key(new_key).hex()
    await comm.disconnect()


@pytest.fixture
def no_periodic_check(monkeypatch):
    """Only the channel-layer message may close the link (the embedded head's once-a-second look-up is off)."""
    monkeypatch.setattr("nodes.link_watchdog.REVOCATION_CHECK_S", 10**6)


async def test_revoking_a_node_closes_its_link_and_its_key_cannot_rejoin_under_any_identity(no_periodic_check):
    from nodes.services import node_revoke

    comm, _ = await joined()
    node = await Node.objects.aget(identity="gpu-7")
    assert await sync_to_async(node_revoke)(node=node)
    assert await closed_with(comm) == CloseCode.NODE_REVOKED
    for identity in ("gpu-7", "gpu-8"):
        again = communicator()
        await again.connect()
        channel = await handshake(again)
        await again.send_to(bytes_data=channel.seal(_register_as(identity)))
        assert await closed_with(again) == CloseCode.NODE_REVOKED, identity


async def test_revoking_a_token_closes_the_links_that_joined_with_it(no_periodic_check):
    token, full = await sync_to_async(fleet_token_create)(name="t")
    comm, _ = await joined(full, peer="10.0.0.7")
    local, _ = await joined(register=_register_as("gpu-local"))
    await sync_to_async(fleet_token_revoke)(token=token)
    assert await closed_with(comm) == CloseCode.TOKEN_REVOKED
    assert await local.receive_nothing(timeout=0.3)  # a link with another token is untouched
    await local.disconnect()


async def test_a_link_the_head_closes_leaves_the_fleet_at_once_though_the_node_never_answers(no_periodic_check,
                                                                                          settings):
    """A token revoked mid-generation, or a node whose heartbeats stopped: the head closed the link, the node never
    answered the close (gone without a FIN), and no disconnect came. The link stayed in placement and /healthz
    counted the node. Now its session ends as the head closes it."""
    token, full = await sync_to_async(fleet_token_create)(name="t")
    comm, _ = await joined(full, peer="10.0.0.7")
    node_id = str((await Node.objects.aget(identity="gpu-7")).pk)
    assert node_id in registry().links
    await sync_to_async(fleet_token_revoke)(token=token)
    assert await closed_with(comm) == CloseCode.TOKEN_REVOKED  # and no comm.disconnect(): the node is silent
    for _ in range(100):  # the link goes from this process at once; Redis's placement a round trip later
        if node_id not in registry().links and not any(s.node_id == node_id for s in registry().placement.nodes()):
            break
        await asyncio.sleep(0.02)
    assert node_id not in registry().links
    assert not any(slot.node_id == node_id for slot in registry().placement.nodes())
    assert (await Node.objects.aget(pk=node_id)).state == Node.State.OFFLINE
    settings.FLEET_NODE_TIMEOUT_S = 1  # the other way the head closes a link: heartbeats missed
    silent, _ = await joined(register=_register_as("gpu-silent"))
    silent_id = str((await Node.objects.aget(identity="gpu-silent")).pk)
    assert await closed_with(silent) == 1001
    for _ in range(100):
        if silent_id not in registry().links:
            break
        await asyncio.sleep(0.02)
    assert silent_id not in registry().links
    await comm.disconnect()  # daphne's disconnect when it comes at last: nothing more to do
    await silent.disconnect()


async def test_the_database_away_ends_no_link_and_no_streams_metrics(monkeypatch):
    """Issue 50 item 3's tracebacks: a heartbeat's `node_touch`, the watchdog's revocation look-up and a stream's
    metrics label each raised the database's error and ended the link or the stream's bookkeeping."""
    from django.db import OperationalError

    from fleet import metrics

    def away(**kwargs):
        raise OperationalError("could not connect to server: Connection refused")

    monkeypatch.setattr("nodes.link_watchdog.REVOCATION_CHECK_S", 1)  # looked up every tick, and failing
    monkeypatch.setattr("nodes.services.node_touch", away)
    monkeypatch.setattr("nodes.services.link_refusal", away)
    comm, channel = await joined()
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))  # its first touch is due
    assert await comm.receive_nothing(timeout=2.5)  # two watchdog ticks, a heartbeat: the link stays up
    node_id = str((await Node.objects.aget(identity="gpu-7")).pk)
    assert node_id in registry().links
    monkeypatch.setitem(metrics._known(), "at", -1e9)  # the known names are read again: from a database away
    monkeypatch.setitem(metrics._known(), "names", frozenset())
    class Away:
        def values_list(self, *args, **kwargs):
            raise OperationalError("could not connect to server: Connection refused")

    monkeypatch.setattr("nodes.models.Model.objects", Away())  # the registry's read fails
    assert await metrics.amodel_label("smollm2") == "smollm2"  # the links' own names
    await comm.disconnect()


def _register_as(identity: str) -> Register:
    from dataclasses import replace

    return replace(REGISTER, identity=identity)


@pytest.mark.parametrize("frame", [b"garbage before the handshake", b"FLEET2\x00\xff", b"\x00", "text frame"])
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
    channel = await handshake(comm)
    frame = bytearray(channel.seal(REGISTER))
    frame[-1] ^= 0x01
    await comm.send_to(bytes_data=bytes(frame))
    assert await closed_with(comm) == 4003


async def test_a_bundle_is_handled_as_its_messages_one_after_another():
    comm, channel = await joined()
    node = await Node.objects.aget(identity="gpu-7")
    beats = [Heartbeat(lanes_busy=busy, lanes=4, prefill_tps=100.0 * busy) for busy in (1, 3)]
    await comm.send_to(bytes_data=channel.seal(Bundle(parts=[encode(beat) for beat in beats])))
    for _ in range(100):
        beat = await _beat_of(str(node.pk))
        if beat["lanes_busy"] == 3:
            break
        await asyncio.sleep(0.02)
    assert beat["lanes_busy"] == 3 and beat["prefill_tps"] == 300.0  # the second, handled after the first
    await comm.disconnect()


async def test_a_bundle_before_register_or_inside_a_bundle_closes_4003(caplog):
    comm = communicator()
    await comm.connect()
    channel = await handshake(comm)
    await comm.send_to(bytes_data=channel.seal(Bundle(parts=[encode(REGISTER)])))
    assert await closed_with(comm) == 4003
    assert "bundle before the node registered" in caplog.text
    comm, channel = await joined()
    nested = encode(Bundle(parts=[encode(Heartbeat(lanes_busy=0, lanes=4))]))
    await comm.send_to(bytes_data=channel.seal(Bundle(parts=[nested])))
    assert await closed_with(comm) == 4003
    assert "bundle inside a bundle" in caplog.text


async def test_replayed_frame_closes_4003():
    comm = communicator()
    await comm.connect()
    channel = await handshake(comm)
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
    # accepted, then closed with 4008: refused before accepting, daphne answered HTTP 403, with no close code
    assert await ninth.connect() == (True, None) and await closed_with(ninth) == 4008
    await ninth.disconnect()  # as a client does after a refusal: else its application task outlives the test
    _open.remove(ninth)
    for comm in comms:
        await comm.disconnect()
    _open.clear()
    again = communicator()
    assert (await again.connect())[0]  # the slots are free again


async def test_one_address_holds_at_most_two_handshake_slots(settings):
    """About 12 idle sockets from one address, reopened as they closed, held every slot: no node could join."""
    idle = [communicator(peer="203.0.113.9") for _ in range(settings.FLEET_MAX_HANDSHAKES_PER_ADDRESS)]
    for comm in idle:
        assert (await comm.connect())[0]
    third = communicator(peer="203.0.113.9")
    assert await third.connect() == (True, None) and await closed_with(third) == 4008
    elsewhere = communicator(peer="198.51.100.7")  # a node elsewhere still joins
    assert (await elsewhere.connect())[0]
    _, token = await sync_to_async(fleet_token_create)(name="rack")
    assert (await handshake(elsewhere, token=token)).handshake_hash


async def test_a_socket_that_stalls_in_a_handshake_stage_loses_its_slot(settings, caplog):
    settings.FLEET_HANDSHAKE_STAGE_S = 1
    silent = communicator(peer="203.0.113.9")
    assert (await silent.connect())[0]
    output = await silent.receive_output(timeout=4)  # one second's stage, the watchdog's tick
    assert (output["type"], output["code"]) == ("websocket.close", 4003)
    stalled = communicator(peer="203.0.113.9")
    assert (await stalled.connect())[0]
    _, token = await sync_to_async(fleet_token_create)(name="rack")
    token_id, psk = parse_token(token)
    await stalled.send_to(bytes_data=Initiator(token_id, psk, NODE_KEY).first_frame())  # frame 1, then nothing
    await stalled.receive_from(timeout=5)  # frame 2
    assert await closed_with(stalled) == 4003
    assert "no handshake in time" in caplog.text


@pytest.mark.parametrize(
    "token_id",
    [None, 7, "", "x" * 65, "a.b", "spaced id", "ünïcode"],
    ids=["missing", "not-a-string", "empty", "too-long", "dot", "space", "non-ascii"],
)
async def test_each_malformed_token_id_in_a_hello_is_one_refusal_line_and_4003(token_id, caplog):
    import struct

    import msgpack

    hello = msgpack.packb({"proto": "fleet/2", "token_id": token_id})
    comm = communicator("10.0.0.7")
    await comm.connect()
    await comm.send_to(bytes_data=b"FLEET2" + struct.pack(">H", len(hello)) + hello + bytes(48))
    assert await closed_with(comm) == CloseCode.PROTOCOL
    refusals = [r for r in caplog.records if "refused node" in r.getMessage()]
    assert len(refusals) == 1 and "token id" in refusals[0].getMessage() and not refusals[0].exc_info


@pytest.mark.parametrize("what", ["token", "node"])
async def test_an_embedded_head_finds_a_revocation_made_in_another_process(what, monkeypatch, settings):
    """`manage.py fleet_token --revoke` runs in its own process, which the in-memory layer cannot reach."""
    from nodes.services import node_revoke

    if "InMemoryChannelLayer" not in settings.CHANNEL_LAYERS["default"]["BACKEND"]:
        pytest.skip("with Redis the channel layer carries revocations between processes (the test above)")

    monkeypatch.setattr("nodes.services._close_links", lambda *args: None)  # no message reaches this process
    token, full = await sync_to_async(fleet_token_create)(name="t")
    comm, _ = await joined(full, peer="10.0.0.7")
    if what == "token":
        await sync_to_async(fleet_token_revoke)(token=token)
    else:
        await sync_to_async(node_revoke)(node=await Node.objects.aget(identity="gpu-7"))
    expected = CloseCode.TOKEN_REVOKED if what == "token" else CloseCode.NODE_REVOKED
    assert await closed_with(comm) == expected


async def _schedulable(node_id: str, want: bool) -> bool:
    """Wait (briefly: heartbeats are handled in order) until placement shows the node as `want`."""
    import asyncio

    for _ in range(50):
        slots = [s for s in registry().placement.nodes() if s.node_id == node_id]
        if slots and slots[0].schedulable == want:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_node_whose_engine_is_restarting_gets_no_work_until_it_is_back():
    from nodes.services import node_set_hold

    comm, channel = await joined()
    node = await Node.objects.aget(identity="gpu-7")
    node_id = str(node.id)
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4, engine_ready=False)))
    assert await _schedulable(node_id, False)
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4, engine_ready=True)))
    assert await _schedulable(node_id, True)
    # a head that stopped placing here (the node answered engine_unavailable) is undone by the next heartbeat
    registry().placement.set_schedulable(node_id, False)
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))
    assert await _schedulable(node_id, True)
    # the engine coming back does not undo the operator's drain
    await sync_to_async(node_set_hold)(node=node, hold=Node.Hold.DRAIN)
    assert await _schedulable(node_id, False)
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4, engine_ready=True)))
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4, engine_ready=True)))
    assert not await _schedulable(node_id, True)


async def test_a_heartbeats_measured_speed_reaches_placement_as_the_nodes_load_cost():
    import asyncio

    comm, channel = await joined()
    node_id = str((await Node.objects.aget(identity="gpu-7")).id)
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4, prefill_tps=400.0,
                                                         decode_slowdown_ms=5.0)))
    for _ in range(50):
        slot = next(s for s in registry().placement.nodes() if s.node_id == node_id)
        if slot.prefill_tps:
            break
        await asyncio.sleep(0.02)
    assert (slot.prefill_tps, slot.decode_slowdown_ms) == (400.0, 5.0)


async def test_a_node_that_restarts_warm_keeps_what_its_restored_lanes_hold_in_placement():
    from dataclasses import replace

    from nodes.agent.vocab import BUILTINS, BYTES
    from nodes.link.prefix import prefix_keys

    comm, channel = await joined()
    node_id = str((await Node.objects.aget(identity="gpu-7")).id)
    kept = prefix_keys(space="smollm2", tokenize=BUILTINS[BYTES].tokenize, prompt="k" * 600)
    lost = prefix_keys(space="smollm2", tokenize=BUILTINS[BYTES].tokenize, prompt="l" * 600)
    registry().placement.record(node_id, "g-parked", kept)
    registry().placement.record(node_id, "g-gone", lost)
    await comm.disconnect()

    await joined(register=replace(REGISTER, cache_cleared=True, warm=["g-parked"]))
    assert registry().placement.holders(kept[-1].key) == {node_id}
    assert registry().placement.holders(lost[-1].key) == set()


async def test_a_register_with_a_malformed_warm_list_is_refused():
    from dataclasses import replace

    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm)
    await comm.send_to(bytes_data=channel.seal(replace(REGISTER, warm=["x" * 65])))
    assert await closed_with(comm) == CloseCode.PROTOCOL


async def test_a_state_operation_waiting_when_the_link_closes_fails_as_a_closed_link():
    """Not as the node's answer: /v1/embeddings then asks another node (LinkClosed), as a lost generation is."""
    import asyncio

    from nodes.link.messages import LinkClosed, StateOp

    comm, channel = await joined()
    holder = registry().links[str((await Node.objects.aget(identity="gpu-7")).id)]
    asked = asyncio.ensure_future(holder.state_op("embed", {"texts": ["a cat"]}, 5))
    assert isinstance(channel.open(await comm.receive_from(timeout=5)), StateOp)
    await comm.disconnect()
    with pytest.raises(LinkClosed):
        await asyncio.wait_for(asked, 5)


async def test_a_node_sends_the_tokenizer_the_head_lacks_and_takes_work_once_it_is_in(settings, tmp_path):
    from dataclasses import replace

    from nodes.agent.dialer import tokenizer_parts
    from nodes.agent.models import resolve_model
    from nodes.agent.vocab import tokenizer_fingerprint
    from nodes.tokenizers import tokenizer_known

    settings.FLEET_HOME = tmp_path
    path, _ = resolve_model("smollm2")
    fingerprint = tokenizer_fingerprint(path)
    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm)

    # Given a node whose model's tokenizer the head has no file of
    await comm.send_to(bytes_data=channel.seal(replace(REGISTER, tokenizers={"smollm2": fingerprint})))
    reply = channel.open(await comm.receive_from(timeout=5))

    # Then the head asks for it, and places nothing there until it is in
    assert isinstance(reply, Registered) and reply.tokenizers_wanted == [fingerprint]
    [slot] = registry().placement.nodes()
    assert (slot.tokenizers, slot.schedulable) == ({"smollm2": fingerprint}, False)

    # And a generation that comes before the file, keyed by bytes while it waits, is keyed again by the node's
    # tokenizer once the file is in, before it is placed there
    stream = generation_stream(GenerateSpec(gen_id=uuid.uuid4().hex, model="smollm2", prompt="Hello there, how"),
                               deadline=time.time() + 20)
    first = asyncio.ensure_future(stream.__aiter__().__anext__())
    for _ in range(100):
        if stream.placer.keys is not None:
            break
        await asyncio.sleep(0.02)
    assert stream.placer.tokenizer is BUILTINS[BYTES]
    parts = await asyncio.to_thread(tokenizer_parts, str(path), fingerprint)
    for part in parts:
        await comm.send_to(bytes_data=channel.seal(part))
    assert await placeable(1) and tokenizer_known(fingerprint)
    while not isinstance(sent := channel.open(await comm.receive_from(timeout=5)), Generate):
        pass
    assert sent.gen_id == stream.spec.gen_id and getattr(stream.placer.tokenizer, "fingerprint", "") == fingerprint
    first.cancel()
    await stream.cancel()

    # And a node that joins later with the same tokenizer is not asked again
    other = communicator()
    assert (await other.connect())[0]
    channel = await handshake(other, key=generate_static())
    register = replace(REGISTER, identity="gpu-8", tokenizers={"smollm2": fingerprint})
    await other.send_to(bytes_data=channel.seal(register))
    assert channel.open(await other.receive_from(timeout=5)).tokenizers_wanted == []
    assert await placeable(2)


async def placeable(count: int) -> bool:
    """Whether `count` nodes are placeable within a few seconds (Registered goes out before that, on Redis too)."""
    for _ in range(200):
        if sum(s.schedulable for s in registry().placement.nodes()) == count:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_tokenizer_file_that_is_not_the_one_named_closes_the_link(settings, tmp_path):
    from dataclasses import replace

    from nodes.link.messages import TokenizerFile

    settings.FLEET_HOME = tmp_path
    fingerprint = "ab" * 32
    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm)
    await comm.send_to(bytes_data=channel.seal(replace(REGISTER, tokenizers={"smollm2": fingerprint})))
    assert channel.open(await comm.receive_from(timeout=5)).tokenizers_wanted == [fingerprint]

    await comm.send_to(bytes_data=channel.seal(TokenizerFile(fingerprint=fingerprint, part=0, parts=1,
                                                             data=b"not a tokenizer")))

    assert await closed_with(comm) == CloseCode.PROTOCOL
    assert not registry().placement.nodes()[0].schedulable



async def test_a_node_that_takes_heads_is_told_every_live_head_process_and_each_change(monkeypatch, settings):
    """At register the node learns where this head process and every other live one are reached; a heartbeat after
    a head process started (or died) tells it the new list, so it dials the new one within seconds."""
    from dataclasses import replace

    from nodes.link.messages import Feature, Heads

    settings.FLEET_LINK_URL = "ws://10.0.0.1:8001/ws/node/"
    live = ["ws://10.0.0.1:8001/ws/node/", "ws://10.0.0.2:8001/ws/node/"]
    monkeypatch.setattr(registry().heads, "heads_live", lambda: list(live))
    comm = communicator()
    assert (await comm.connect())[0]
    channel = await handshake(comm)
    await comm.send_to(bytes_data=channel.seal(replace(REGISTER, features=[Feature.HEADS.value])))
    reply = channel.open(await comm.receive_from(timeout=5))
    assert reply.head == "ws://10.0.0.1:8001/ws/node/" and reply.heads == live
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))
    assert await comm.receive_nothing(timeout=0.3)  # nothing changed: nothing said
    live.append("ws://10.0.0.3:8001/ws/node/")
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))
    told = channel.open(await comm.receive_from(timeout=5))
    assert isinstance(told, Heads) and told.heads == live


async def test_a_node_that_does_not_take_heads_is_sent_none(monkeypatch):
    monkeypatch.setattr(registry().heads, "heads_live", lambda: ["ws://10.0.0.2:8001/ws/node/"])
    comm, channel = await joined()
    await comm.send_to(bytes_data=channel.seal(Heartbeat(lanes_busy=0, lanes=4)))
    assert await comm.receive_nothing(timeout=0.3)


async def test_a_link_lost_while_redis_is_away_is_cleaned_up_and_leaves_placement_once_it_is_back(monkeypatch):
    """A 10 s Redis outage: the lost link's cleanup stopped at placement, the node stayed placeable and generations
    went nowhere (node_stuck, 504s) until the head restarted."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from nodes import link_down

    monkeypatch.setattr(link_down, "NODE_DOWN_RETRY_FIRST_S", 0.05)
    comm, _ = await joined()
    node_id = next(iter(registry().links))
    placement = registry().aplacement
    real_down, away = placement.node_down, {"calls": 0}

    async def redis_away_twice(nid, *args):
        away["calls"] += 1
        if away["calls"] <= 2:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return await real_down(nid, *args)

    monkeypatch.setattr(placement, "node_down", redis_away_twice)
    stream = generation_stream(GenerateSpec(gen_id=uuid.uuid4().hex, model="smollm2", prompt="Hi"),
                               deadline=time.time() + 20)
    first = asyncio.ensure_future(stream.__aiter__().__anext__())
    await asyncio.sleep(0.2)
    await comm.disconnect()
    _open.remove(comm)
    # The rest of the cleanup ran: the node is offline, and the generation there is told so (not stuck)
    assert (await Node.objects.aget(pk=node_id)).state == Node.State.OFFLINE
    done, _ = await asyncio.wait({first}, timeout=10)
    assert done  # an answer (the node was lost, no other serves the model), not a wait for frames that never come
    # And once Redis is back the node leaves placement
    for _ in range(100):
        if not registry().placement.nodes():
            break
        await asyncio.sleep(0.05)
    assert away["calls"] == 3 and not registry().placement.nodes()
    await stream.cancel()


async def test_a_node_that_says_goodbye_is_logged_as_left_at_info_and_one_that_drops_as_lost(caplog):
    import logging

    from nodes.link.messages import Bye

    caplog.set_level(logging.INFO)
    for bye in (True, False):
        caplog.clear()
        comm, channel = await joined()
        if bye:
            await comm.send_to(bytes_data=channel.seal(Bye(reason="the node is stopping")))
            assert (await comm.receive_output(timeout=5))["type"] == "websocket.close"
        await comm.disconnect(code=1000 if bye else 1011)
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "gpu-7" in r.getMessage()]
        if bye:
            assert any(level == logging.INFO and "'gpu-7' left" in text for level, text in said), said
            assert not any("'gpu-7' lost" in text for _, text in said)
        else:
            assert any(level == logging.WARNING and "'gpu-7' lost" in text for level, text in said), said


@pytest.mark.parametrize("features", [[], ["thinking_budget"]], ids=["older-node", "node-that-takes-it"])
async def test_a_thinking_budget_goes_only_to_a_node_that_takes_it(features, caplog):
    """A spec field an older node would drop unread (GenerateSpec.thinking_budget) is left out of its generate, and
    the head says so in a log line; a node whose register lists the feature gets it."""
    import logging
    from dataclasses import replace

    from nodes.link.messages import Feature

    assert {feature.value for feature in Feature} >= {"thinking_budget"}
    caplog.set_level(logging.INFO)
    comm, channel = await joined(register=replace(REGISTER, features=features))
    assert await placeable(1)
    spec = GenerateSpec(gen_id=uuid.uuid4().hex, model="smollm2", prompt="Think, then answer.", thinking_budget=64)
    stream = generation_stream(spec, deadline=time.time() + 20)
    first = asyncio.ensure_future(stream.__aiter__().__anext__())
    while not isinstance(sent := channel.open(await comm.receive_from(timeout=5)), Generate):
        pass
    assert sent.spec.get("thinking_budget") == (64 if features else None)
    logged = any("does not take thinking_budget" in r.getMessage() for r in caplog.records)
    assert logged is not bool(features)
    first.cancel()
    await stream.cancel()
