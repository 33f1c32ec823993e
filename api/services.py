"""Writes for API keys (and the first admin, who owns the first one), and the check /v1 and the client websocket
make on every request."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from cachetools import TTLCache
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.cache import cache, caches
from django.core.cache.backends.locmem import LocMemCache
from django.db import DatabaseError, transaction
from django.utils import timezone

from api.models import ApiKey
from fleet.links import registry

KEY_PREFIX = "fk-"

log = logging.getLogger(__name__)


def _hash(key: str) -> str:
    # The key carries 256 bits of randomness, so a plain SHA-256 is enough (no slow KDF needed).
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_create(*, owner: AbstractBaseUser, name: str, quotas: dict[str, int | None] | None = None
                   ) -> tuple[ApiKey, str]:
    """Make a key (`quotas`: its own limits, and its share fields (priority, weight, max_waiting), by field name,
    None for the default); returns the row and the full key, which is shown once and never stored."""
    name = name.strip()
    if not name:
        raise ValueError("an API key needs a name")
    prefix = KEY_PREFIX + secrets.token_hex(4)
    key = f"{prefix}.{secrets.token_urlsafe(32)}"
    fields = {name: value for name, value in (quotas or {}).items()
              if value is not None or name not in ("priority", "weight")}  # those two have defaults, not "empty"
    row = ApiKey.objects.create(name=name, owner=owner, prefix=prefix, key_hash=_hash(key), **fields)
    return row, key


def api_key_revoke(*, key: ApiKey) -> bool:
    """Revoke the key; every head process refuses it from its next request on (see api_key_verified)."""
    revoked = bool(ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()))
    api_keys_changed()
    return revoked


@dataclass(frozen=True)
class FirstAdmin:
    """The first admin user and its API key. `password` and `key` are set only when they were made just now: the
    database keeps their hashes alone, so a later call can name the admin but show neither."""

    username: str
    password: str = ""
    key: str = ""

    @property
    def created(self) -> bool:
        return bool(self.password)


def first_admin_create(*, username: str = "admin") -> FirstAdmin:
    """Make the fleet's first admin (a superuser with a random password) and an API key named `first key` for it,
    with no prompt, when the database has no superuser; else return the earliest superuser's name, making nothing.
    `manage.py up` and `manage.py first_admin` both call it. A ValueError says why `username` cannot be taken."""
    users = get_user_model().objects
    username = username.strip()
    with transaction.atomic():
        existing = users.filter(is_superuser=True).order_by("date_joined", "pk").first()
        if existing is not None:
            return FirstAdmin(username=existing.get_username())
        if not username:
            raise ValueError("the admin needs a user name")
        if users.filter(**{users.model.USERNAME_FIELD: username}).exists():
            raise ValueError(f"a user named {username!r} exists and is no superuser: pick another name "
                             "(--username)")
        password = secrets.token_urlsafe(12)
        user = users.create_superuser(username, "", password)
        _, key = api_key_create(owner=user, name="first key")
    return FirstAdmin(username=username, password=password, key=key)


# Keys verified against the database, by hash, with the revocation stamp read before that check: a generation's
# time to first token should not pay a database round trip (and a thread hop) on every request. Every change that
# can stop a key (revoked, deleted, its owner deactivated) or change its quotas writes a new stamp into the Django
# cache (Redis when REDIS_URL is set, so every head process sees it) after its commit; a cached entry counts only
# while the stamp is the one it was verified under. The TTL bounds what the stamp cannot see (a raw SQL UPDATE).
# Over Redis a process reads the stamp at most once every STAMP_READ_S, however many requests come, so a revocation
# reaches every head process within that (its own at once): a request costs no Redis call for its key.
STAMP_KEY = "api-keys:stamp"
VERIFIED_TTL_S = 30.0
STAMP_READ_S = 0.5
def _verified() -> TTLCache[str, tuple[ApiKey, str | None]]:
    """This process's verified keys (by hash), on the registry."""
    return registry().own("verified-keys", lambda: TTLCache(maxsize=10_000, ttl=VERIFIED_TTL_S))
