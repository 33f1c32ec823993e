"""Per-key quotas: requests a minute, tokens a minute and a day (uncached prompt plus completion), streams at once.

In-process tests pin the quota clock 30 s into a minute, so the windows and the reset figures are known; they run
on whichever store the settings give (Redis with REDIS_URL, the local-memory cache without). The last tests use
real processes: two heads sharing Redis, and a real node through the official client.
"""

import os
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.test import override_settings
from openai import OpenAI, RateLimitError
from rest_framework.test import APIClient

from api.models import ApiKey
from api.services import api_key_create
from tests.api_support import FakeLink, Script, add_fake_node, request, start
from tests.factories import UserFactory
from tests.live import make_head, make_peer_head

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

NOW = 1_800_054_030.0  # 30 s into a minute, 3,570 s before midnight UTC
CHAT = "/v1/chat/completions"


def chat(**extra):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **extra}


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch):
    monkeypatch.setattr("api.quotas.clock", lambda: NOW)


async def key_with(**quotas) -> str:
    user = await sync_to_async(UserFactory)(is_staff=False, is_superuser=False)
    _, key = await sync_to_async(api_key_create)(owner=user, name="quota", quotas=quotas)
    return key


def assert_openai_429(ex, kind: str, retry_after: int) -> dict:
    assert ex.status == 429, ex.body
    error = ex.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and error["type"] == kind and error["param"] is None
    assert ex.headers["retry-after"] == str(retry_after)
    return error


