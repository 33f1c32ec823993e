"""Writes for API keys."""

from __future__ import annotations

import hashlib
import secrets
import time

from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from api.models import ApiKey

KEY_PREFIX = "fk-"


def _hash(key: str) -> str:
    # The key carries 256 bits of randomness, so a plain SHA-256 is enough (no slow KDF needed).
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_create(*, owner: AbstractBaseUser, name: str) -> tuple[ApiKey, str]:
    """Make a key; returns the row and the full key, which is shown once and never stored."""
    name = name.strip()
    if not name:
        raise ValueError("an API key needs a name")
    prefix = KEY_PREFIX + secrets.token_hex(4)
    key = f"{prefix}.{secrets.token_urlsafe(32)}"
    row = ApiKey.objects.create(name=name, owner=owner, prefix=prefix, key_hash=_hash(key))
    return row, key


def api_key_revoke(*, key: ApiKey) -> bool:
    revoked = bool(ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()))
    _verified.clear()  # this process stops accepting it at once; other head processes within VERIFIED_TTL_S
    return revoked


# Keys verified in this process, by hash, for a few seconds: a generation's time to first token should not pay a
# database round trip (and a thread hop) on every request. Revoking in this process clears it at once.
VERIFIED_TTL_S = 5.0
_verified: dict[str, tuple[float, ApiKey]] = {}


def api_key_verified_recently(*, key: str) -> ApiKey | None:
    """The key's row when this process verified it within VERIFIED_TTL_S; no database access (async-safe)."""
    entry = _verified.get(_hash(key))
    if entry is None or entry[0] < time.monotonic():
        return None
    return entry[1]


def api_key_authenticate(*, key: str) -> ApiKey | None:
    """The active key for this bearer string, or None. Updates last_used_at at most once a minute."""
    prefix, _, _ = key.partition(".")
    if not prefix.startswith(KEY_PREFIX):
        return None
    row = ApiKey.objects.select_related("owner").filter(prefix=prefix).first()
    if row is None or not secrets.compare_digest(row.key_hash, _hash(key)) or row.revoked_at is not None:
        return None
    now = timezone.now()
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:
        ApiKey.objects.filter(pk=row.pk).update(last_used_at=now)
    if len(_verified) > 10_000:
        _verified.clear()
    _verified[_hash(key)] = (time.monotonic() + VERIFIED_TTL_S, row)
    return row
