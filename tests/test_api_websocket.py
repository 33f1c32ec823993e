"""The client websocket /ws/v1/generate with a fake node link: auth, several streams at once, cancel, errors."""

import asyncio
import threading
from contextlib import contextmanager

import pytest
from asgiref.sync import SyncToAsync, sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings

from sessions.models import Generation
from tests.api_support import FakeLink, Script, add_fake_node

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)


def app():
    from fleet.routing import websocket_urlpatterns

    return URLRouter(websocket_urlpatterns)


async def connect(key=None, query=""):
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    comm = WebsocketCommunicator(app(), f"/ws/v1/generate{query}", headers=headers)
    connected, _ = await comm.connect()
    assert connected
    return comm


@contextmanager
def consumer_thread_busy():
    """asgiref's one thread for Channels consumers' database calls, held busy until the block ends."""
    busy, release = threading.Event(), threading.Event()
    SyncToAsync.single_thread_executor.submit(lambda: (busy.set(), release.wait(10)))
    assert busy.wait(5)
    try:
        yield
    finally:
        release.set()


async def frames_until_end(comm, ids, timeout=5.0):
    """Every frame until each id in `ids` has a done or error frame."""
    frames, open_ids = [], set(ids)
    while open_ids:
        frame = await comm.receive_json_from(timeout=timeout)
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            open_ids.discard(frame["id"])
    return frames


@pytest.mark.parametrize("credential, reason", [(None, "missing API key"), ("fk-1234.nope", "wrong or revoked")])
async def test_a_socket_without_a_valid_key_is_closed_with_4401(credential, reason):
    comm = await connect(credential)
    error = await comm.receive_json_from(timeout=3)
    assert error["type"] == "error" and error["code"] == "unauthorized" and reason in error["message"]
    closed = await comm.receive_output(timeout=3)
    assert closed["type"] == "websocket.close" and closed["code"] == 4401 and reason in closed["reason"]


async def test_the_key_may_come_in_the_query_string(bearer):
    add_fake_node()
    comm = await connect(query=f"?api_key={bearer}")
    await comm.send_json_to({"type": "ping", "id": 1})
    assert await comm.receive_json_from(timeout=3) == {"type": "pong", "id": 1}
    await comm.disconnect()


async def test_a_keyed_socket_is_accepted_while_the_consumers_database_thread_is_busy(bearer):
    """Its handshake waits for no database work. Channels' consumers make theirs on one thread per process (no
    request context gives them a thread of their own), and hundreds of sockets dialing at once once queued there
    for their session's user before their handshake could end: past daphne's 5 s, a handshake is dropped."""
    add_fake_node()
    with consumer_thread_busy():
        comm = WebsocketCommunicator(app(), "/ws/v1/generate",
                                     headers=[(b"authorization", f"Bearer {bearer}".encode())])
        connected, _ = await comm.connect(timeout=2)
        assert connected
    await comm.send_json_to({"type": "ping", "id": 1})  # answered once the key is checked, on that thread
    assert await comm.receive_json_from(timeout=3) == {"type": "pong", "id": 1}
    await comm.disconnect()


@pytest.mark.skipif(bool(settings.REDIS_URL), reason="on Redis the revocation stamp is read through that thread too")
async def test_a_key_this_process_verified_is_not_looked_up_again_at_connect(bearer):
    """A second socket with the same key is served while that thread is busy: its key is not read again."""
    add_fake_node()
    first = await connect(bearer)
    await first.send_json_to({"type": "ping", "id": 1})
    assert await first.receive_json_from(timeout=3) == {"type": "pong", "id": 1}
    with consumer_thread_busy():
        second = await connect(bearer)
        await second.send_json_to({"type": "ping", "id": 2})
        assert await second.receive_json_from(timeout=2) == {"type": "pong", "id": 2}
    await first.disconnect()
    await second.disconnect()


