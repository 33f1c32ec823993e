"""A /v1 request's own work before its generation is placed runs on the event loop where it does no I/O: no thread
hop at the request's start, none for the API key's revocation stamp or the quota in local memory, none for the CSRF
check of a view exempt from it."""

from __future__ import annotations

import threading

import pytest
from django.apps import apps
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_started
from django.db import close_old_connections, reset_queries
from django.middleware import csrf
from django.test import AsyncClient

from api.quota_counts import CacheQuotaStore, quota_store
from api.quotas import quota_admit
from api.services import api_key_authenticate, api_key_create, api_key_verified
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

local_memory = pytest.mark.skipif(not isinstance(caches["default"], LocMemCache),
                                  reason="the embedded default's cache; Redis is reached through a thread")


def test_a_request_under_asgi_starts_without_receivers_while_wsgi_keeps_them():
    """Django's start-of-request receivers are sync, so under ASGI each costs a hop to a new thread; there they
    find nothing to close. A WSGI thread serves request after request and keeps them."""
    # Django's test clients connect close_old_connections again after each request: start from Django's own state
    request_started.connect(close_old_connections)
    request_started.connect(reset_queries)
    apps.get_app_config("fleet").ready()
    assert not request_started.has_listeners(ASGIHandler)
    sync, _ = request_started._live_receivers(WSGIHandler)
    assert close_old_connections in sync and reset_queries in sync


@local_memory
async def test_a_verified_keys_stamp_is_read_on_the_event_loop(monkeypatch):
    from asgiref.sync import sync_to_async

    user = await sync_to_async(UserFactory)()
    row, key = await sync_to_async(api_key_create)(owner=user, name="app")
    await sync_to_async(api_key_authenticate)(key=key)
    threads: list[int] = []
    original = LocMemCache.get

    def spy(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LocMemCache, "get", spy)
    assert await api_key_verified(key=key) == row
    assert threads == [threading.get_ident()]


@local_memory
async def test_the_quota_in_local_memory_is_counted_on_the_event_loop(monkeypatch):
    from asgiref.sync import sync_to_async

    assert isinstance(quota_store(), CacheQuotaStore)
    user = await sync_to_async(UserFactory)()
    row, _ = await sync_to_async(api_key_create)(owner=user, name="app")
    threads: list[int] = []
    admit, settle = CacheQuotaStore.admit_sync, CacheQuotaStore.settle_sync

    def admit_spy(self, *args):
        threads.append(threading.get_ident())
        return admit(self, *args)

    def settle_spy(self, *args):
        threads.append(threading.get_ident())
        return settle(self, *args)

    monkeypatch.setattr(CacheQuotaStore, "admit_sync", admit_spy)
    monkeypatch.setattr(CacheQuotaStore, "settle_sync", settle_spy)
    ticket = await quota_admit(row, tokens=True, stream=True)
    await ticket.settle(10)
    assert threads == [threading.get_ident()] * 2


async def test_the_csrf_view_check_runs_on_the_loop_for_an_exempt_view_and_in_a_thread_for_a_form(monkeypatch):
    seen: list[tuple[str, bool]] = []
    original = csrf.CsrfViewMiddleware.process_view

    def spy(self, request, *args):
        seen.append((request.path, threading.get_ident() == loop_thread))
        return original(self, request, *args)

    loop_thread = threading.get_ident()
    monkeypatch.setattr(csrf.CsrfViewMiddleware, "process_view", spy)
    client = AsyncClient(enforce_csrf_checks=True)
    await client.post("/v1/chat/completions", {}, content_type="application/json")  # exempt: a bearer key, no cookie
    await client.get("/admin/login/")  # a safe method
    response = await client.post("/admin/login/", {"username": "x", "password": "y"})  # a form: may be spooled
    assert response.status_code == 403  # no CSRF token: the check ran
    assert seen[:2] == [("/v1/chat/completions", True), ("/admin/login/", True)]
    assert len(seen) > 2 and not any(on_loop for _, on_loop in seen[2:])
