"""Per-key quotas: requests a minute, tokens a minute and a day, and generations streaming at once.

Tokens are what a node really spends: prompt tokens it had to read (prompt minus cached) plus completion tokens,
counted when a generation ends. A request is admitted while its key has requests and tokens left in the current
windows (fixed windows: the UTC minute and the UTC day), so the last generation admitted may take a key past its
token limit; the next one waits for the window to turn. Where the counts live: api.quota_counts.
The same counter of requests covers /v1, /api (as DRF's throttle) and `generate` frames on the client websocket.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass

from django.conf import settings
from rest_framework.throttling import BaseThrottle

from api.errors import OpenAIError
from api.models import ApiKey
from api.quota_counts import Counts, Limits, Want, Windows, quota_store

log = logging.getLogger("api")


def clock() -> float:
    """The time the windows are cut from (tests replace it)."""
    return time.time()


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
                await quota_store().settle(self.ident, tokens, self.slot, clock(),
                                           token_limits=self.admission.limits.tokens())
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