async def test_requests_over_the_minute_get_a_429_with_openais_headers_and_api_counts_too(fake_node):
    key = await key_with(requests_per_minute=3, tokens_per_minute=0)
    first = await request("GET", "/v1/models", key=key)
    assert first.status == 200
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"],
            first.headers["x-ratelimit-reset-requests"]) == ("3", "2", "30s")
    assert "x-ratelimit-limit-tokens" not in first.headers  # unlimited: no figures to report
    assert (await request("GET", "/api/sessions/", key=key)).status == 200  # /api spends the same budget
    third = await request("POST", CHAT, key=key, body=chat())
    assert third.status == 200 and third.headers["x-ratelimit-remaining-requests"] == "0"
    refused = await request("POST", CHAT, key=key, body=chat())
    error = assert_openai_429(refused, "requests", 30)
    assert "3 requests a minute" in error["message"] and "Retry in 30 s" in error["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    api = await request("GET", "/api/sessions/", key=key)
    assert api.status == 429 and api.headers["retry-after"] == "30" and "throttled" in api.json()["detail"]


async def test_errors_after_auth_and_streams_carry_the_headers_too(fake_node):
    key = await key_with(requests_per_minute=10, tokens_per_minute=1000)
    bad = await request("POST", CHAT, key=key, body={"model": "smollm2", "messages": []})
    assert bad.status == 400 and bad.headers["x-ratelimit-remaining-requests"] == "9"
    assert bad.headers["x-ratelimit-limit-tokens"] == "1000" and bad.headers["x-ratelimit-reset-tokens"] == "30s"
    stream = await request("POST", CHAT, key=key, body=chat(stream=True))
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.headers["x-ratelimit-remaining-requests"] == "8"
    assert "x-ratelimit-limit-requests" not in (await request("GET", "/v1/models")).headers  # 401: no key, none


async def test_tokens_count_uncached_prompt_and_completion_tokens_and_a_spent_minute_is_a_429():
    # Each generation: 11 prompt tokens of which 3 cached, 4 completion tokens: the node spent 8 + 4 = 12.
    add_fake_node(FakeLink(script=Script(prompt_tokens=11, cached_tokens=3)))
    key = await key_with(requests_per_minute=0, tokens_per_minute=20)
    first = await request("POST", CHAT, key=key, body=chat())
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert first.headers["x-ratelimit-remaining-tokens"] == "20"  # counted when a generation ends
    second = await request("POST", CHAT, key=key, body=chat())
    assert second.status == 200 and second.headers["x-ratelimit-remaining-tokens"] == "8"
    refused = await request("POST", CHAT, key=key, body=chat())
    error = assert_openai_429(refused, "tokens", 30)
    assert "20 tokens a minute" in error["message"] and "has spent 24" in error["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    models = await request("GET", "/v1/models", key=key)
    assert models.status == 200  # listing models spends no tokens, so it is not refused


async def test_tokens_per_day_are_a_429_until_midnight_utc():
    add_fake_node(FakeLink(script=Script(prompt_tokens=11, cached_tokens=3)))
    key = await key_with(tokens_per_minute=0, tokens_per_day=10)
    first = await request("POST", "/v1/completions", key=key, body={"model": "smollm2", "prompt": "Once"})
    assert first.status == 200 and first.headers["x-ratelimit-limit-tokens-day"] == "10"
    assert first.headers["x-ratelimit-reset-tokens-day"] == "59m30s"
    error = assert_openai_429(await request("POST", CHAT, key=key, body=chat()), "tokens", 3570)
    assert "10 tokens a day" in error["message"] and "has spent 12" in error["message"]


async def test_embeddings_spend_their_prompt_tokens(fake_node):
    key = await key_with(tokens_per_minute=100)
    assert (await request("POST", "/v1/embeddings", key=key, body={"model": "smollm2", "input": "a cat"})).status == 200
    after = await request("GET", "/v1/models", key=key)
    assert after.headers["x-ratelimit-remaining-tokens"] == "95"  # the fake node reports 5 prompt tokens


async def test_a_streams_slot_is_released_when_it_ends_or_its_client_goes_away():
    link = add_fake_node(FakeLink(script=lambda spec: Script(hang=spec.get("max_tokens") == 99)), lanes=4)
    key = await key_with(concurrent_streams=1)
    hanging = await start("POST", CHAT, key=key, body=chat(stream=True, max_tokens=99))
    await hanging.wait(lambda e: e.status is not None)
    error = assert_openai_429(await request("POST", CHAT, key=key, body=chat()), "requests", 1)
    assert "1 generations at once" in error["message"]
    await hanging.close()  # the client goes away: the node's lane is cancelled and the slot freed
    assert len(link.cancelled) == 1
    assert (await request("POST", CHAT, key=key, body=chat(stream=True))).status == 200  # ran to its end
    assert (await request("POST", CHAT, key=key, body=chat())).status == 200
    assert (await request("POST", CHAT, key=key, body=chat(model="nobody-serves-it"))).status == 404
    assert (await request("POST", CHAT, key=key, body=chat())).status == 200  # a failed one frees its slot too
    assert (await request("POST", CHAT, key=key, body=chat(messages=[]))).status == 400
    assert (await request("POST", CHAT, key=key, body=chat())).status == 200  # and so does a refused body


async def test_a_session_continued_on_the_api_spends_tokens_and_takes_a_slot():
    add_fake_node(FakeLink(script=Script(prompt_tokens=11, cached_tokens=3)))
    user = await sync_to_async(UserFactory)(is_staff=False, is_superuser=False)
    _, key = await sync_to_async(api_key_create)(owner=user, name="q", quotas={"tokens_per_minute": 12})
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    created = await sync_to_async(api.post)("/api/sessions/", {"model": "smollm2"}, format="json")
    url = f"/api/sessions/{created.json()['id']}/messages/"
    assert (await sync_to_async(api.post)(url, {"content": "Hi"}, format="json")).status_code == 200
    refused = await sync_to_async(api.post)(url, {"content": "Again"}, format="json")
    assert refused.status_code == 429 and refused.json()["code"] == "rate_limit_exceeded"
    assert refused.headers["Retry-After"] == "30"


# --- the client websocket ---------------------------------------------------------------------------------------


async def socket(key: str) -> WebsocketCommunicator:
    from fleet.routing import websocket_urlpatterns

    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/v1/generate",
                                 headers=[(b"authorization", f"Bearer {key}".encode())])
    assert (await comm.connect())[0]
    return comm


async def until_end(comm, *client_ids):
    """The last frame (done or error) of each generation, in the order of `client_ids`."""
    ends = {}
    while set(client_ids) - set(ends):
        frame = await comm.receive_json_from(timeout=5)
        if frame["type"] in ("done", "error"):
            ends[frame["id"]] = frame
    return ends[client_ids[0]] if len(client_ids) == 1 else [ends[i] for i in client_ids]


async def test_the_websocket_refuses_a_generation_over_the_streams_limit_with_an_error_frame():
    link = add_fake_node(FakeLink(script=Script(hang=True)), lanes=4)
    key = await key_with(concurrent_streams=1)
    comm = await socket(key)
    await comm.send_json_to({"type": "generate", "id": "a", "model": "smollm2", "prompt": "Hi"})
    assert (await comm.receive_json_from(timeout=5))["type"] == "token"
    await comm.send_json_to({"type": "generate", "id": "b", "model": "smollm2", "prompt": "Hi"})
    refused = await until_end(comm, "b")
    assert refused["code"] == "rate_limit_exceeded" and refused["retry_after"] == 1
    assert "1 generations at once" in refused["message"]
    await comm.send_json_to({"type": "cancel", "id": "a"})
    assert (await until_end(comm, "a"))["finish_reason"] == "cancelled"
    await comm.send_json_to({"type": "generate", "id": "bad", "model": "smollm2", "messages": []})
    assert (await until_end(comm, "bad"))["code"] == "invalid_request"
    await comm.send_json_to({"type": "generate", "id": "c", "model": "smollm2", "prompt": "Hi"})
    assert (await comm.receive_json_from(timeout=5))["id"] == "c"  # the cancelled and the refused freed theirs
    await comm.disconnect()  # closing the socket frees "c"'s slot
    assert len(link.cancelled) == 2
    again = await socket(key)
    await again.send_json_to({"type": "generate", "id": "d", "model": "smollm2", "prompt": "Hi"})
    assert (await again.receive_json_from(timeout=5))["type"] == "token"
    await again.disconnect()


async def test_the_websocket_counts_requests_and_tokens():
    add_fake_node(FakeLink(script=Script(prompt_tokens=11, cached_tokens=3)))
    key = await key_with(requests_per_minute=0, tokens_per_minute=12)
    comm = await socket(key)
    await comm.send_json_to({"type": "generate", "id": 1, "model": "smollm2", "prompt": "Hi"})
    assert (await until_end(comm, 1))["type"] == "done"
    await comm.send_json_to({"type": "generate", "id": 2, "model": "smollm2", "prompt": "Hi"})
    refused = await until_end(comm, 2)
    assert refused["code"] == "rate_limit_exceeded" and refused["retry_after"] == 30
    assert "12 tokens a minute" in refused["message"]
    await comm.disconnect()
    key = await key_with(requests_per_minute=1)
    comm = await socket(key)
    for client_id in (3, 4):
        await comm.send_json_to({"type": "generate", "id": client_id, "model": "smollm2", "prompt": "Hi"})
    done, refused = await until_end(comm, 3, 4)
    assert done["type"] == "done" and "1 requests a minute" in refused["message"]
    await comm.disconnect()


async def test_settings_give_the_defaults_and_a_keys_own_figures_win(fake_node):
    plain, own = await key_with(), await key_with(requests_per_minute=7)
    with override_settings(FLEET_QUOTA_REQUESTS_PER_MINUTE=5):
        assert (await request("GET", "/v1/models", key=plain)).headers["x-ratelimit-limit-requests"] == "5"
        assert (await request("GET", "/v1/models", key=own)).headers["x-ratelimit-limit-requests"] == "7"
    row = await sync_to_async(ApiKey.objects.get)(prefix=own.partition(".")[0])
    assert row.tokens_per_minute is None  # empty: the default applies


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="the calls a generation makes to Redis")
def test_a_key_with_no_limit_costs_redis_no_call_a_generation_and_its_counts_arrive_once_a_second():
    import threading
    import uuid

    import redis

    from api.quota_counts import Limits, RedisQuotaStore, Want, Windows
    from tests.redis_monitor import Monitor

    prefix = f"fleet-quota-{uuid.uuid4().hex[:8]}:"
    store = RedisQuotaStore(os.environ["REDIS_URL"], prefix)
    store.tally._writer = threading.Thread(target=lambda: None)  # only the flush below writes the tally
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    monitor = Monitor(client, db=client.connection_pool.connection_kwargs.get("db", 0), prefix=prefix)
    base, window = f"{prefix}quota:key:a:", Windows.at(NOW)
    store._sync.ping()  # its connection is open before the count

    def calls() -> dict[str, int]:  # each async_to_sync runs a loop of its own, whose client opens a connection
        return {kind: n for kind, n in monitor.stop().items() if not kind.startswith("hello")}

    async def generations(limits: Limits, slot: str, n: int) -> None:
        for _ in range(n):
            counts = await store.admit("key:a", limits, Want(tokens=True, stream=bool(slot)), slot, NOW)
            assert not counts.refused
            await store.settle("key:a", 7, slot, NOW, token_limits=limits.tokens())

    try:
        monitor.start()
        async_to_sync(generations)(Limits(0, 0, 0, 0), "", 10)
        assert calls() == {}  # ten generations of a key with no limit: no call
        monitor.start()
        store.flush()  # what the tally's writer sends every FLUSH_S
        assert calls() == {"multi[expire quota, incrby quota]": 1}
        assert [int(client.get(f"{base}{k}")) for k in (f"r:{window.minute}", f"t:{window.minute}",
                                                         f"d:{window.day}")] == [10, 70, 70]
        monitor.start()  # a key with a token limit and a streams limit: one admission, one settlement
        async_to_sync(generations)(Limits(0, 100, 0, 1), "slot-1", 1)
        assert calls() == {"evalsha quota_admit": 1, "multi[expire quota, incrby quota, zrem quota]": 1}
        assert int(client.get(f"{base}t:{window.minute}")) == 77
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)