async def test_several_generations_stream_at_once_each_with_its_own_seq(bearer):
    link = add_fake_node(FakeLink(script=Script(delay=0.02, per_batch=1)), lanes=4)
    comm = await connect(bearer)
    await comm.send_json_to({"type": "generate", "id": "a", "model": "smollm2",
                             "messages": [{"role": "user", "content": "Hi"}]})
    await comm.send_json_to({"type": "generate", "id": "b", "model": "smollm2", "prompt": "Once", "max_tokens": 2,
                             "logprobs": 1})
    frames = await frames_until_end(comm, {"a", "b"})
    for cid, text, reason in (("a", "Hello, world!", "stop"), ("b", "Hello,", "length")):
        mine = [f for f in frames if f["id"] == cid]
        assert [f["seq"] for f in mine] == list(range(1, len(mine) + 1))
        assert "".join(f["text"] for f in mine if f["type"] == "token") == text
        done = mine[-1]
        assert done["type"] == "done" and done["finish_reason"] == reason and done["node"] == "fake-node"
        assert done["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert "logprobs" in [f for f in frames if f["id"] == "b"][0]
    # placed concurrently: on Redis either may reach the node first
    sent = sorted(("messages" if spec.get("messages") else spec["prompt"]) for spec in link.specs)
    assert sent == ["Once", "messages"]
    await comm.disconnect()


async def test_cancel_by_id_stops_the_node_lane_and_ends_with_a_done_frame(bearer):
    link = add_fake_node(FakeLink(script=Script(hang=True)))
    comm = await connect(bearer)
    await comm.send_json_to({"type": "generate", "id": "x", "model": "smollm2", "prompt": "Hi"})
    first = await comm.receive_json_from(timeout=3)
    assert first["type"] == "token" and first["seq"] == 1
    frames = [first]
    await comm.send_json_to({"type": "cancel", "id": "x"})
    while frames[-1]["type"] != "done":
        frames.append(await comm.receive_json_from(timeout=3))
    assert frames[-1]["finish_reason"] == "cancelled" and frames[-1]["seq"] == len(frames)
    assert len(link.cancelled) == 1
    await comm.disconnect()
    records = await sync_to_async(lambda: list(Generation.objects.values_list(
        "status", "prompt_tokens", "cached_tokens", "completion_tokens")))()
    assert [status for status, *_ in records] == ["cancelled"]
    usage = frames[-1]["usage"]  # what was read and streamed before the cancel, as the record has it (not 0/0)
    _, prompt, cached, completion = records[0]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]) == (
        prompt, cached, completion)
    assert prompt > 0 and completion >= len(frames) - 1 > 0


async def test_closing_the_socket_cancels_its_generations(bearer):
    link = add_fake_node(FakeLink(script=Script(hang=True)), lanes=4)
    comm = await connect(bearer)
    for cid in ("p", "q"):
        await comm.send_json_to({"type": "generate", "id": cid, "model": "smollm2", "prompt": "Hi"})
    while len(link.running) < 2:
        await asyncio.sleep(0.01)
    await comm.disconnect()
    assert len(link.cancelled) == 2


async def test_bad_frames_get_error_frames_and_the_socket_stays_open(bearer):
    add_fake_node()
    comm = await connect(bearer)
    await comm.send_to(text_data="{nope")
    assert (await comm.receive_json_from(timeout=3))["code"] == "invalid_json"
    await comm.send_json_to({"type": "generate", "id": "m", "model": "smollm2", "messages": []})
    error = await comm.receive_json_from(timeout=3)
    assert error == {"type": "error", "id": "m", "seq": 1, "code": "invalid_request", "param": "messages",
                     "message": error["message"]}
    await comm.send_json_to({"type": "generate", "id": "u", "model": "nobody-serves-this", "prompt": "Hi"})
    error = await comm.receive_json_from(timeout=3)
    assert error["code"] == "model_not_found" and error["id"] == "u" and error["seq"] == 1
    await comm.send_json_to({"type": "cancel", "id": "never"})
    assert (await comm.receive_json_from(timeout=3))["code"] == "not_running"
    await comm.send_json_to({"type": "dance"})
    assert (await comm.receive_json_from(timeout=3))["code"] == "unknown_frame"
    await comm.disconnect()
