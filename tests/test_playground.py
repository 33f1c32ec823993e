"""The admin playground: the page, and the client websocket opened with a staff session instead of an API key."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from sessions.models import Generation
from tests.api_support import FakeLink, Script, add_fake_node, written_rows
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def app():
    from fleet.routing import websocket_urlpatterns

    return URLRouter(websocket_urlpatterns)


def session_cookie(**user_fields) -> str:
    """A logged-in session for a new user, as the browser's cookie header value."""
    client = Client()
    client.force_login(UserFactory(**user_fields))
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


async def open_socket(cookie=None, origin="http://testserver", host="testserver"):
    headers = [(b"host", host.encode())]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    if origin:
        headers.append((b"origin", origin.encode()))
    comm = WebsocketCommunicator(app(), "/ws/v1/generate", headers=headers)
    connected, _ = await comm.connect()
    assert connected
    return comm


async def assert_refused(comm, reason):
    error = await comm.receive_json_from(timeout=3)
    assert error["type"] == "error" and error["code"] == "unauthorized" and reason in error["message"]
    closed = await comm.receive_output(timeout=3)
    assert closed["type"] == "websocket.close" and closed["code"] == 4401
    # As a client's socket would: the consumer then leaves its channel-layer receive itself. Left for the event
    # loop's teardown to cancel, that receive on Redis once held a CI run for its 300 s teardown timeout.
    await comm.disconnect()


async def test_a_staff_session_streams_and_the_generation_is_recorded_without_a_key():
    add_fake_node(FakeLink(script=Script(delay=0.01, per_batch=1)))
    cookie = await sync_to_async(session_cookie)(is_staff=True, is_superuser=False)
    comm = await open_socket(cookie)
    await comm.send_json_to({"type": "ping", "id": 1})
    assert await comm.receive_json_from(timeout=3) == {"type": "pong", "id": 1}
    await comm.send_json_to({"type": "generate", "id": "pg-1", "model": "smollm2", "temperature": 0.7,
                             "max_tokens": 64, "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Say hello"}]})
    frames = [await comm.receive_json_from(timeout=5)]
    while frames[-1]["type"] not in ("done", "error"):
        frames.append(await comm.receive_json_from(timeout=5))
    assert frames[-1]["type"] == "done" and frames[-1]["node"] == "fake-node", frames[-1]
    assert "".join(f["text"] for f in frames if f["type"] == "token") == "Hello, world!"
    await comm.disconnect()
    rows = await written_rows(lambda: list(Generation.objects.values_list("status", "api_key_id")))
    assert rows == [("done", None)]


async def test_a_client_that_leaves_as_its_answer_ends_still_leaves_a_record(monkeypatch):
    """The socket closed right after its `done` cancels the consumer's task, which is then making the record (here
    held up in the metrics' model lookup, a Redis and database read on PostgreSQL + Redis): the record is made."""
    from fleet import metrics

    lookup = metrics.amodel_label

    async def slow_lookup(name):
        await asyncio.sleep(0.3)
        return await lookup(name)

    monkeypatch.setattr(metrics, "amodel_label", slow_lookup)
    add_fake_node(FakeLink(script=Script(delay=0.01, per_batch=1)))
    comm = await open_socket(await sync_to_async(session_cookie)(is_staff=True, is_superuser=False))
    await comm.send_json_to({"type": "generate", "id": "pg-1", "model": "smollm2", "max_tokens": 8,
                             "messages": [{"role": "user", "content": "Say hello"}]})
    while (await comm.receive_json_from(timeout=5))["type"] not in ("done", "error"):
        pass
    await comm.disconnect()
    rows = await written_rows(lambda: list(Generation.objects.values_list("status", flat=True)))
    assert rows == ["done"]


@pytest.mark.parametrize("user_fields, reason", [
    ({"is_staff": False, "is_superuser": False}, "only staff users"),
    ({"is_staff": True, "is_active": False}, "missing API key"),  # an inactive user's session is no login at all
])
async def test_a_non_staff_or_inactive_session_is_closed_with_4401(user_fields, reason):
    cookie = await sync_to_async(session_cookie)(**user_fields)
    await assert_refused(await open_socket(cookie), reason)


async def test_an_anonymous_socket_is_closed_with_4401():
    await assert_refused(await open_socket(None), "missing API key")


@pytest.mark.parametrize("origin", ["http://evil.example", "", "null"])
async def test_a_staff_session_from_another_origin_is_refused(origin):
    cookie = await sync_to_async(session_cookie)(is_staff=True)
    await assert_refused(await open_socket(cookie, origin=origin), "Origin")


def test_the_page_lists_the_served_models_for_staff(client):
    client.force_login(UserFactory(is_staff=True, is_superuser=False))
    page = client.get("/admin/playground/")
    assert page.status_code == 200
    assert "No model is served" in page.content.decode()
    add_fake_node()
    page = client.get("/admin/playground/")
    html = page.content.decode()
    assert page.status_code == 200 and '<option value="smollm2">smollm2</option>' in html
    assert 'id="pg-message"' in html and "/ws/v1/generate" in html
    assert "/admin/playground/" in client.get("/admin/").content.decode()  # linked from the admin index


def test_the_page_sends_anonymous_and_non_staff_users_to_the_login_page(client):
    page = client.get("/admin/playground/")
    assert page.status_code == 302 and page["Location"] == "/admin/login/?next=/admin/playground/"
    client.force_login(UserFactory(is_staff=False, is_superuser=False))
    page = client.get("/admin/playground/")
    assert page.status_code == 302 and page["Location"].startswith("/admin/login/")


def test_the_page_offers_an_image_attachment_for_a_model_a_node_reads_images_with(client):
    client.force_login(UserFactory(is_staff=True, is_superuser=False))
    add_fake_node(FakeLink(node_id="11111111-1111-1111-1111-111111111111", identity="seeing"))
    add_fake_node(FakeLink(node_id="22222222-2222-2222-2222-222222222222", identity="blind"), model="tiny")
    NodeFactory(models_served=["smollm2"], capabilities={"chat": True, "vision": True})
    NodeFactory(models_served=["tiny"], capabilities={"chat": True, "vision": False})
    NodeFactory(models_served=["tiny"], capabilities={"vision": True}, state="offline")
    html = client.get("/admin/playground/").content.decode()
    assert '<option value="smollm2" data-vision="1">smollm2</option>' in html
    assert '<option value="tiny">tiny</option>' in html  # its only node with vision is offline
    assert 'id="pg-image"' in html and "image_url" in html
