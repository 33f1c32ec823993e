"""Where the fleet's metric counts live: in this process, or in Redis for every head process together.

A count is a float in a series of a metric family (`Totals`: family name -> series field -> value). With REDIS_URL
each family is one Redis hash that every head process adds to with HINCRBYFLOAT, so a scrape of any process shows
the fleet's figures. Adding never waits on Redis: the counts gather in this process and a writer thread sends them
in one MULTI/EXEC as soon as they come (a failed write is kept and sent with the next). The generations waiting for
a lane are per process (per model, and per priority class and API key): each writes its own into a hash that
expires unless refreshed, and a scrape adds them up.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Sequence

import redis
from django.conf import settings

log = logging.getLogger("fleet")

Totals = dict[str, dict[str, float]]
REFRESH_S = 5.0  # how often a process rewrites its waiting generations when nothing else happens
WAITING_TTL_S = 30  # a dead process's waiting generations drop out after this


def merge(into: Totals, deltas: Totals) -> None:
    for family, series in deltas.items():
        target = into.setdefault(family, {})
        for name, value in series.items():
            target[name] = target.get(name, 0.0) + value


def local_waiting() -> dict[str, int]:
    from fleet.dispatch import waiting_by_model

    return waiting_by_model()


def local_waiting_classes() -> dict[str, dict[str, int]]:
    from fleet.dispatch import waiting_by_class

    return waiting_by_class()


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
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None

    def add(self, deltas: Totals) -> None:
        with self._lock:
            merge(self._pending, deltas)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_forever, name="fleet-metrics", daemon=True)
                self._writer.start()
        self._wake.set()

    def _keep(self, deltas: Totals) -> None:
        with self._lock:
            merge(self._pending, deltas)

    def _write_forever(self) -> None:
        while True:
            self._wake.wait(REFRESH_S)
            self._wake.clear()
            try:
                self.flush()
            except redis.RedisError as exc:
                log.warning("fleet metrics: could not write to Redis (%s); the counts are kept for the next write",
                            exc)

    def flush(self) -> None:
        """Send this process's new counts and its waiting generations now. Raises redis.RedisError (the counts
        are kept). Waits for a write the writer thread has in flight, so the counts added before it are in Redis
        when it returns."""
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        waiting, classes = local_waiting(), _class_fields(local_waiting_classes())
        pipe = self.r.pipeline(transaction=True)
        for family, series in pending.items():
            for name, value in series.items():
                pipe.hincrbyfloat(self.p + family, name, value)
        key = f"{self.p}waiting:{self.process}"
        pipe.delete(key)
        if waiting:
            pipe.hset(key, mapping=waiting)
            pipe.expire(key, WAITING_TTL_S)
        key = f"{self.p}waiting-class:{self.process}"
        pipe.delete(key)
        if classes:
            pipe.hset(key, mapping=classes)
            pipe.expire(key, WAITING_TTL_S)
        try:
            pipe.execute()
        except redis.RedisError:
            self._keep(pending)  # not add(): that would wake the writer at once, in a loop while Redis is down
            raise

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
