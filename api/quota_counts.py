"""The counts behind the quotas: where they live and the rule that admits a request.

In Redis when REDIS_URL is set: one Lua script per admission, so several head processes count together and two of
them cannot both take a key's last slot. A key with no limit at all is admitted without a call, and the tokens of a
key with no token limit are settled without one: what they count gathers in the process and goes to Redis once
every FLUSH_S in one MULTI/EXEC (nothing reads those counts until an operator sets a limit, so they may be that
late), so a generation of an unlimited key costs the quotas no Redis call. Else in the Django cache (local memory:
one process counts alone). Keys are per window: the UTC minute for requests and tokens a minute, the UTC day for
tokens a day.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from django.conf import settings
from django.core.cache import cache

log = logging.getLogger("api")

MINUTE_TTL_S = 120
FLUSH_S = 1.0  # how often a process sends the counts of keys with no limit on them
DAY_TTL_S = 2 * 86400
# A head process that dies with streams open cannot release their slots; in Redis they lapse after this long.
STREAM_LEASE_S = 3600


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; 0 is unlimited."""

    requests_per_minute: int
    tokens_per_minute: int
    tokens_per_day: int
    concurrent_streams: int

    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.tokens_per_day
                    or self.concurrent_streams)

    def tokens(self) -> bool:
        return bool(self.tokens_per_minute or self.tokens_per_day)


@dataclass(frozen=True, slots=True)
class Want:
    """What one admission takes: a request from the rate, a check of the token budget, a stream slot."""

    request: bool = True
    tokens: bool = False
    stream: bool = False


@dataclass(slots=True)
class Counts:
    """A key's counts in the current windows, as an admission left them, and why it refused (or "")."""

    requests: int
    tokens_minute: int
    tokens_day: int
    streams: int
    refused: str = ""


def refusal(limits: Limits, want: Want, counts: Counts) -> str:
    """Which limit an admission would cross ("" when none). The Lua script ADMIT applies the same rule."""
    if want.request and limits.requests_per_minute and counts.requests >= limits.requests_per_minute:
        return "requests"
    if want.tokens and limits.tokens_per_minute and counts.tokens_minute >= limits.tokens_per_minute:
        return "tokens_per_minute"
    if want.tokens and limits.tokens_per_day and counts.tokens_day >= limits.tokens_per_day:
        return "tokens_per_day"
    if want.stream and limits.concurrent_streams and counts.streams >= limits.concurrent_streams:
        return "streams"
    return ""


