"""Where the fleet's metric counts live: in this process, or in Redis for every head process together.

A count is a float in a series of a metric family (`Totals`: family name -> series field -> value). With REDIS_URL
each family is one Redis hash that every head process adds to with HINCRBYFLOAT, so a scrape of any process shows
the fleet's figures. Adding never waits on Redis: the counts gather in this process and a writer thread sends what
gathered once every FLUSH_S, in one MULTI/EXEC (a failed write is kept and sent with the next), so the Redis calls
a process makes for its metrics do not grow with its generations; a scrape sends its own process's first, so it
shows the other processes' counts at most FLUSH_S late. The generations waiting for a lane are per process (per
model, and per priority class and API key): each writes its own into a hash that expires unless refreshed (when
they change, and every REFRESH_S), and a scrape adds them up.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence

import redis
from django.conf import settings

from fleet.links import registry

log = logging.getLogger("fleet")

Totals = dict[str, dict[str, float]]
FLUSH_S = 1.0  # how often the writer thread sends what this process counted
REFRESH_S = 5.0  # how often a process rewrites its waiting generations when they did not change
WAITING_TTL_S = 30  # a dead process's waiting generations drop out after this


def merge(into: Totals, deltas: Totals) -> None:
    for family, series in deltas.items():
        target = into.setdefault(family, {})
        for name, value in series.items():
            target[name] = target.get(name, 0.0) + value


def local_waiting() -> dict[str, int]:
    return registry().waiting.by_model()


def local_waiting_classes() -> dict[str, dict[str, int]]:
    return registry().waiting.by_class()


def _class_fields(classes: dict[str, dict[str, int]]) -> dict[str, int]:
    return {json.dumps([kind, name]): n for kind, counts in classes.items() for name, n in counts.items()}


class LocalStore:
    """The counts of this process: the embedded default runs one head process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Totals = {}

    def add(self, deltas: Totals) -> None:
        with self._lock:
            merge(self._totals, deltas)

    def flush(self) -> None:
        """Nothing waits to be written."""

    def totals(self, families: Sequence[str]) -> Totals:
        with self._lock:
            return {family: dict(self._totals.get(family, {})) for family in families}

    def waiting(self) -> dict[str, int]:
        return local_waiting()

    def waiting_classes(self) -> dict[str, dict[str, int]]:
        return local_waiting_classes()


class RedisStore:
    """Counts shared by every head process through Redis hashes, written by a thread of this process."""

    def __init__(self, url: str, *, prefix: str, process: str | None = None) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.p = f"{prefix}metrics:"
        self.process = process or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one write at a time: a flush returns once what it took is in Redis
        self._pending: Totals = {}
        self._waiting_sent: tuple[dict[str, int], dict[str, int]] | None = None
        self._waiting_at = 0.0
        self._writer: threading.Thread | None = None

    def add(self, deltas: Totals) -> None:
        with self._lock:
            merge(self._pending, deltas)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_forever, name="fleet-metrics", daemon=True)
                self._writer.start()
                atexit.register(self._last_write)  # a head that stops sends what it counted since the last tick

    def _last_write(self) -> None:
        try:
            self.flush()
        except redis.RedisError as exc:
            log.warning("fleet metrics: the last counts could not be written to Redis (%s)", exc)

    def _keep(self, deltas: Totals) -> None:
        with self._lock:
            merge(self._pending, deltas)

    def _write_forever(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            try:
                self.tick()
            except redis.RedisError as exc:
                log.warning("fleet metrics: could not write to Redis (%s); the counts are kept for the next write",
                            exc)

    def tick(self) -> None:
        """The writer thread's write, every FLUSH_S: what was counted since the last one, and the waiting generations
        when they changed or were last written REFRESH_S ago; no call at all when there is neither."""
        with self._flushing:
            self._flush(force=False)

    def flush(self) -> None:
        """Send this process's new counts and its waiting generations now. Raises redis.RedisError (the counts
        are kept). Waits for a write the writer thread has in flight, so the counts added before it are in Redis
        when it returns."""
        with self._flushing:
            self._flush(force=True)

    def _flush(self, *, force: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        waiting = (local_waiting(), _class_fields(local_waiting_classes()))
        rewrite = force or waiting != self._waiting_sent or time.monotonic() - self._waiting_at >= REFRESH_S
        if not pending and not rewrite:
            return
        pipe = self.r.pipeline(transaction=True)
        for family, series in pending.items():
            for name, value in series.items():
                pipe.hincrbyfloat(self.p + family, name, value)
        if rewrite:
            self._waiting_hashes(pipe, *waiting)
        try:
            pipe.execute()
        except redis.RedisError:
            self._keep(pending)  # not add(): kept for the writer's next tick
            raise
        if rewrite:
            self._waiting_sent, self._waiting_at = waiting, time.monotonic()

    def _waiting_hashes(self, pipe, waiting: dict[str, int], classes: dict[str, int]) -> None:
        for key, fields in ((f"{self.p}waiting:{self.process}", waiting),
                            (f"{self.p}waiting-class:{self.process}", classes)):
            pipe.delete(key)
            if fields:
                pipe.hset(key, mapping=fields)
                pipe.expire(key, WAITING_TTL_S)

    def totals(self, families: Sequence[str]) -> Totals:
        pipe = self.r.pipeline(transaction=False)
        for family in families:
            pipe.hgetall(self.p + family)
        return {family: {name: float(value) for name, value in series.items()}
                for family, series in zip(families, pipe.execute(), strict=True)}

    def waiting(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for key in self.r.scan_iter(f"{self.p}waiting:*"):
            for model, count in self.r.hgetall(key).items():
                total[model] = total.get(model, 0) + int(count)
        return total

    def waiting_classes(self) -> dict[str, dict[str, int]]:
        """Every process's waiting generations per priority class and per API key."""
        total: dict[str, dict[str, int]] = {"priority": {}, "key": {}}
        for key in self.r.scan_iter(f"{self.p}waiting-class:*"):
            for field, count in self.r.hgetall(key).items():
                kind, name = json.loads(field)
                bucket = total.setdefault(kind, {})
                bucket[name] = bucket.get(name, 0) + int(count)
        return total

    def clear(self) -> None:
        """Tests only: forget every count under this prefix."""
        keys = list(self.r.scan_iter(f"{self.p}*"))
        if keys:
            self.r.delete(*keys)


_store: LocalStore | RedisStore | None = None


def store() -> LocalStore | RedisStore:
    """This process's store: Redis when REDIS_URL is set, else in process."""
    global _store
    if _store is None:
        _store = (RedisStore(settings.REDIS_URL, prefix=settings.FLEET_REDIS_PREFIX) if settings.REDIS_URL
                  else LocalStore())
    return _store


def store_reset() -> None:
    """Tests only: the next store() is made afresh from the settings."""
    global _store
    _store = None
