"""Each HTTP request's synchronous work runs on a thread lent from a pool, not on a thread started for it
(fleet/threads.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from channels.testing import HttpCommunicator
from django.core.signals import request_finished
from django.http import HttpResponse, StreamingHttpResponse
from django.test import override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from fleet.apps import wire_request_started
from fleet.threads import THREAD_PREFIX, ExecutorPool, PooledThreadsHandler
from tests.api_support import on_a_fresh_loop_thread


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


# --- the response's close, in place when the request ran nothing on its thread ---------------------------------


async def _no_thread(request):
    return HttpResponse(b"ok")


async def _thread(request):
    await sync_to_async(lambda: None)()  # thread-sensitive: the request's own thread
    return HttpResponse(b"ok")


class _ClosableChunks:
    """An async body with a `close` (Django keeps it as one of the response's closers)."""

    closed_on: list[threading.Thread] = []

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        yield b"chunk"

    def close(self):
        self.closed_on.append(threading.current_thread())


async def _closable_stream(request):
    return StreamingHttpResponse(_ClosableChunks())


@csrf_exempt
async def _upload(request):
    return HttpResponse(request.FILES["file"].read())  # parsed on the event loop: the request now holds a file


urlpatterns = [path("no-thread", _no_thread), path("thread", _thread), path("closable", _closable_stream),
               path("upload", _upload)]


@pytest.fixture
def loop_thread_close(finished_on):
    """Each test's requests run on an event loop in a thread with no database connection, as the head's loop thread
    (tests.api_support.on_a_fresh_loop_thread), with request_started wired as the head wires it (Django's test
    client, used by other tests, connects a receiver to it again)."""
    wire_request_started()
    return finished_on


@override_settings(ROOT_URLCONF=__name__)
def test_a_request_that_ran_nothing_on_its_thread_is_closed_in_place(loop_thread_close):
    app = PooledThreadsHandler(ExecutorPool(size=4))
    response, loop_thread = on_a_fresh_loop_thread(lambda: _get(app, "/no-thread"))
    assert (response["status"], response["body"]) == (200, b"ok")
    assert loop_thread_close == [loop_thread]  # sent once, on the event loop's thread: no hop


@override_settings(ROOT_URLCONF=__name__)
def test_a_request_that_used_its_thread_is_closed_there(loop_thread_close):
    app = PooledThreadsHandler(ExecutorPool(size=4))

    async def both():
        assert (await _get(app, "/thread"))["status"] == 200
        assert (await _get(app, "/no-thread"))["status"] == 200  # the same executor, lent again: its mark cleared

    _, loop_thread = on_a_fresh_loop_thread(both)
    assert loop_thread_close[0].name.startswith(THREAD_PREFIX) and loop_thread_close[1:] == [loop_thread]


@override_settings(ROOT_URLCONF=__name__)
def test_a_response_with_something_to_close_is_closed_on_the_thread(loop_thread_close):
    app = PooledThreadsHandler(ExecutorPool(size=4))
    _ClosableChunks.closed_on.clear()

    async def stream():
        communicator = HttpCommunicator(app, "GET", "/closable")
        await communicator.send_input({"type": "http.request", "body": b""})
        assert (await communicator.receive_output(timeout=10))["status"] == 200
        body = b""
        while (message := await communicator.receive_output(timeout=10)).get("more_body"):
            body += message.get("body", b"")
        await communicator.wait(timeout=10)
        return body

    body, _ = on_a_fresh_loop_thread(stream)
    assert body == b"chunk"
    assert len(_ClosableChunks.closed_on) == 1 and _ClosableChunks.closed_on[0].name.startswith(THREAD_PREFIX)
    assert len(loop_thread_close) == 1 and loop_thread_close[0].name.startswith(THREAD_PREFIX)


@override_settings(ROOT_URLCONF=__name__)
def test_a_request_holding_an_uploaded_file_is_closed_on_the_thread(loop_thread_close):
    app = PooledThreadsHandler(ExecutorPool(size=4))
    body = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\nRIFF\r\n--b--\r\n")

    async def upload():
        communicator = HttpCommunicator(app, "POST", "/upload", body=body,
                                        headers=[(b"content-type", b"multipart/form-data; boundary=b"),
                                                 (b"content-length", str(len(body)).encode())])
        response = await communicator.get_response(timeout=10)
        await communicator.wait(timeout=10)
        return response

    response, _ = on_a_fresh_loop_thread(upload)
    assert (response["status"], response["body"]) == (200, b"RIFF")
    assert len(loop_thread_close) == 1 and loop_thread_close[0].name.startswith(THREAD_PREFIX)  # the file closes there