# --- real processes -------------------------------------------------------------------------------------------


def a_fresh_window(period: int, seconds_needed: float) -> None:
    """Wait for the next window (a minute, a day) when less than `seconds_needed` of this one is left: the counts
    are per window, and a test that straddled two would see both."""
    left = period - time.time() % period
    if left < seconds_needed:
        time.sleep(left + 0.05)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="head processes count together through Redis")
def test_two_head_processes_count_a_keys_requests_together(tmp_path):
    first = make_head(tmp_path, extra_env={"FLEET_QUOTA_REQUESTS_PER_MINUTE": "4"})
    first.start()
    second = make_peer_head(first, tmp_path)
    second.start()
    try:
        clients = [OpenAI(base_url=f"{h.url}/v1", api_key=first.api_key, max_retries=0) for h in (first, second)]
        a_fresh_window(60, 20)
        remaining = []
        for turn in range(4):
            raw = clients[turn % 2].models.with_raw_response.list()
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["3", "2", "1", "0"]
        for client in clients:
            with pytest.raises(RateLimitError) as refused:
                client.models.list()
            assert refused.value.code == "rate_limit_exceeded"
    finally:
        second.stop()
        first.stop()


@pytest.mark.slow
def test_a_real_node_spends_uncached_prompt_and_completion_tokens(live_head, live_node):
    out = live_head.manage("create_api_key", "--user", "admin", "--name", "quota", "--tokens-per-minute", "0",
                           "--tokens-per-day", "1000000").stdout
    key = next(line.strip() for line in out.splitlines() if line.strip().startswith("fk-"))
    client = OpenAI(base_url=f"{live_head.url}/v1", api_key=key, max_retries=0, timeout=120)
    system = {"role": "system", "content": "You answer questions about bicycles in one short sentence. " * 20}
    remaining, usages = [], []
    a_fresh_window(86400, 120)
    for question in ("Do you repair tyres?", "Do you sell helmets?"):
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=[system, {"role": "user", "content": question}], max_tokens=8, temperature=0)
        remaining.append(int(raw.headers["x-ratelimit-remaining-tokens-day"]))
        usages.append(raw.parse().usage)
    remaining.append(int(client.models.with_raw_response.list().headers["x-ratelimit-remaining-tokens-day"]))
    spent = [u.prompt_tokens - u.prompt_tokens_details.cached_tokens + u.completion_tokens for u in usages]
    assert usages[1].prompt_tokens_details.cached_tokens > usages[1].prompt_tokens // 2  # the system prompt
    assert remaining == [1_000_000, 1_000_000 - spent[0], 1_000_000 - spent[0] - spent[1]]


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_head_process_that_exits_sends_the_tally_it_gathered_since_its_last_write():
    """An unlimited key's counts go to Redis once a second: a process that stops before then still sends them."""
    import subprocess
    import sys
    import uuid

    import redis

    prefix = f"fleet-quota-{uuid.uuid4().hex[:8]}:"
    script = ("import django, os; django.setup()\n"
              "from api.quota_counts import RedisQuotaStore\n"
              f"RedisQuotaStore(os.environ['REDIS_URL'], {prefix!r}).tally.add({prefix!r} + 'counted', 7, 60)\n")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "fleet.settings"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)  # exits before the first write
    r = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        assert r.get(prefix + "counted") == b"7"
    finally:
        r.delete(prefix + "counted")
