"""API keys: a key this process verified is trusted without a database round trip, until any key changes.

Every way of stopping a key (revoked on /api or in the admin, deleted, its owner deactivated or deleted) and every
quota edit writes a new revocation stamp into the Django cache after its commit; /v1 reads the stamp on each
request, so the change applies at once; over Redis a process reads it at most every STAMP_READ_S (0.5 s), so the
change applies on every other head process within that (the last tests run two of them on Redis).
"""

import asyncio
import os
import time

import httpx
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import OperationalError
from django.db.models import QuerySet
from django.test import Client
from openai import AuthenticationError, OpenAI
from rest_framework.test import APIClient

from api.models import ApiKey
from api.services import STAMP_READ_S, api_key_authenticate, api_key_create, api_key_verified
from tests.api_support import add_fake_node, request
from tests.factories import UserFactory
from tests.live import make_head, make_peer_head

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def owner():
    return UserFactory(is_staff=False, is_superuser=False)


@pytest.fixture
def staff_client():
    client = Client()
    client.force_login(UserFactory(username="operator"))
    return client


def models_status(key: str) -> int:
    return async_to_sync(request)("GET", "/v1/models", key=key).status


def revoke_on_the_api(row, key, staff_client):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert api.delete(f"/api/keys/{row.pk}/").status_code == 204


def revoke_in_the_admin(row, key, staff_client):
    response = staff_client.post("/admin/api/apikey/", {"action": "revoke", "_selected_action": [row.pk]})
    assert response.status_code == 302 and ApiKey.objects.get(pk=row.pk).revoked_at is not None


def delete_in_the_admin(row, key, staff_client):
    response = staff_client.post(f"/admin/api/apikey/{row.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not ApiKey.objects.filter(pk=row.pk).exists()


def deactivate_the_owner_in_the_admin(row, key, staff_client):
    user = row.owner
    response = staff_client.post(f"/admin/auth/user/{user.pk}/change/", {
        "username": user.username, "is_active": "", "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00",
        "initial-date_joined_0": "2026-01-01", "initial-date_joined_1": "00:00:00"})
    assert response.status_code == 302, response.content
    assert get_user_model().objects.get(pk=user.pk).is_active is False


def deactivate_the_owner(row, key, staff_client):
    row.owner.is_active = False
    row.owner.save()


def delete_the_owner(row, key, staff_client):
    row.owner.delete()


@pytest.mark.parametrize("stop", [revoke_on_the_api, revoke_in_the_admin, delete_in_the_admin,
                                  deactivate_the_owner_in_the_admin, deactivate_the_owner, delete_the_owner])
def test_a_stopped_key_is_refused_on_v1_at_its_next_request(owner, staff_client, stop):
    add_fake_node()
    row, key = api_key_create(owner=owner, name="app")
    assert models_status(key) == 200  # verified: this process now trusts it without the database
    assert async_to_sync(api_key_verified)(key=key) == row
    stop(row, key, staff_client)
    assert async_to_sync(api_key_verified)(key=key) is None
    assert models_status(key) == 401


def test_a_verified_key_costs_no_database_query_until_a_key_changes(owner, django_assert_num_queries):
    row, key = api_key_create(owner=owner, name="app")
    with django_assert_num_queries(2):  # the key with its owner, and last_used_at
        assert api_key_authenticate(key=key) == row
    with django_assert_num_queries(0):
        assert async_to_sync(api_key_verified)(key=key) == row
    other, _ = api_key_create(owner=owner, name="other")
    other.name = "renamed"
    other.save()  # any key's change: every key is verified against the database again
    assert async_to_sync(api_key_verified)(key=key) is None
    with django_assert_num_queries(1):  # last_used_at was written less than a minute ago
        assert api_key_authenticate(key=key) == row


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="over Redis a process reads the stamp at intervals")
def test_requests_together_read_the_stamp_once_and_another_process_revocation_counts_after_the_interval(
        owner, monkeypatch):
    from django.core.cache.backends.redis import RedisCache

    from api import services

    row, key = api_key_create(owner=owner, name="app")
    assert api_key_authenticate(key=key) == row
    now = [1000.0]
    monkeypatch.setattr(services, "_clock", lambda: now[0])
    monkeypatch.setattr(services._stamp_read, "at", -1e9)  # nothing read yet
    reads: list[str] = []
    aget = RedisCache.aget

    async def counted(self, key, *args, **kwargs):
        reads.append(key)
        return await aget(self, key, *args, **kwargs)

    monkeypatch.setattr(RedisCache, "aget", counted)

    async def requests(n: int) -> list:
        return await asyncio.gather(*(api_key_verified(key=key) for _ in range(n)))

    assert async_to_sync(requests)(20) == [row] * 20
    assert reads == [services.STAMP_KEY]  # twenty requests, one read
    cache.set(services.STAMP_KEY, "written by another head process", timeout=None)  # its revocation
    assert async_to_sync(requests)(5) == [row] * 5  # within the interval: the stamp as this process read it
    now[0] += services.STAMP_READ_S
    assert async_to_sync(requests)(5) == [None] * 5  # verified against the database again
    assert len(reads) == 2


