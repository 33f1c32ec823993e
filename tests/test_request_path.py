"""A /v1 generation's own work before it is placed runs on the event loop where it does no I/O: no thread hop for
the API key's revocation stamp or the quota in local memory, none for the parse of a body that reads nothing
stored (api/streaming_app.py serves it without Django's handler and middleware)."""

from __future__ import annotations

import asyncio
import gc
import threading
import uuid
import weakref

import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache

from api.errors import OpenAIError
from api.generation import PENDING, Run
from api.quota_counts import CacheQuotaStore, quota_store
from api.quotas import quota_admit
from api.services import api_key_authenticate, api_key_create, api_key_verified
from api.specs import aparse, chat_request, parses_in_place, request_for
from fleet.dispatch import GenerationStream, Tokens
from fleet.routing import websocket_urlpatterns
from fleet.selectors import context_windows
from nodes.link.messages import LinkError
from nodes.link.placement import NodeSlot
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
pytest_plugins = ["tests.api_fixtures"]

local_memory = pytest.mark.skipif(not isinstance(caches["default"], LocMemCache),
                                  reason="the embedded default's cache; Redis is reached through a thread")


@local_memory
async def test_a_verified_keys_stamp_is_read_on_the_event_loop(monkeypatch):
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


# --- the parse ------------------------------------------------------------------------------------------------

PLAIN = {"model": "smollm2",
         "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_tokens": 8, "temperature": 0.2, "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True}}
IMAGE = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]


@pytest.mark.parametrize(("body", "in_place"), [
    (PLAIN, True),
    ({"model": "smollm2", "prompt": "Once", "max_tokens": 4, "logprobs": 2, "seed": 7}, True),
    ({"model": "smollm2", "messages": "not a list"}, True),  # the parse only says what is wrong with it
    ({**PLAIN, "session": "0e9c1b0e-7f39-4c4b-8a43-2b1f2c1a0d11"}, False),
    ({**PLAIN, "grammar": "root ::= \"a\""}, False),
    ({**PLAIN, "logit_bias_handle": "0e9c1b0e-7f39-4c4b-8a43-2b1f2c1a0d11"}, False),
    ({**PLAIN, "response_format": {"type": "json_object"}}, False),
    ({**PLAIN, "tools": [{"type": "function", "function": {"name": "f"}}]}, False),
    ({**PLAIN, "a_field_added_later": 1}, False),
    ({**PLAIN, "messages": [{"role": "user", "content": IMAGE}]}, False),
    (["not", "an", "object"], False),
])
def test_a_body_is_parsed_in_place_only_when_its_parse_reads_nothing_but_the_body(body, in_place):
    assert parses_in_place(body) is in_place


async def test_aparse_parses_a_plain_body_on_the_loop_and_a_session_in_a_thread(monkeypatch):
    threads: list[bool] = []
    loop_thread = threading.get_ident()

    def spy(body, **kwargs):
        threads.append(threading.get_ident() == loop_thread)
        return request_for(body, **kwargs)

    user = await sync_to_async(UserFactory)()
    plain = await aparse(spy, PLAIN, user=user)
    assert plain.spec.messages[-1]["content"] == "Hi" and plain.spec.max_tokens == 8 and plain.stream
    with pytest.raises(OpenAIError) as refused:  # parsed in a thread, where it looked the session up
        await aparse(spy, {**PLAIN, "session": "0e9c1b0e-7f39-4c4b-8a43-2b1f2c1a0d11"}, user=user)
    assert refused.value.code == "session_not_found"
    assert threads == [True, False]


async def test_a_v1_chat_with_a_plain_body_is_parsed_on_the_loop_and_one_with_a_session_in_a_thread(
        monkeypatch, bearer):
    threads: list[bool] = []
    loop_thread = threading.get_ident()

    def spy(body, **kwargs):
        threads.append(threading.get_ident() == loop_thread)
        return chat_request(body, **kwargs)

    monkeypatch.setattr("api.v1.chat_request", spy)
    plain = await request("POST", "/v1/chat/completions", key=bearer, body=PLAIN)
    assert plain.status == 404 and b"model_not_found" in plain.body  # parsed: no node serves it
    session = await request("POST", "/v1/chat/completions", key=bearer,
                            body={**PLAIN, "session": "0e9c1b0e-7f39-4c4b-8a43-2b1f2c1a0d11"})
    assert session.status == 400 and b"session_not_found" in session.body
    assert threads == [True, False]


