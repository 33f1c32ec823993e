"""Each HTTP request's synchronous work runs on a thread lent from a pool, not on a thread started for it
(fleet/threads.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from channels.testing import HttpCommunicator
from django.core.signals import request_finished

from fleet.threads import THREAD_PREFIX, ExecutorPool, PooledThreadsHandler


@pytest.fixture
def finished_on():
    """The threads Django sent request_finished on (from response.close, the request's last synchronous step)."""
    threads: list[threading.Thread] = []

    def note(**_):
        threads.append(threading.current_thread())

    request_finished.connect(note)
    yield threads
    request_finished.disconnect(note)


async def _get(app, path: str = "/healthz") -> dict:
    """The response, once the handler has returned (after response.close)."""
    communicator = HttpCommunicator(app, "GET", path)
    response = await communicator.get_response(timeout=10)
    await communicator.wait(timeout=10)
    return response


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_sequential_requests_reuse_one_pooled_thread(finished_on):
    app = PooledThreadsHandler(ExecutorPool(size=4))
    for _ in range(5):
        assert (await _get(app))["status"] == 200
    assert len(finished_on) == 5
    assert all(thread.name.startswith(THREAD_PREFIX) for thread in finished_on)  # ours, not Django's own
    assert len(set(finished_on)) == 1  # one thread, lent again: none started for the later four
    assert len(app.pool) == 1


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_overlapping_requests_each_get_a_thread_of_their_own(finished_on):
    app = PooledThreadsHandler(ExecutorPool(size=1))
    responses = await asyncio.gather(*(_get(app) for _ in range(3)))
    assert [r["status"] for r in responses] == [200, 200, 200]
    assert len(set(finished_on)) == 3  # no request waited on another's thread
    assert len(app.pool) == 1  # the pool keeps at most its size; the rest were shut down


def test_an_executor_lent_out_is_not_lent_again_until_given_back():
    pool = ExecutorPool(size=2)
    first, second = pool.borrow(), pool.borrow()
    assert first is not second
    pool.give_back(first)
    assert pool.borrow() is first
    pool.discard(second)
    with pytest.raises(RuntimeError):  # shut down, never lent again
        second.submit(print)


@pytest.mark.asyncio
async def test_a_request_that_failed_does_not_give_its_thread_back(monkeypatch):
    app = PooledThreadsHandler(ExecutorPool(size=4))

    async def fail(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(app, "handle", fail)
    with pytest.raises(RuntimeError):
        await app({"type": "http"}, None, None)
    assert len(app.pool) == 0


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_heads_application_serves_http_on_pooled_threads(finished_on):
    from fleet.asgi import application

    for _ in range(2):
        assert (await _get(application))["status"] == 200
    assert [thread.name.startswith(THREAD_PREFIX) for thread in finished_on] == [True, True]
