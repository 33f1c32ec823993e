"""Database writes that a request awaits but need not make on its own thread: a few long-lived writer threads.

Under ASGI, Django gives each request a thread of its own for its `sync_to_async` work, so a request that writes its
generation record opened a database connection for that one write and closed it when the response ended (with
SQLite that open and close cost more than the write). Writer threads keep their connections open between writes.
A write that fails with a database error (its connection broke: a database restarted, an idle connection dropped)
is made once more on a new connection. One that fails because the database cannot be reached (an OperationalError or
InterfaceError: a PostgreSQL restart, an outage) is then made again, backing off from RETRY_FIRST_S to RETRY_MAX_S,
until the database is back or FLEET_RECORD_RETRY_S have passed: a 10 s outage lost 37 of 258 records whose
clients had their whole answers. Any other error (an integrity or data error: the data, not the database) reaches
the caller at once. The caller's
cancellation never drops a queued write: it is made all the same. `close` (at exit, or after a test) makes every
queued write first, and a write that comes after it is made in a thread of its own.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError, connections

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0


class Writers:
    """`count` threads taking calls from one queue, each keeping its own database connections open."""

    def __init__(self, count: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"fleet-writer-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a writer thread; its result, or its exception. After `close`, in a thread of its own."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            late = self._closed
            if not late:
                self._queue.put((future, fn, args))
        if late:  # a caller that raced the close (a request still ending as a test or the process ends)
            threading.Thread(target=self._late, args=(future, fn, args), name="fleet-writer-late").start()
        return await asyncio.shield(asyncio.wrap_future(future))

    def close(self) -> None:
        """Make what is queued, then stop the threads and close their connections."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                self._make(*item)
        finally:
            connections.close_all()

    def _late(self, future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._make(future, fn, args)
        finally:
            connections.close_all()

    @staticmethod
    def _make(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(_call(fn, args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    try:
        return fn(*args)
    except IntegrityError:
        raise  # the data, not the connection
    except DatabaseError as exc:
        log.warning("writer: %s failed (%s); again on a new database connection", fn.__name__, exc)
        connections.close_all()
    from django.conf import settings

    deadline, delay = time.monotonic() + settings.FLEET_RECORD_RETRY_S, RETRY_FIRST_S
    while True:
        try:
            return fn(*args)
        except (OperationalError, InterfaceError) as exc:  # the database cannot be reached: wait for it
            # SQLite is a local file, never away: its OperationalError is a lock, which the caller hears of at once
            if connections["default"].vendor == "sqlite" or time.monotonic() + delay > deadline:
                log.error("writer: %s failed for %s s (%s); given up", fn.__name__, settings.FLEET_RECORD_RETRY_S, exc)
                raise
            log.warning("writer: %s failed (%s); again in %.1f s", fn.__name__, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            connections.close_all()


_writers: Writers | None = None
_lock = threading.Lock()


def writers() -> Writers:
    """This process's writers, started at first use: FLEET_RECORD_WRITERS threads (one on SQLite, whose writes take
    turns anyway)."""
    global _writers
    with _lock:
        if _writers is None:
            from django.conf import settings

            _writers = Writers(settings.FLEET_RECORD_WRITERS)
        return _writers


def writers_close() -> None:
    """Make every queued write and stop the writers (the next use starts new ones)."""
    global _writers
    with _lock:
        current, _writers = _writers, None
    if current is not None:
        current.close()


atexit.register(writers_close)