@dataclass(frozen=True, slots=True)
class Windows:
    """The windows that `now` falls in, and the seconds until each turns."""

    minute: int
    day: int
    minute_reset: float
    day_reset: float

    @classmethod
    def at(cls, now: float) -> Windows:
        minute, day = int(now // 60), int(now // 86400)
        return cls(minute, day, (minute + 1) * 60 - now, (day + 1) * 86400 - now)


def _keys(prefix: str, ident: str, w: Windows) -> list[str]:
    base = f"{prefix}quota:{ident}:"
    return [f"{base}r:{w.minute}", f"{base}t:{w.minute}", f"{base}d:{w.day}", f"{base}s"]


# --- the stores -----------------------------------------------------------------------------------------------

# KEYS: requests this minute, tokens this minute, tokens today, the key's stream slots (a sorted set by start time).
# ARGV: the four limits, want request / tokens (1 or 0), the slot id ('' for none), now, the slot lease.
ADMIT = """
local rpm, tpm, tpd, cs = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local count, tokens, slot = ARGV[5] == '1', ARGV[6] == '1', ARGV[7]
local now, lease = tonumber(ARGV[8]), tonumber(ARGV[9])
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local minute = tonumber(redis.call('GET', KEYS[2]) or '0')
local day = tonumber(redis.call('GET', KEYS[3]) or '0')
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - lease)
local streams = redis.call('ZCARD', KEYS[4])
local refused = ''
if count and rpm > 0 and requests >= rpm then refused = 'requests'
elseif tokens and tpm > 0 and minute >= tpm then refused = 'tokens_per_minute'
elseif tokens and tpd > 0 and day >= tpd then refused = 'tokens_per_day'
elseif slot ~= '' and cs > 0 and streams >= cs then refused = 'streams'
end
if refused == '' then
  if count then
    requests = redis.call('INCR', KEYS[1])
    redis.call('EXPIRE', KEYS[1], 120)
  end
  if slot ~= '' then
    redis.call('ZADD', KEYS[4], now, slot)
    redis.call('EXPIRE', KEYS[4], lease)
    streams = streams + 1
  end
end
return {refused, requests, minute, day, streams}
"""


class _Tally:
    """Counts no limit reads yet (an unlimited key's requests, a key's tokens with no token limit), gathered in this
    process and sent by a writer thread once every FLUSH_S, one MULTI/EXEC for all of them."""

    def __init__(self, client) -> None:
        self.r = client
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], int] = {}  # (Redis key, its TTL) -> amount
        self._writer: threading.Thread | None = None

    def add(self, key: str, amount: int, ttl: int) -> None:
        with self._lock:
            self._counts[(key, ttl)] = self._counts.get((key, ttl), 0) + amount
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_forever, name="fleet-quota-counts", daemon=True)
                self._writer.start()
                atexit.register(self._write_once)  # a head that stops sends what it counted since the last write

    def _write_forever(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            self._write_once()

    def _write_once(self) -> None:
        try:
            self.flush()
        except redis.RedisError as exc:
            log.warning("api quotas: could not write counts to Redis (%s); kept for the next write", exc)

    def flush(self) -> None:
        with self._lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return
        pipe = self.r.pipeline(transaction=True)
        for (key, ttl), amount in counts.items():
            pipe.incrby(key, amount).expire(key, ttl)
        try:
            pipe.execute()
        except redis.RedisError:
            with self._lock:
                for entry, amount in counts.items():
                    self._counts[entry] = self._counts.get(entry, 0) + amount
            raise


class RedisQuotaStore:
    """Counts in Redis, shared by every head process. Async callers get redis.asyncio (one client per event loop);
    DRF's sync views the sync client."""

    def __init__(self, url: str, prefix: str):
        self.url, self.prefix = url, prefix
        self._sync = redis.Redis.from_url(url)
        self._sync_admit = self._sync.register_script(ADMIT)
        self._clients: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
        self.tally = _Tally(self._sync)

    def _client(self) -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None:
            # Blocking: at a thousand streams the default pool refused its 101st connection (bench/scale.py).
            pool = redis.asyncio.BlockingConnectionPool.from_url(self.url, max_connections=64)
            client = redis.asyncio.Redis(connection_pool=pool)
            entry = self._clients[loop] = (client, client.register_script(ADMIT))
        return entry

    def _args(self, ident: str, limits: Limits, want: Want, slot: str, now: float):
        keys = _keys(self.prefix, ident, Windows.at(now))
        args = [limits.requests_per_minute, limits.tokens_per_minute, limits.tokens_per_day,
                limits.concurrent_streams, int(want.request), int(want.tokens), slot, repr(now), STREAM_LEASE_S]
        return keys, args

    @staticmethod
    def _counts(result: list) -> Counts:
        refused, *numbers = result
        return Counts(*(int(n) for n in numbers), refused=refused.decode() if isinstance(refused, bytes) else refused)

    def _unlimited(self, ident: str, limits: Limits, want: Want, now: float) -> Counts | None:
        """A key with no limit: nothing can refuse it, so its request is only counted (in the tally)."""
        if limits.any():
            return None
        if want.request:
            self.tally.add(_keys(self.prefix, ident, Windows.at(now))[0], 1, MINUTE_TTL_S)
        return Counts(0, 0, 0, 0)

    async def admit(self, ident: str, limits: Limits, want: Want, slot: str, now: float) -> Counts:
        if (counts := self._unlimited(ident, limits, want, now)) is not None:
            return counts
        _, script = self._client()
        keys, args = self._args(ident, limits, want, slot, now)
        return self._counts(await script(keys=keys, args=args))

    def admit_sync(self, ident: str, limits: Limits, want: Want, slot: str, now: float) -> Counts:
        if (counts := self._unlimited(ident, limits, want, now)) is not None:
            return counts
        keys, args = self._args(ident, limits, want, slot, now)
        return self._counts(self._sync_admit(keys=keys, args=args))

    async def settle(self, ident: str, tokens: int, slot: str, now: float, *, token_limits: bool = True) -> None:
        """The generation's tokens spent and its stream slot back. `token_limits`: the key has a token limit, which
        the next admission must see these tokens under (sent now); without one they go with the tally."""
        _, minute, day, streams = _keys(self.prefix, ident, Windows.at(now))
        if tokens and not token_limits:
            self.tally.add(minute, tokens, MINUTE_TTL_S)
            self.tally.add(day, tokens, DAY_TTL_S)
            tokens = 0
        if not tokens and not slot:
            return
        client, _ = self._client()
        pipe = client.pipeline(transaction=True)
        if tokens:
            pipe.incrby(minute, tokens).expire(minute, MINUTE_TTL_S).incrby(day, tokens).expire(day, DAY_TTL_S)
        if slot:
            pipe.zrem(streams, slot)
        await pipe.execute()

    def flush(self) -> None:
        """Send the tally now (tests; the writer thread sends it every FLUSH_S)."""
        self.tally.flush()


class CacheQuotaStore:
    """Counts in the Django cache: without REDIS_URL that is local memory, so one process counts alone.

    A lock makes check-and-count atomic here as the Lua script does in Redis. The async methods call the sync ones
    in place: local memory under a lock held for microseconds, no I/O, so a thread hop would cost more than the work.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._lock = threading.Lock()

    def admit_sync(self, ident: str, limits: Limits, want: Want, slot: str, now: float) -> Counts:
        keys = _keys(self.prefix, ident, Windows.at(now))
        with self._lock:
            got = cache.get_many(keys)
            counts = Counts(*(int(got.get(k, 0)) for k in keys))
            counts.refused = refusal(limits, want, counts)
            if not counts.refused and want.request:
                counts.requests += 1
                cache.set(keys[0], counts.requests, MINUTE_TTL_S)
            if not counts.refused and slot:
                counts.streams += 1
                cache.set(keys[3], counts.streams, None)
        return counts

    def settle_sync(self, ident: str, tokens: int, slot: str, now: float) -> None:
        _, minute, day, streams = _keys(self.prefix, ident, Windows.at(now))
        with self._lock:
            got = cache.get_many([minute, day, streams])
            if tokens:
                cache.set(minute, int(got.get(minute, 0)) + tokens, MINUTE_TTL_S)
                cache.set(day, int(got.get(day, 0)) + tokens, DAY_TTL_S)
            if slot:
                cache.set(streams, max(int(got.get(streams, 0)) - 1, 0), None)

    async def admit(self, ident: str, limits: Limits, want: Want, slot: str, now: float) -> Counts:
        return self.admit_sync(ident, limits, want, slot, now)

    async def settle(self, ident: str, tokens: int, slot: str, now: float, *, token_limits: bool = True) -> None:
        self.settle_sync(ident, tokens, slot, now)

    def flush(self) -> None:
        """Nothing waits to be written."""


_stores: dict[tuple[str, str], RedisQuotaStore | CacheQuotaStore] = {}


def quota_store() -> RedisQuotaStore | CacheQuotaStore:
    """Redis when REDIS_URL is set, else the Django cache; one per configuration (tests change settings)."""
    url, prefix = settings.REDIS_URL, settings.FLEET_REDIS_PREFIX
    store = _stores.get((url, prefix))
    if store is None:
        store = _stores[(url, prefix)] = RedisQuotaStore(url, prefix) if url else CacheQuotaStore(prefix)
    return store