_verified_lock = threading.Lock()  # the event loop reads, sync threads write; cachetools caches are not thread-safe


def _clock() -> float:
    return time.monotonic()


class _StampRead:
    """The stamp as this process last read it from a shared cache, and the read in flight (requests arriving
    together share it)."""

    def __init__(self) -> None:
        self.value: str | None = None
        self.at = -1e9
        self.reading: asyncio.Future | None = None
        # The cache read through, kept: `cache` is Django's per-context handle, and each request's task (a context of
        # its own) made a new one with a new connection (a HELLO) for its read.
        self.cache: tuple[asyncio.AbstractEventLoop, Any] | None = None

    async def get(self) -> str | None:
        if _clock() - self.at < STAMP_READ_S:
            return self.value
        reading = self.reading
        if reading is None or reading.done() or reading.get_loop() is not asyncio.get_running_loop():
            reading = self.reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(reading)

    async def _read(self) -> str | None:
        started, loop = _clock(), asyncio.get_running_loop()
        if self.cache is None or self.cache[0] is not loop:
            self.cache = (loop, caches["default"])
        value = await self.cache[1].aget(STAMP_KEY)
        self.seen(value, started)
        return value

    def seen(self, value: str | None, at: float) -> None:
        self.value, self.at = value, at


_stamp_read = _StampRead()


def api_keys_restamp() -> None:
    """Write a new revocation stamp now: every process verifies keys against the database again (this one from its
    next request, the others within STAMP_READ_S)."""
    stamp = uuid.uuid4().hex
    cache.set(STAMP_KEY, stamp, timeout=None)
    _stamp_read.seen(stamp, _clock())


def api_keys_changed() -> None:
    """A key or its owner changed: write a new stamp once the change is committed (before it, another process
    could verify the key against the old row and cache it under the new stamp)."""
    transaction.on_commit(api_keys_restamp)


def api_keys_active(*, pks: set[Any]) -> set[Any]:
    """Which of these keys are still active: not revoked, not deleted, their owner active."""
    return set(ApiKey.objects.filter(pk__in=pks, revoked_at__isnull=True, owner__is_active=True)
               .values_list("pk", flat=True))


async def key_stamp() -> str | None:
    """The revocation stamp as this process sees it now (a new one after every change that can stop a key)."""
    return await _stamp()


async def api_key_verified(*, key: str) -> ApiKey | None:
    """The key's row when this process verified it within VERIFIED_TTL_S and no key changed since; else None
    (then verify it with api_key_authenticate). One cache read, no database access."""
    with _verified_lock:
        entry = _verified().get(_hash(key))
    if entry is None:
        return None
    row, stamp = entry
    return row if await _stamp() == stamp else None


async def _stamp() -> str | None:
    """The revocation stamp: read in place from local memory (the embedded default's cache, no I/O); from any other
    cache, as this process read it within STAMP_READ_S (a read through a thread)."""
    if isinstance(caches["default"], LocMemCache):
        return cache.get(STAMP_KEY)
    return await _stamp_read.get()


def api_key_authenticate(*, key: str) -> ApiKey | None:
    """The active key for this bearer string, or None. Updates last_used_at at most once a minute."""
    prefix, _, _ = key.partition(".")
    if not prefix.startswith(KEY_PREFIX):
        return None
    stamp = cache.get(STAMP_KEY)  # before the database read: a revocation committed after it changes the stamp
    row = ApiKey.objects.select_related("owner").filter(prefix=prefix).first()
    if row is None or not secrets.compare_digest(row.key_hash, _hash(key)) or row.revoked_at is not None:
        return None
    now = timezone.now()
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:
        try:
            ApiKey.objects.filter(pk=row.pk).update(last_used_at=now)
        except DatabaseError as exc:
            # A bookkeeping stamp: a database too busy to take it (SQLite's lock wait ran out) fails no request
            log.warning("api: could not stamp key %s as used: %s", row.prefix, exc)
    if row.owner.is_active:
        with _verified_lock:
            _verified()[_hash(key)] = (row, stamp)
    return row
