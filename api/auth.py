"""API-key authentication: `Authorization: Bearer <key>` on /v1 and /api; the key or a query parameter on websockets."""

from __future__ import annotations

from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from django.middleware.csrf import CsrfViewMiddleware
from rest_framework import authentication, exceptions

from api.errors import OpenAIError
from api.models import ApiKey
from api.services import api_key_authenticate, api_key_verified


def bearer_from_header(value: str | bytes | None) -> str | None:
    """The key in an `Authorization: Bearer <key>` header value, or None."""
    if isinstance(value, bytes):
        value = value.decode("latin1")
    if not value:
        return None
    scheme, _, key = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def bearer_from_scope(scope: dict) -> str | None:
    """A websocket's key: the Authorization header, else the `api_key` query parameter (browsers cannot set headers)."""
    for name, value in scope.get("headers") or []:
        if name.lower() == b"authorization":
            key = bearer_from_header(value)
            if key:
                return key
    query = parse_qs((scope.get("query_string") or b"").decode("latin1"))
    values = query.get("api_key") or []
    return values[0].strip() if values and values[0].strip() else None


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """DRF authentication for /api: the request's user is the key's owner, `request.auth` the ApiKey."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None
        key = bearer_from_header(header)
        if key is None:
            raise exceptions.AuthenticationFailed("Use `Authorization: Bearer <api key>`.")
        row = api_key_authenticate(key=key)
        if row is None:
            raise exceptions.AuthenticationFailed("The API key is wrong or revoked; create one under /api/keys/.")
        if not row.owner.is_active:
            raise exceptions.AuthenticationFailed("The API key's owner is inactive.")
        return row.owner, row

    def authenticate_header(self, request) -> str:
        return self.keyword


async def v1_authenticate_async(header: str | None) -> ApiKey:
    """v1_authenticate without a thread hop when this process verified the key lately and no key changed since."""
    key = bearer_from_header(header) if header else None
    row = await api_key_verified(key=key) if key else None
    return row if row is not None else await sync_to_async(v1_authenticate)(header)


def v1_authenticate(header: str | None) -> ApiKey:
    """The key for a /v1 request; raises OpenAIError 401. Sync: call via sync_to_async."""
    if not header:
        raise OpenAIError(401, "You didn't provide an API key. Send `Authorization: Bearer <api key>`; "
                          "an operator makes one with `manage.py create_api_key` or under /api/keys/.",
                          code="missing_api_key")
    key = bearer_from_header(header)
    row = api_key_authenticate(key=key) if key else None
    if row is None or not row.owner.is_active:
        raise OpenAIError(401, "Incorrect or revoked API key provided. Check the key, or create a new one.",
                          code="invalid_api_key")
    return row


async def v1_staff_session(request) -> None:
    """A /v1 request with no key that the admin playground sent: an active staff user's session, with the page's CSRF
    token (another site cannot ride the cookie). Raises OpenAIError 401 (no such session) or 403 (no token)."""
    user = await request.auser()
    if not user.is_authenticated:
        await v1_authenticate_async(None)  # raises: no API key
    if not (user.is_active and user.is_staff):
        raise OpenAIError(403, "Only staff users may call this with a session; send an API key.", code="forbidden")
    refused = await sync_to_async(CsrfViewMiddleware(lambda r: None).process_view)(request, None, (), {})
    if refused is not None:
        raise OpenAIError(403, "A request signed in with a session must carry this site's CSRF token (X-CSRFToken); "
                          "reload the page, or send an API key.", code="csrf_failed")
