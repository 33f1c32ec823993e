"""fleet.middleware: Django's stock middleware and WhiteNoise, with the hooks that do no I/O run on the event loop."""

import secrets
import threading

import pytest
from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.sessions.backends.db import SessionStore
from django.http import HttpResponse
from django.test import AsyncClient, RequestFactory

from fleet import middleware

INLINE = [middleware.SecurityMiddleware, middleware.SessionMiddleware, middleware.CommonMiddleware,
          middleware.CsrfViewMiddleware, middleware.AuthenticationMiddleware, middleware.MessageMiddleware,
          middleware.XFrameOptionsMiddleware]

pytestmark = pytest.mark.django_db


async def test_their_hooks_run_on_the_event_loop_not_in_a_worker_thread(monkeypatch):
    seen: dict[str, int] = {}
    for cls in INLINE:
        for hook in ("process_request", "process_response"):
            original = getattr(cls, hook, None)
            if original is None:
                continue

            def spy(self, *args, _original=original, _name=f"{cls.__name__}.{hook}"):
                seen[_name] = threading.get_ident()
                return _original(self, *args)

            monkeypatch.setattr(cls, hook, spy)
    response = await AsyncClient().get("/healthz")
    assert response.status_code == 200
    # Every hook of the seven ran (settings.MIDDLEWARE lists these classes), each on this loop's thread: the security
    # middleware too, which Django would run in a thread were WhiteNoise, inside it, sync-only
    assert len(seen) == 12, seen
    assert {name for name, ident in seen.items() if ident != threading.get_ident()} == set()


async def test_they_behave_as_the_stock_classes():
    client = AsyncClient(enforce_csrf_checks=True)
    response = await client.get("/healthz")
    assert response["X-Content-Type-Options"] == "nosniff"  # security
    assert response["X-Frame-Options"] == "DENY"  # clickjacking
    assert response["Content-Length"]  # common
    response = await client.get("/admin")
    assert response.status_code == 301 and response["Location"] == "/admin/"  # common: APPEND_SLASH
    response = await client.post("/admin/login/", {"username": "someone", "password": "secret"})
    assert response.status_code == 403 and b"CSRF" in response.content  # csrf
    response = await client.get("/admin/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]  # auth: an anonymous user


async def test_a_static_file_is_still_served():
    response = await AsyncClient().get("/static/admin/css/base.css")
    assert response.status_code == 200
    assert b"".join(response.streaming_content).startswith(b"/*")


@pytest.mark.django_db(transaction=True)
async def test_a_login_saves_its_session_in_a_thread():
    """Saving the session writes the database, which the event loop may not do: it goes to a thread."""
    await sync_to_async(get_user_model().objects.create_superuser)("op", "op@example.com", "op-password-1")
    client = AsyncClient()
    response = await client.post("/admin/login/", {"username": "op", "password": "op-password-1", "next": "/admin/"})
    assert response.status_code == 302 and response["Location"] == "/admin/"
    assert "sessionid" in response.cookies
    assert (await client.get("/admin/")).status_code == 200


@pytest.mark.django_db(transaction=True)
async def test_messages_stored_in_the_session_are_stored_from_a_thread():
    """A message too big for the cookie goes to the session, whose load reads the database: not on the event loop."""
    session = SessionStore()
    await sync_to_async(session.create)()

    async def view(request):
        messages.info(request, secrets.token_hex(4000))  # incompressible: the cookie holds ~2 kB
        return HttpResponse("ok")

    request = RequestFactory().get("/")
    request.COOKIES["sessionid"] = session.session_key
    request.session = SessionStore(session.session_key)
    response = await middleware.MessageMiddleware(view)(request)
    assert response.status_code == 200
    assert request.session.modified
    stored = await sync_to_async(lambda: SessionStore(session.session_key).load())()
    assert stored == {}  # written by the session middleware, which this test leaves out; the load above was on a thread
