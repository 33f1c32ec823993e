"""Admin for conversations, generation records and handles. History is read-only."""

import json

from django.conf import settings
from django.contrib import admin, messages
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from fleet.display import when_text
from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle, Message, StoredResponse
from sessions.selectors import expires_at


class ReadOnlyMixin:
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class MessageInline(ReadOnlyMixin, admin.TabularInline):
    model = Message
    fields = ("index", "role", "content", "tool_calls", "token_count", "generation", "created_at")
    readonly_fields = fields
    extra = 0
    ordering = ("index",)


@admin.register(InferenceSession)
class InferenceSessionAdmin(admin.ModelAdmin):
    empty_hint = ("No session. A client makes one with POST /api/sessions/ and names it in its requests (docs/api.md).")
    list_display = ("__str__", "model", "owner", "api_key", "created_at", "updated_at", "expires")
    list_filter = ("model",)
    search_fields = ("id", "title", "system_prompt")
    list_select_related = ("owner", "api_key")
    readonly_fields = ("id", "created_at", "updated_at", "expires")
    inlines = (MessageInline,)

    @admin.display(description="expires (untouched until)")
    def expires(self, row):
        return when_text(expires_at(row.updated_at, settings.FLEET_SESSION_TTL_DAYS), empty="never")


class BatchFilter(admin.SimpleListFilter):
    """The generations one batch's lines made (`?batch=batch_<id>`, the link on the batch's page). Offered only
    while it filters: a list of every batch would grow without bound."""

    title = "batch"
    parameter_name = "batch"

    def lookups(self, request, model_admin):
        return [(self.value(), self.value())] if self.value() else []

    def queryset(self, request, queryset):
        from api.batches import batch_generations  # api depends on sessions, not the other way round at import

        if not self.value():
            return queryset
        return queryset.filter(pk__in=batch_generations(ref=self.value()).values("pk"))


@admin.register(Generation)
class GenerationAdmin(ReadOnlyMixin, admin.ModelAdmin):
    empty_hint = ("No generation yet. Try the playground, or send one with an API key to /v1/chat/completions.")
    list_display = ("id", "model", "node", "status", "finish_reason", "tokens", "first_token", "decode",
                    "created_at")
    list_filter = ("status", "finish_reason", "model", "kind", "node", BatchFilter)
    search_fields = ("id", "error", "trace_id")
    list_select_related = ("node",)
    date_hierarchy = "created_at"
    readonly_fields = ("id", "session", "api_key", "kind", "model", "node", "nodes_used", "status", "finish_reason",
                       "prompt_tokens", "cached_tokens", "completion_tokens", "first_token", "duration", "decode",
                       "parameters_table", "trace_id", "error", "created_at", "finished_at", "purged")
    exclude = ("ttft_ms", "duration_ms", "decode_tps", "parameters", "placement")  # shown with units, as tables

    @admin.display(description="tokens (prompt / cached / completion)")
    def tokens(self, row):
        return f"{row.prompt_tokens} / {row.cached_tokens} / {row.completion_tokens}"

    @admin.display(description="first token", ordering="ttft_ms")
    def first_token(self, row):
        return "–" if row.ttft_ms is None else f"{row.ttft_ms:,.0f} ms"

    @admin.display(description="duration", ordering="duration_ms")
    def duration(self, row):
        return "–" if row.duration_ms is None else f"{row.duration_ms / 1000:,.2f} s"

    @admin.display(description="decode speed", ordering="decode_tps")
    def decode(self, row):
        return "–" if row.decode_tps is None else f"{row.decode_tps:,.1f} tokens/s"

    @admin.display(description="parameters")
    def parameters_table(self, row):
        params = row.parameters if isinstance(row.parameters, dict) else {}
        if not params:
            return "–"
        return format_html("<table>{}</table>", format_html_join(
            "", "<tr><th>{}</th><td>{}</td></tr>",
            ((key, json.dumps(value) if isinstance(value, dict | list) else value) for key, value in params.items())))

    @admin.display(description="to be purged")  # by maintenance, after the retention: always ahead of now
    def purged(self, row):
        return when_text(expires_at(row.created_at, settings.FLEET_GENERATION_RETENTION_DAYS), empty="never")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """The generation's page: its timeline and the placement evidence of every attempt, above the record."""
        from sessions.selectors import generation_attempts, generation_timeline

        generation = self.get_object(request, object_id)
        if generation is not None:
            extra_context = {**(extra_context or {}), "timeline": generation_timeline(generation=generation),
                             "attempts": generation_attempts(generation=generation)}
        return super().change_view(request, object_id, form_url, extra_context)


class FreeableAdmin(admin.ModelAdmin):
    actions = ("free",)

    @admin.display(description="expires (unused until)")
    def expires(self, row):
        if row.freed_at is not None:
            return "freed"
        return when_text(expires_at(row.updated_at, settings.FLEET_HANDLE_TTL_DAYS), empty="never")

    @admin.action(description="Free: generations naming it get a clear error")
    def free(self, request, queryset):
        count = queryset.filter(freed_at__isnull=True).update(freed_at=timezone.now())
        self.message_user(request, f"{count} handle(s) freed.", messages.SUCCESS)


@admin.register(GrammarHandle)
class GrammarHandleAdmin(FreeableAdmin):
    list_display = ("id", "name", "kind", "api_key", "created_at", "freed_at", "expires")
    list_filter = ("kind", "freed_at")
    search_fields = ("id", "name")
    list_select_related = ("api_key",)


@admin.register(LogitBiasHandle)
class LogitBiasHandleAdmin(FreeableAdmin):
    list_display = ("id", "name", "api_key", "created_at", "freed_at", "expires")
    list_filter = ("freed_at",)
    search_fields = ("id", "name")
    list_select_related = ("api_key",)


@admin.register(StoredResponse)
class StoredResponseAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """The /v1/responses answers kept for previous_response_id; deleting one here is DELETE /v1/responses/{id}."""

    list_display = ("id", "model", "owner", "api_key", "previous", "created_at", "expires")
    list_filter = ("model",)
    search_fields = ("id",)
    list_select_related = ("owner", "api_key")
    readonly_fields = ("id", "model", "owner", "api_key", "previous", "messages", "input_items", "body", "created_at",
                       "expires")

    @admin.display(description="expires")
    def expires(self, row):
        return when_text(expires_at(row.created_at, settings.FLEET_SESSION_TTL_DAYS), empty="never")
