"""API keys: what application developers authenticate with."""

import uuid

from django.conf import settings
from django.db import models


class ApiKey(models.Model):
    """A bearer key for /v1, /api and the client websocket, with its quotas. Only a SHA-256 hash is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    prefix = models.CharField(max_length=32, unique=True, help_text="Shown to identify the key; not secret.")
    key_hash = models.CharField(max_length=64, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Quotas: empty takes the FLEET_QUOTA_* default; 0 is unlimited.
    QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "concurrent_streams")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Requests a minute on /v1, /api and the websocket. Empty: "
        "FLEET_QUOTA_REQUESTS_PER_MINUTE; 0: unlimited.")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Uncached prompt tokens plus completion tokens a minute. Empty: "
        "FLEET_QUOTA_TOKENS_PER_MINUTE; 0: unlimited.")
    tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Uncached prompt tokens plus completion tokens a day (UTC). Empty: "
        "FLEET_QUOTA_TOKENS_PER_DAY; 0: unlimited.")
    concurrent_streams = models.PositiveIntegerField(
        null=True, blank=True, help_text="Generations running at once. Empty: FLEET_QUOTA_CONCURRENT_STREAMS; "
        "0: unlimited.")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None