def test_a_key_is_accepted_when_its_last_used_stamp_cannot_be_written(owner, monkeypatch, caplog):
    """Two first requests of a key at once both write the stamp; SQLite may refuse one ("database table is locked")."""
    row, key = api_key_create(owner=owner, name="app")

    def locked(self, **fields):
        raise OperationalError("database table is locked: api_apikey")

    monkeypatch.setattr(QuerySet, "update", locked)
    assert api_key_authenticate(key=key) == row
    assert f"could not stamp key {row.prefix} as used" in caplog.text


def test_a_quota_edited_in_the_admin_applies_at_once(owner, staff_client):
    row, key = api_key_create(owner=owner, name="app")
    assert async_to_sync(request)("GET", "/v1/models", key=key).headers["x-ratelimit-limit-requests"] == "600"
    response = staff_client.post(f"/admin/api/apikey/{row.pk}/change/", {
        "name": "app", "owner": owner.pk, "requests_per_minute": "7", "tokens_per_minute": "",
        "tokens_per_day": "", "concurrent_streams": "", "priority": "normal", "weight": "1", "max_waiting": ""})
    assert response.status_code == 302, response.content
    assert async_to_sync(request)("GET", "/v1/models", key=key).headers["x-ratelimit-limit-requests"] == "7"


async def test_an_open_socket_is_closed_at_its_next_generate_once_its_key_is_revoked(owner):
    from api.services import api_key_revoke
    from fleet.routing import websocket_urlpatterns

    add_fake_node()
    row, key = await sync_to_async(api_key_create)(owner=owner, name="app")
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/v1/generate",
                                 headers=[(b"authorization", f"Bearer {key}".encode())])
    assert (await comm.connect())[0]
    await sync_to_async(api_key_revoke)(key=row)
    await comm.send_json_to({"type": "generate", "id": "a", "model": "smollm2", "prompt": "Hi"})
    error = await comm.receive_json_from(timeout=3)
    assert error["code"] == "unauthorized" and "revoked" in error["message"]
    closed = await comm.receive_output(timeout=3)
    assert closed["type"] == "websocket.close" and closed["code"] == 4401


# --- two head processes on Redis ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    if not os.environ.get("REDIS_URL"):
        pytest.skip("head processes share the revocation stamp through Redis")
    tmp = tmp_path_factory.mktemp("keys")
    first = make_head(tmp)
    first.start()
    second = make_peer_head(first, tmp)
    second.start()
    yield first, second
    second.stop()
    first.stop()


def new_key(head) -> str:
    out = head.manage("create_api_key", "--user", "admin", "--name", "revocable").stdout
    return next(line.strip() for line in out.splitlines() if line.strip().startswith("fk-"))


@pytest.mark.slow
def test_a_key_revoked_on_one_head_process_is_refused_by_the_other_within_half_a_second(heads):
    first, second = heads
    key = new_key(first)
    on_second = OpenAI(base_url=f"{second.url}/v1", api_key=key, max_retries=0)
    on_second.models.list()  # the second process verifies the key and trusts it from now on
    auth = {"Authorization": f"Bearer {key}"}
    listed = httpx.get(f"{first.url}/api/keys/", headers=auth).json()["results"]
    mine = next(k for k in listed if key.startswith(k["prefix"] + "."))
    assert httpx.delete(f"{first.url}/api/keys/{mine['id']}/", headers=auth).status_code == 204
    time.sleep(STAMP_READ_S)  # the second process reads the stamp again after this long at most
    with pytest.raises(AuthenticationError):
        on_second.models.list()


@pytest.mark.slow
def test_an_owner_deactivated_from_a_third_process_is_refused_by_a_head_within_half_a_second(heads):
    first, second = heads
    key = new_key(first)
    on_second = OpenAI(base_url=f"{second.url}/v1", api_key=key, max_retries=0)
    on_second.models.list()
    first.manage("shell", "-c", "from django.contrib.auth.models import User; "
                 "u = User.objects.get(username='admin'); u.is_active = False; u.save()")
    time.sleep(STAMP_READ_S)
    try:
        with pytest.raises(AuthenticationError):
            on_second.models.list()
    finally:
        first.manage("shell", "-c", "from django.contrib.auth.models import User; "
                     "User.objects.filter(username='admin').update(is_active=True)")
