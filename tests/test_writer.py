"""sessions.writer: generation records written on long-lived writer threads, whose connections stay open."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from asgiref.sync import sync_to_async
from django.db import IntegrityError, OperationalError, connections

from fleet.dispatch import Outcome
from sessions import services, writer
from sessions.models import Generation
from sessions.services import GenerationTrace, generation_record_async
from sessions.writer import Writers, writers, writers_close
from tests.api_support import add_fake_node, request

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)


def trace() -> GenerationTrace:
    now = time.time()
    outcome = Outcome(node="gpu-1", text="Paris.", completion_tokens=3, prompt_tokens=20, finish_reason="stop",
                      started_at=now - 1.0, first_token_at=now - 0.5)
    return GenerationTrace(gen_id=uuid.uuid4().hex, kind="chat", model="smollm2", status="done", outcome=outcome,
                           finished_at=now)


async def test_a_writer_keeps_its_database_connection_between_writes(monkeypatch, settings):
    settings.FLEET_RECORD_WRITERS = 1
    wrapper = type(connections["default"])
    opened: list[str] = []
    original = wrapper.get_new_connection

    def counted(self, params):
        opened.append(threading.current_thread().name)
        return original(self, params)

    monkeypatch.setattr(wrapper, "get_new_connection", counted)
    writers_close()  # a writer of this test, whose connections it counts
    records = [await generation_record_async(trace()) for _ in range(3)]
    assert [name for name in opened if name.startswith("fleet-writer-")] == ["fleet-writer-0"]
    assert await sync_to_async(Generation.objects.filter(pk__in=[r.pk for r in records]).count)() == 3


async def test_a_write_that_fails_on_its_connection_is_made_once_more_on_a_new_one(caplog, monkeypatch):
    calls, closed = [], []
    monkeypatch.setattr(writer.connections, "close_all", lambda: closed.append(len(calls)))

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return "written"

    assert await Writers(1).run(flaky) == "written"
    assert closed[0] == 1  # closed after the first try, before the second
    assert "again on a new database connection" in caplog.text

    def duplicate():
        calls.append(1)
        raise IntegrityError("duplicate key")

    calls.clear()
    with pytest.raises(IntegrityError):
        await Writers(1).run(duplicate)
    assert len(calls) == 1  # the data, not the connection: not made again


async def test_a_write_waits_out_a_database_outage(caplog, monkeypatch):
    """A 10 s PostgreSQL outage lost 37 of 258 records whose clients had their answers: each write tried twice."""
    monkeypatch.setattr(writer, "RETRY_MAX_S", 0.2)
    monkeypatch.setattr(type(writer.connections["default"]), "vendor", "postgresql")  # SQLite is never away
    calls = []

    def down_a_while():
        calls.append(time.monotonic())
        if len(calls) < 6:
            raise OperationalError("connection refused: is the server running?")
        return "written"

    assert await Writers(1).run(down_a_while) == "written"
    assert len(calls) == 6 and "again in" in caplog.text

    def bad_data():
        calls.append(1)
        raise writer.DatabaseError("invalid byte sequence")  # the data: a second try, then the caller

    calls.clear()
    with pytest.raises(writer.DatabaseError):
        await Writers(1).run(bad_data)
    assert len(calls) == 2


@pytest.mark.skipif(connections["default"].vendor != "postgresql", reason="SQLite has no server to drop a connection")
async def test_a_record_is_written_after_the_database_dropped_the_writers_connection():
    await generation_record_async(trace())

    def backend_pid():
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    pid = await writers().run(backend_pid)

    def terminate():
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])

    await sync_to_async(terminate)()
    record = await generation_record_async(trace())
    assert await sync_to_async(Generation.objects.filter(pk=record.pk).exists)()
    current = await writers().run(backend_pid)
    assert current != pid
    await asyncio.to_thread(writers_close)

    def connected(backend: int) -> bool:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [backend])
            return cursor.fetchone()[0] == 1

    for _ in range(50):  # the server ends the backend a moment after the client closed its socket
        if not await sync_to_async(connected)(current):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the writer's connection stayed open after its writer stopped")


async def test_a_cancelled_caller_does_not_drop_its_queued_write():
    pool = Writers(1)
    started, release = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(10)

    blocker = asyncio.ensure_future(pool.run(hold))
    await asyncio.to_thread(started.wait, 10)
    record = trace()
    waiting = asyncio.ensure_future(pool.run(services.generation_record, record))
    await asyncio.sleep(0.05)
    waiting.cancel()
    release.set()
    await blocker
    await asyncio.to_thread(pool.close)  # makes what is queued, then stops
    assert await sync_to_async(Generation.objects.filter(pk=uuid.UUID(record.gen_id)).exists)()


async def test_a_requests_record_is_written_by_a_writer_thread(bearer, monkeypatch):
    add_fake_node()
    threads: list[str] = []
    original = services.generation_record

    def spy(record):
        threads.append(threading.current_thread().name)
        return original(record)

    monkeypatch.setattr(services, "generation_record", spy)
    exchange = await request("POST", "/v1/chat/completions", key=bearer, body={
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
    assert exchange.status == 200
    assert threads and threads[0].startswith("fleet-writer-")


async def test_a_write_after_the_writers_closed_is_still_made():
    pool = Writers(1)
    await asyncio.to_thread(pool.close)
    record = await pool.run(services.generation_record, trace())
    assert await sync_to_async(Generation.objects.filter(pk=record.pk).exists)()
