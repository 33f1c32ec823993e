"""FLEET_RECORD_WRITERS 0 (the `records_inline` fixture, tests/conftest.py): a generation record is written on the
caller's own thread, so on a test's own connection and inside its rolled-back transaction, not on a writer thread."""

from __future__ import annotations

import threading

from asgiref.sync import async_to_sync

from sessions import services
from sessions.services import GenerationTrace


def test_with_no_writers_a_record_is_written_on_the_callers_own_thread(monkeypatch, records_inline):
    threads: list[threading.Thread] = []
    monkeypatch.setattr(services, "generation_record", lambda trace: threads.append(threading.current_thread()) or 7)
    trace = GenerationTrace(gen_id="g", kind="chat", model="m", status="ok", outcome=None)
    assert async_to_sync(services.generation_record_async)(trace) == 7
    assert threads == [threading.main_thread()]
