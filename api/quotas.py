"""Per-key quotas: requests a minute, tokens a minute and a day, and generations streaming at once.

Tokens are what a node really spends: prompt tokens it had to read (prompt minus cached) plus completion tokens,
counted when a generation ends. A request is admitted while its key has requests and tokens left in the current
windows (fixed windows: the UTC minute and the UTC day), so the last generation admitted may take a key past its
token limit; the next one waits for the window to turn.

The counts live in Redis when REDIS_URL is set (one Lua script per admission, so several head processes count
together and two of them cannot both take a key's last slot), else in the Django cache (local memory: one process).
The same counter of requests covers /v1, /api (as DRF's throttle) and `generate` frames on the client websocket.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from rest_framework.throttling import BaseThrottle

from api.errors import OpenAIError
from api.models import ApiKey

log = logging.getLogger("api")

MINUTE_TTL_S = 120
DAY_TTL_S = 2 * 86400
# A head process that dies with streams open cannot release their slots; in Redis they lapse after this long.
STREAM_LEASE_S = 3600


def clock() -> float:
    """The time the windows are cut from (tests replace it)."""
    return time.time()


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; 0 is unlimited."""

    requests_per_minute: int
    tokens_per_minute: int
    tokens_per_day: int
    concurrent_streams: int


def limits_for(key: ApiKey | None) -> Limits:
    """The key's own limits where it has them, else the FLEET_QUOTA_* defaults."""
    def pick(field: str, setting: str) -> int:
        own = getattr(key, field, None) if key is not None else None
        return own if own is not None else getattr(settings, setting)

    return Limits(pick("requests_per_minute", "FLEET_QUOTA_REQUESTS_PER_MINUTE"),
                  pick("tokens_per_minute", "FLEET_QUOTA_TOKENS_PER_MINUTE"),
                  pick("tokens_per_day", "FLEET_QUOTA_TOKENS_PER_DAY"),
                  pick("concurrent_streams", "FLEET_QUOTA_CONCURRENT_STREAMS"))


def tokens_spent(prompt: int, cached: int, completion: int) -> int:
    """What a generation cost its node: the prompt tokens it read (a cached prefix is almost free) and wrote."""
    return max(prompt - cached, 0) + completion


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


class RedisQuotaStore:
    """Counts in Redis, shared by every head process. Async callers get redis.asyncio (one client per event loop);
    DRF's sync views the sync client."""

    def __init__(self, url: str, prefix: str):
        self.url, self.prefix = url, prefix
        self._sync = redis.Redis.from_url(url)
        self._sync_admit = self._sync.register_script(ADMIT)
        self._clients: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()

    def _client(self) -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None:
            client = redis.asyncio.Redis.from_url(self.url)
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

    async def admit(self, ident: str, limits: Limits, want: Want, slot: str, now: float) -> Counts:
        _, script = self._client()
        keys, args = self._args(ident, limits, want, slot, now)
        return self._counts(await script(keys=keys, args=args))

    def admit_sync(self, ident: str, limits: Limits, want: Want, slot: str, now: float) -> Counts:
        keys, args = self._args(ident, limits, want, slot, now)
        return self._counts(self._sync_admit(keys=keys, args=args))

    async def settle(self, ident: str, tokens: int, slot: str, now: float) -> None:
        client, _ = self._client()
        _, minute, day, streams = _keys(self.prefix, ident, Windows.at(now))
        pipe = client.pipeline(transaction=False)
        if tokens:
            pipe.incrby(minute, tokens).expire(minute, MINUTE_TTL_S).incrby(day, tokens).expire(day, DAY_TTL_S)
        if slot:
            pipe.zrem(streams, slot)
        await pipe.execute()


class CacheQuotaStore:
    """Counts in the Django cache: without REDIS_URL that is local memory, so one process counts alone.

    A lock makes check-and-count atomic here as the Lua script does in Redis; the async methods run the sync ones
    in a worker thread (one hop per admission, not one per cache call).
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
        return await sync_to_async(self.admit_sync, thread_sensitive=False)(ident, limits, want, slot, now)

    async def settle(self, ident: str, tokens: int, slot: str, now: float) -> None:
        await sync_to_async(self.settle_sync, thread_sensitive=False)(ident, tokens, slot, now)


_stores: dict[tuple[str, str], RedisQuotaStore | CacheQuotaStore] = {}


def quota_store() -> RedisQuotaStore | CacheQuotaStore:
    """Redis when REDIS_URL is set, else the Django cache; one per configuration (tests change settings)."""
    url, prefix = settings.REDIS_URL, settings.FLEET_REDIS_PREFIX
    store = _stores.get((url, prefix))
    if store is None:
        store = _stores[(url, prefix)] = RedisQuotaStore(url, prefix) if url else CacheQuotaStore(prefix)
    return store


# --- what callers use -----------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    """OpenAI's style for x-ratelimit-reset-*: 1s, 6m0s, 1h2m3s."""
    total = max(math.ceil(seconds), 1)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(slots=True)
