"""Conversations, their messages, generation records and the handles generations refer to."""

import uuid

from django.conf import settings
from django.db import models


class InferenceSession(models.Model):
    """A server-side conversation that clients continue by id (`session` on /v1, or /api/sessions/)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    model = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    api_key = models.ForeignKey("api.ApiKey", null=True, blank=True, on_delete=models.SET_NULL)
    title = models.CharField(max_length=200, blank=True)
    system_prompt = models.TextField(blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at"]
        verbose_name = "session"

    def __str__(self) -> str:
        return self.title or str(self.id)


class Message(models.Model):
    """One turn of a session, in order. Written once, when its generation ends."""

    class Role(models.TextChoices):
        SYSTEM = "system", "system"
        USER = "user", "user"
        ASSISTANT = "assistant", "assistant"
        TOOL = "tool", "tool"

    session = models.ForeignKey(InferenceSession, on_delete=models.CASCADE, related_name="messages")
    index = models.PositiveIntegerField()
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    name = models.CharField(max_length=200, blank=True)
    tool_calls = models.JSONField(null=True, blank=True)
    tool_call_id = models.CharField(max_length=200, blank=True)
    token_count = models.PositiveIntegerField(null=True, blank=True)
    generation = models.ForeignKey("Generation", null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["session", "index"]
        constraints = [models.UniqueConstraint(fields=["session", "index"], name="message_unique_index")]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:60]}"


class Generation(models.Model):
    """The record of one generation, written once when it ends (never per token)."""

    class Status(models.TextChoices):
        DONE = "done", "done"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"
        EXPIRED = "expired", "expired"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    session = models.ForeignKey(InferenceSession, null=True, blank=True, on_delete=models.SET_NULL)
    api_key = models.ForeignKey("api.ApiKey", null=True, blank=True, on_delete=models.SET_NULL)
    kind = models.CharField(max_length=32, default="chat")
    model = models.CharField(max_length=200)
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL)
    nodes_used = models.JSONField(default=list, blank=True, help_text="Every node that served a part (failover).")
    status = models.CharField(max_length=16, choices=Status.choices, db_index=True)
    finish_reason = models.CharField(max_length=32, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    decode_tps = models.FloatField(null=True, blank=True)
    parameters = models.JSONField(default=dict, blank=True)
    placement = models.JSONField(default=dict, blank=True)
    trace_id = models.CharField(max_length=32, blank=True, help_text="Its OpenTelemetry trace, when tracing was on.")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.model} {self.id}"


class Handle(models.Model):
    """What grammar and logit-bias handles share: an owner, a name, and `freed_at` once freed."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, blank=True)
    api_key = models.ForeignKey("api.ApiKey", null=True, blank=True, on_delete=models.SET_NULL)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    freed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name or str(self.id)


class GrammarHandle(Handle):
    """A grammar (GBNF, or a JSON schema the node compiles to one) kept on the head and sent by reference."""

    class Kind(models.TextChoices):
        GBNF = "gbnf", "GBNF"
        JSON_SCHEMA = "json_schema", "JSON schema"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    source = models.TextField()

    class Meta(Handle.Meta):
        pass


class LogitBiasHandle(Handle):
    """A token-id to bias map kept on the head and sent with the generations that name it."""

    bias = models.JSONField(default=dict)

    class Meta(Handle.Meta):
        verbose_name = "logit-bias handle"


class StoredResponse(models.Model):
    """A /v1/responses answer kept for `previous_response_id`, GET and DELETE: the conversation through it (the
    prompt's prefix of the next turn), the items its request sent and the response object as answered."""

    id = models.CharField(primary_key=True, max_length=64, editable=False)  # "resp_" + the generation's id
    model = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    api_key = models.ForeignKey("api.ApiKey", null=True, blank=True, on_delete=models.SET_NULL)
    previous = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL)
    messages = models.JSONField(default=list, blank=True, help_text="The conversation through this answer, as chat "
                                                                    "messages (what the next turn continues).")
    input_items = models.JSONField(default=list, blank=True)
    body = models.JSONField(default=dict, blank=True, help_text="The response object as answered.")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "stored response"

    def __str__(self) -> str:
        return self.id
