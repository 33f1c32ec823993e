"""The head freezes what it loaded before serving out of the garbage collector's full collections (fleet/heap.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import weakref

import pytest
from django.test import override_settings

from fleet.heap import freeze_startup_heap


class Box:
    pass


PROBE = "import gc, fleet.asgi; print(gc.get_freeze_count())"


def _frozen_in_a_new_head_process(tmp_path, **env: str) -> int:
    """How many objects a fresh process has frozen once it has loaded the head's ASGI application."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FLEET_HOME": str(tmp_path), "FLEET_MDNS": "0",
                               "DJANGO_SETTINGS_MODULE": "fleet.settings", **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_the_head_application_freezes_what_it_loaded_and_the_setting_turns_it_off(tmp_path):
    assert _frozen_in_a_new_head_process(tmp_path) > 50_000  # Django, the apps and the modules
    assert _frozen_in_a_new_head_process(tmp_path, FLEET_GC_FREEZE="0") == 0


def test_frozen_objects_are_left_out_of_collections_and_still_freed_by_their_last_reference():
    gc.unfreeze()
    try:
        with override_settings(FLEET_GC_FREEZE=False):
            assert freeze_startup_heap() == 0
        cycle = Box()
        cycle.me = cycle
        collected = weakref.ref(cycle)
        del cycle  # garbage in a cycle: only a collection frees it
        tracked = Box()
        gone = weakref.ref(tracked)
        gc.disable()  # no collection by chance before the freeze's own
        assert freeze_startup_heap() > 0
        assert collected() is None  # collected first, not frozen for the life of the process
        assert not any(obj is tracked for obj in gc.get_objects())  # frozen: no collection scans it
        del tracked
        assert gone() is None  # freed by its last reference all the same
    finally:
        gc.enable()
        gc.unfreeze()


# --- the disconnect daphne sends once a response is over ----------------------------------------------------------


def _daphne_like(path: str = "/healthz"):
    """A scope, and a receive and send that behave as daphne does: the request body first, then, as soon as the
    response's last body is written, `http.disconnect`."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
    over = asyncio.Event()
    asked = []
    sent = []

    async def receive():
        asked.append(len(asked))
        if len(asked) == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await over.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            over.set()

    return scope, receive, send, sent


@pytest.mark.django_db
async def test_django_finishes_a_request_without_a_request_aborted_once_its_response_is_over(monkeypatch):
    """Django listens for the disconnect while it finishes a request; daphne sends one as soon as the last body is
    written. Handed to Django, it failed the listener with RequestAborted, and the handler, catching it, made the
    whole request cyclic garbage. Held back, the listener is cancelled instead."""
    from django.core.handlers.asgi import ASGIHandler, RequestAborted

    from fleet.asgi import application

    aborted = []
    listen = ASGIHandler.listen_for_disconnect

    async def spy(self, receive):
        try:
            return await listen(self, receive)
        except RequestAborted:
            aborted.append(True)
            raise

    monkeypatch.setattr(ASGIHandler, "listen_for_disconnect", spy)
    scope, receive, send, sent = _daphne_like()
    await asyncio.wait_for(application(scope, receive, send), 5)
    assert sent[0]["status"] == 200 and sent[-1]["type"] == "http.response.body"
    assert aborted == []


async def test_a_disconnect_before_the_last_body_still_reaches_the_app():
    from fleet.heap import held_disconnect

    seen = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append((await receive())["type"])  # the client hung up mid-stream

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    await asyncio.wait_for(held_disconnect(app)({"type": "http"}, receive, send), 5)
    assert seen == ["http.disconnect"]
