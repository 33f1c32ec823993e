"""API keys: what application developers authenticate with."""

import uuid

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class ApiKey(models.Model):
    """A bearer key for /v1, /api and the client websocket, with its quotas and its share of a full fleet (priority
    class, weight, bound on waiting generations: fleet/waiting.py). Only a SHA-256 hash is stored."""

    class Priority(models.TextChoices):  # fleet.waiting.PRIORITIES, best first
        HIGH = "high"
        NORMAL = "normal"
        LOW = "low"

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
    # The waiting room, when every lane of a model is busy (fleet/waiting.py).
    SHARE_FIELDS = ("priority", "weight", "max_waiting")
    priority = models.CharField(
        max_length=10, choices=Priority.choices, default=Priority.NORMAL, help_text="Its generations' class when "
        "the fleet is full: a higher class takes the next free lane first. A request may ask for this class or a "
        "lower one (`priority`), never a higher one.")
    weight = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(100)], help_text="Its share of freed lanes "
        "against other keys of its class with generations waiting: a key of weight 2 gets two for each of a "
        "weight-1 key's.")
    max_waiting = models.PositiveIntegerField(
        null=True, blank=True, help_text="Generations it may have waiting for a lane in one head process; one more "
        "gets a 429 with Retry-After. Empty: FLEET_MAX_WAITING_PER_KEY; 0: unbounded.")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class BatchFile(models.Model):
    """A file uploaded for /v1/batches (purpose `batch`), or a batch's output or error file. Its owner's only."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="batch_files")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    bytes = models.PositiveBigIntegerField(default=0)
    content = models.BinaryField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "batch file"

    def __str__(self) -> str:
        return f"{self.filename} ({self.purpose})"


class Batch(models.Model):
    """A batch job: the lines of an input file run through the fleet by a Celery worker, below interactive
    traffic. Counts move as lines finish (in the same transaction that marks each line done)."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="batches")
    # The key that created the batch: its lines are sent as that key (its quotas, its revocation). Never the secret.
    api_key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="batches")
    endpoint = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=10)
    input_file = models.ForeignKey(BatchFile, on_delete=models.SET_NULL, null=True, related_name="+")
    input_file_ref = models.CharField(max_length=60, help_text="The input file's id as the client gave it.")
    output_file = models.ForeignKey(BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    error_file = models.ForeignKey(BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # The worker running it now, and when it last said so: a stale runner (killed) is taken over.
    runner = models.CharField(max_length=40, blank=True)
    runner_seen_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return f"batch_{self.id.hex} ({self.status})"


class BatchLine(models.Model):
    """One input line of a batch and, once answered, its result. Answered exactly once: the result is written by
    the conditional UPDATE that moves it from `running` (under its claim) to `done` or `failed`."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512, blank=True)
    method = models.CharField(max_length=10, blank=True)
    url = models.CharField(max_length=40, blank=True)
    body = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    claim = models.CharField(max_length=40, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    response = models.JSONField(null=True, blank=True)  # {"status_code", "request_id", "body"}
    error = models.JSONField(null=True, blank=True)  # {"code", "message"}
    request_id = models.CharField(max_length=64, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="batch_line_index_unique")]
        indexes = [models.Index(fields=["batch", "status"])]

    def __str__(self) -> str:
        return f"{self.batch_id} #{self.index} {self.custom_id}"
