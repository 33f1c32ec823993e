"""fleet.middleware: Django's stock middleware that does no I/O, with its hooks run on the event loop."""

import threading

import pytest
from django.test import AsyncClient

from fleet import middleware

INLINE = [middleware.CommonMiddleware, middleware.CsrfViewMiddleware,
          middleware.AuthenticationMiddleware, middleware.XFrameOptionsMiddleware]

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
    # Every hook of the four ran (settings.MIDDLEWARE lists these classes), each on this loop's thread
    assert len(seen) == 6, seen
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
