"""Per-key request throttling, shared by every head process through the Django cache."""

from __future__ import annotations

from types import SimpleNamespace

from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

from api.models import ApiKey


class ApiKeyRateThrottle(SimpleRateThrottle):
    """`FLEET_THROTTLE_RATE` requests per API key (or per signed-in user, or per address when anonymous).

    The same counter covers /api, /v1 and generate messages on the client websocket, so a key has one budget.
    """

    scope = "api_key"

    def get_rate(self) -> str | None:
        # Read the rate when the throttle is made, not when the module was imported, so settings changes apply.
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def get_cache_key(self, request, view) -> str | None:
        if isinstance(getattr(request, "auth", None), ApiKey):
            ident = f"key:{request.auth.pk}"
        elif getattr(request, "user", None) is not None and request.user.is_authenticated:
            ident = f"user:{request.user.pk}"
        else:
            ident = f"addr:{self.get_ident(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}

    @classmethod
    def check_key(cls, key: ApiKey) -> float | None:
        """For interfaces outside DRF (/v1, the websocket): None when allowed, else seconds to wait."""
        throttle = cls()
        if throttle.allow_request(SimpleNamespace(auth=key, user=key.owner), None):
            return None
        return throttle.wait() or 1.0
