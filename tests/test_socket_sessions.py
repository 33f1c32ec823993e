"""Websocket routes read the session cookie without Channels' check on each message sent (fleet/socket_sessions.py):
the consumer sends with the server's own `send`, and still finds the session (and, on the fleet page, its user)."""

import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.sessions import InstanceSessionWrapper
from channels.testing import WebsocketCommunicator

from fleet.socket_sessions import socket_auth_stack, socket_session_stack
from tests.test_playground import session_cookie

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


def recording_app(seen: dict):
    async def app(scope, receive, send):
        seen["send"], seen["scope"] = send, scope
        await receive()  # the connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "hi"})

    return app


@pytest.mark.parametrize("stack", [socket_session_stack, socket_auth_stack])
async def test_the_inner_app_sends_with_the_servers_own_send_and_reads_the_cookies_session(stack):
    cookie = await sync_to_async(session_cookie)(is_staff=True)
    seen: dict = {}
    comm = WebsocketCommunicator(stack(recording_app(seen)), "/ws/x/", headers=[(b"cookie", cookie.encode())])
    assert (await comm.connect())[0]
    assert await comm.receive_from(timeout=3) == "hi"
    assert seen["send"] == comm.output_queue.put  # no wrapper between the consumer and the server
    session_key = cookie.split("=", 1)[1]
    assert seen["scope"]["session"].session_key == session_key
    assert await sync_to_async(seen["scope"]["session"].get)("_auth_user_id")
    if stack is socket_auth_stack:
        user = seen["scope"]["user"]
        assert await sync_to_async(lambda: user.is_staff)()
    await comm.disconnect()


@pytest.fixture
def wrapper_sends(monkeypatch):
    """Every message that went through Channels' session send wrapper."""
    sent = []
    original = InstanceSessionWrapper.send

    async def send(self, message):
        sent.append(message)
        return await original(self, message)

    monkeypatch.setattr(InstanceSessionWrapper, "send", send)
    return sent


@pytest.mark.parametrize("path", ["/ws/v1/generate", "/ws/fleet/"])
async def test_the_routes_that_read_the_session_send_past_channels_wrapper(path, wrapper_sends):
    from fleet.routing import websocket_urlpatterns

    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), path,
                                 headers=[(b"host", b"testserver"), (b"origin", b"http://testserver")])
    assert (await comm.connect())[0]
    error = await comm.receive_json_from(timeout=3)  # no key, no session: refused, with an error frame first
    assert error["type"] == "error"
    closed = await comm.receive_output(timeout=3)
    assert closed["type"] == "websocket.close" and closed["code"] == 4401
    assert wrapper_sends == []
    await comm.disconnect()