async def test_a_body_asking_for_max_tokens_reads_the_windows_without_a_blocking_placement_read(monkeypatch):
    def blocking_read(model):
        raise AssertionError("the placement read synchronously on the event loop (Redis would block it)")

    monkeypatch.setattr("api.specs.model_context_window", blocking_read)
    add_fake_node(context_window=1024)
    assert (await aparse(chat_request, {**PLAIN, "max_tokens": 1024})).spec.max_tokens == 1024
    with pytest.raises(OpenAIError) as refused:
        await aparse(chat_request, {**PLAIN, "max_tokens": 1025})
    assert "1024 tokens" in refused.value.message


async def test_a_websocket_generate_naming_a_session_is_parsed_in_a_thread(bearer, fake_node):
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/v1/generate",
                                 headers=[(b"authorization", f"Bearer {bearer}".encode())])
    assert (await comm.connect())[0]
    await comm.send_json_to({"type": "generate", "id": "s", **PLAIN, "session": str(uuid.uuid4())})
    error = await comm.receive_json_from(timeout=3)
    assert error["type"] == "error" and error["code"] == "session_not_found" and error["id"] == "s"
    await comm.send_json_to({"type": "generate", "id": "plain", **PLAIN})
    frames = [await comm.receive_json_from(timeout=3) for _ in range(3)]
    assert frames[-1]["type"] == "done" and frames[-1]["id"] == "plain"
    await comm.disconnect()


def test_each_models_window_is_the_largest_its_nodes_gave():
    slots = [NodeSlot("a", "a", ["m", "n"], 4, 8192), NodeSlot("b", "b", ["m"], 4, 1024), NodeSlot("c", "c", ["o"], 4)]
    assert context_windows(slots) == {"m": 8192, "n": 8192}


# --- a run's events -------------------------------------------------------------------------------------------


async def test_a_run_steps_its_stream_in_place_unless_it_must_wait_for_the_node_with_a_timeout(monkeypatch):
    """No task and no timer per event where nothing needs a timeout: with none (the websocket, a JSON answer), or
    once the node's frame is here (SSE, whose timeout only sends keep-alives). A slow node is waited for in a task,
    so the timeout gives a keep-alive and the stream goes on."""
    steps: list[asyncio.Task | None] = []
    original = GenerationStream._on_tokens

    def spy(self, event):
        steps.append(asyncio.current_task())
        return original(self, event)

    monkeypatch.setattr(GenerationStream, "_on_tokens", spy)
    here = asyncio.current_task()
    link = add_fake_node(FakeLink(script=Script(tokens=list("abcdef"))))
    run = Run(chat_request({**PLAIN, "stream": False}))
    assert [e.text for e in [e async for e in run.events()] if isinstance(e, Tokens)] == ["ab", "cd", "ef"]
    assert steps == [here] * 3
    steps.clear()
    run = Run(chat_request(PLAIN))
    while await run.next_event(timeout=5) is not None:
        pass
    assert steps == [here] * 3 and run.finished.finish_reason == "stop"
    steps.clear()
    link.script = Script(tokens=list("abcd"), delay=0.05)
    run, pending = Run(chat_request(PLAIN)), 0
    while (event := await run.next_event(timeout=0.01)) is not None:
        pending += event is PENDING
    assert pending and len(steps) == 2 and here not in steps and run.finished.finish_reason == "stop"


async def test_a_step_that_fails_over_to_another_node_is_waited_for_in_a_task_with_its_keep_alives():
    """A batch lost in transit moves the generation to another node: that step waits for the new node, so it runs
    in a task and the timeout still gives keep-alives, though a frame (the lost batch's successor) was here."""
    scripts = iter([Script(tokens=list("abcdef"), drop_seq=2), Script(tokens=list("abcdef"), start_delay=0.3)])
    plays = lambda spec: next(scripts)  # noqa: E731 - the first generation sent anywhere, then its second attempt
    add_fake_node(FakeLink(script=plays))
    add_fake_node(FakeLink(node_id="22222222-2222-2222-2222-222222222222", identity="other", script=plays))
    run, seen = Run(chat_request(PLAIN)), []
    while (event := await run.next_event(timeout=0.02)) is not None:
        seen.append("pending" if event is PENDING else type(event).__name__)
    first = seen.index("Tokens")
    assert "pending" in seen[first:] and run.finished.finish_reason == "stop"
    assert len(run.stream.outcome.nodes_used) == 2