class Admission:
    """One admission's result: the headers every /v1 response carries, and the error when it was refused."""

    limits: Limits
    counts: Counts
    windows: Windows

    def headers(self) -> dict[str, str]:
        lim, c, w = self.limits, self.counts, self.windows
        out: dict[str, str] = {}
        for suffix, limit, used, reset in (("requests", lim.requests_per_minute, c.requests, w.minute_reset),
                                           ("tokens", lim.tokens_per_minute, c.tokens_minute, w.minute_reset),
                                           ("tokens-day", lim.tokens_per_day, c.tokens_day, w.day_reset)):
            if limit:
                out[f"x-ratelimit-limit-{suffix}"] = str(limit)
                out[f"x-ratelimit-remaining-{suffix}"] = str(max(limit - used, 0))
                out[f"x-ratelimit-reset-{suffix}"] = _duration(reset)
        return out

    def retry_after(self) -> int:
        seconds = {"requests": self.windows.minute_reset, "tokens_per_minute": self.windows.minute_reset,
                   "tokens_per_day": self.windows.day_reset}.get(self.counts.refused, 1.0)
        return max(math.ceil(seconds), 1)

    def error(self) -> OpenAIError:
        lim, c, wait = self.limits, self.counts, self.retry_after()
        kind, message = {
            "requests": ("requests", f"this API key may make {lim.requests_per_minute} requests a minute"),
            "tokens_per_minute": ("tokens", f"this API key may spend {lim.tokens_per_minute} tokens a minute "
                                  f"(uncached prompt tokens plus completion tokens) and has spent {c.tokens_minute}"),
            "tokens_per_day": ("tokens", f"this API key may spend {lim.tokens_per_day} tokens a day (uncached prompt "
                               f"tokens plus completion tokens) and has spent {c.tokens_day}"),
            "streams": ("requests", f"this API key may run {lim.concurrent_streams} generations at once; wait for "
                        "one to end"),
        }[c.refused]
        return OpenAIError(429, f"Rate limit reached: {message}. Retry in {wait} s.", code="rate_limit_exceeded",
                           type=kind, headers={**self.headers(), "Retry-After": str(wait)})


class Ticket:
    """An admitted request's hold on its key's quota: a stream slot until it settles, and the tokens it spends.

    The interface that admitted it settles it, or hands it to the generation's Run, which settles it when the
    generation ends however it ends; settling twice does nothing.
    """

    def __init__(self, ident: str, admission: Admission, slot: str):
        self.ident, self.admission, self.slot = ident, admission, slot
        self.owned = False  # a Run took it and settles it
        self.settled = False

    def headers(self) -> dict[str, str]:
        return self.admission.headers()

    async def settle(self, tokens: int = 0) -> None:
        if self.settled:
            return
        self.settled = True
        if tokens or self.slot:
            try:
                await quota_store().settle(self.ident, tokens, self.slot, clock())
            except Exception:  # the answer went out; a lost count is logged, not turned into an error
                log.exception("api: could not count %d tokens for %s", tokens, self.ident)


def _ident(key: ApiKey) -> str:
    return f"key:{key.pk}"


async def quota_admit(key: ApiKey, *, request: bool = True, tokens: bool = False, stream: bool = False) -> Ticket:
    """Count one request of `key` (a generation also checks its tokens and takes a stream slot); raises a 429
    OpenAIError, with Retry-After and the x-ratelimit headers, when a limit is reached."""
    limits, want, now = limits_for(key), Want(request=request, tokens=tokens, stream=stream), clock()
    slot = uuid.uuid4().hex if stream and limits.concurrent_streams else ""
    counts = await quota_store().admit(_ident(key), limits, want, slot, now)
    admission = Admission(limits, counts, Windows.at(now))
    if counts.refused:
        raise admission.error()
    return Ticket(_ident(key), admission, slot)


class RequestQuota(BaseThrottle):
    """DRF's throttle for /api: the same requests-a-minute count as /v1, per API key (or per signed-in user, or
    per address when anonymous, at the FLEET_QUOTA_REQUESTS_PER_MINUTE default)."""

    def allow_request(self, request, view) -> bool:
        key = request.auth if isinstance(getattr(request, "auth", None), ApiKey) else None
        user = getattr(request, "user", None)
        if key is not None:
            ident = _ident(key)
        elif user is not None and user.is_authenticated:
            ident = f"user:{user.pk}"
        else:
            ident = f"addr:{self.get_ident(request)}"
        limits, now = limits_for(key), clock()
        counts = quota_store().admit_sync(ident, limits, Want(), "", now)
        self.admission = Admission(limits, counts, Windows.at(now))
        return not counts.refused

    def wait(self) -> float:
        return float(self.admission.retry_after())