async def test_a_node_that_cannot_be_reached_is_passed_over_for_another():
    """A node whose link another head process holds, when that process's channel is full: the generation goes to
    another node, not to the client as an internal error."""
    other = FakeLink(node_id="22222222-2222-2222-2222-222222222222", identity="other")

    class Unreachable(FakeLink):
        async def send_generate(self, gen_id, spec):
            add_fake_node(other)  # a second node, there for the second attempt only
            raise LinkError("the head process holding node 'fake-node' is not keeping up (its channel is full)")

    add_fake_node(Unreachable())
    run = Run(chat_request({**PLAIN, "stream": False}))
    text = "".join([e.text async for e in run.events() if isinstance(e, Tokens)])
    assert text == "Hello, world!" and run.finished.node == "other"
    assert run.stream.outcome.nodes_used == ["fake-node", "other"]


async def test_a_run_that_ends_in_a_task_leaves_no_cycle_for_the_garbage_collector():
    """SSE waits for a slow node in a task; the stream's end (StopAsyncIteration) comes out of that task. Caught
    with the task still in a local, it made a cycle (exception, traceback, frame, task, exception) that only a full
    collection freed: one per stream, scanned by every full collection until then."""
    add_fake_node(FakeLink(script=Script(tokens=list("ab"), delay=0.02)))
    gc.collect()
    gc.disable()
    try:
        run = Run(chat_request(PLAIN))
        while (event := await run.next_event(timeout=0.005)) is not None:
            del event
        gone = weakref.ref(run)
        del run
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_generation_route_is_the_first_pattern_tried(path):
    """Each request keeps the URL patterns it tried for as long as it streams: a generation tries only its own."""
    from django.urls import resolve

    match = resolve(path)
    assert match.view_name in ("v1-chat-completions", "v1-completions")
    assert [str(tried[1].pattern) for tried in match.tried] == ["v1/"] * len(match.tried)  # no other routes first
    assert len(match.tried) <= 2  # chat first, then completions


redis_placement = pytest.mark.skipif(not __import__("os").environ.get("REDIS_URL"),
                                     reason="the round trips of the Redis placement state")


@redis_placement
async def test_a_generation_takes_two_redis_round_trips_whatever_its_length(monkeypatch):
    """One to choose (its reply refreshes the head's snapshot of the nodes: context windows, free lanes), one at the
    end (record, evictions and release together): a 400-token stream costs no more than a 20-token one."""
    import time

    from redis.asyncio.client import Pipeline, Redis

    from fleet.dispatch import generation_stream
    from nodes.link.spec import GenerateSpec

    trips: list[str] = []
    command, execute = Redis.execute_command, Pipeline.execute

    async def counted(self, *args, **kwargs):
        trips.append(str(args[0]))
        return await command(self, *args, **kwargs)

    async def counted_pipeline(self, *args, **kwargs):
        trips.append("pipeline")
        return await execute(self, *args, **kwargs)

    monkeypatch.setattr(Redis, "execute_command", counted)
    monkeypatch.setattr(Pipeline, "execute", counted_pipeline)
    link = add_fake_node(lanes=4)

    async def trips_of(tokens: int) -> int:
        link.script = Script(tokens=["x"] * tokens, per_batch=1)
        spec = GenerateSpec(gen_id=uuid.uuid4().hex, model="smollm2", prompt="Hello there", max_tokens=tokens)
        before = len(trips)
        events = [e async for e in generation_stream(spec, deadline=time.time() + 30)]
        assert sum(len(e.ids) for e in events if isinstance(e, Tokens)) == tokens
        return len(trips) - before

    await trips_of(5)  # the first one also reads the nodes once (no snapshot yet)
    short, long = await trips_of(20), await trips_of(400)
    assert short == long <= 2, trips[-(short + long):]
