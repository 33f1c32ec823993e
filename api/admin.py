"""Admin for API keys: created here, shown once, revoked with an action; their quotas set here."""

from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils.html import format_html

from api.batches import batch_generations, batch_ref, file_ref
from api.models import ApiKey, Batch, BatchFile
from api.services import api_key_create, api_key_revoke
from fleet.display import size_text, when_text
from sessions.selectors import expires_at


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    empty_hint = ("No API key. Add one and choose its owner: the key is shown once; clients send it as `Authorization: "
                  "Bearer …`.")
    list_display = ("name", "prefix", "owner", "active", "priority", "weight", "requests_per_minute",
                    "tokens_per_minute", "tokens_per_day", "concurrent_streams", "created_at", "last_used_at",
                    "revoked_at")
    list_filter = ("revoked_at", "priority")
    search_fields = ("name", "prefix", "owner__username")
    list_select_related = ("owner",)
    readonly_fields = ("prefix", "created_at", "last_used_at", "revoked_at")
    fieldsets = (
        (None, {"fields": ("name", "owner", "prefix", "created_at", "last_used_at", "revoked_at")}),
        ("Quotas (empty: the FLEET_QUOTA_* default; 0: unlimited)",
         {"fields": ApiKey.QUOTA_FIELDS}),
        ("Share of a full fleet (priority class, weight among its class's keys, bound on waiting generations)",
         {"fields": ApiKey.SHARE_FIELDS}),
    )
    autocomplete_fields = ()
    actions = ("revoke",)

    @admin.display(boolean=True)
    def active(self, key):
        return key.is_active

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        key, secret = api_key_create(owner=obj.owner, name=obj.name,
                                     quotas={f: getattr(obj, f) for f in (*ApiKey.QUOTA_FIELDS, *ApiKey.SHARE_FIELDS)})
        obj.pk, obj.prefix, obj.key_hash = key.pk, key.prefix, key.key_hash
        obj._state.adding = False
        self.message_user(request, format_html("API key created; it is shown only this once: <code>{}</code>", secret),
                          messages.WARNING)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset):
        count = sum(api_key_revoke(key=k) for k in queryset)
        self.message_user(request, f"{count} key(s) revoked.", messages.SUCCESS)


class NoAddMixin:
    """Made through the API only (an upload, a batch): the admin offers no "Add" it could not save."""

    def has_add_permission(self, request, obj=None):
        return False


def _download_link(row) -> str:
    if row is None:
        return "–"
    url = reverse("admin:api_batchfile_download", args=[row.pk])
    return format_html('<a href="{}">{}</a> ({})', url, row.filename, size_text(row.bytes))


@admin.register(BatchFile)
class BatchFileAdmin(NoAddMixin, admin.ModelAdmin):
    empty_hint = ("No file. Clients upload batch inputs with POST /v1/files (purpose batch).")
    list_display = ("file_id", "filename", "purpose", "owner", "size", "created_at", "purged", "download")
    list_filter = ("purpose",)
    search_fields = ("filename", "owner__username")
    list_select_related = ("owner",)
    readonly_fields = ("owner", "filename", "purpose", "size", "created_at", "purged", "download")
    exclude = ("content", "bytes")

    def get_urls(self):
        download = self.admin_site.admin_view(self.download_view)
        return [path("<uuid:pk>/download/", download, name="api_batchfile_download"), *super().get_urls()]

    def download_view(self, request, pk):
        """The file's bytes, for staff who may see it (a batch's output or errors, an uploaded input)."""
        row = get_object_or_404(BatchFile, pk=pk)
        if not self.has_view_permission(request, row):
            raise PermissionDenied
        response = HttpResponse(bytes(row.content), content_type="application/jsonl")
        response["Content-Disposition"] = f'attachment; filename="{file_ref(row)}.jsonl"'
        return response

    @admin.display(description="download")
    def download(self, row):
        return _download_link(row)

    @admin.display(description="size", ordering="bytes")
    def size(self, row):
        return size_text(row.bytes)

    @admin.display(description="to be purged (later while a batch uses it)")
    def purged(self, row):
        return when_text(expires_at(row.created_at, settings.FLEET_FILE_RETENTION_DAYS), empty="never")

    @admin.display(description="id")
    def file_id(self, row):
        return file_ref(row)


@admin.register(Batch)
class BatchAdmin(NoAddMixin, admin.ModelAdmin):
    """Batches with their progress: lines answered of the total, and where they stand."""
    empty_hint = ("No batch. Clients create them with POST /v1/batches from an uploaded file (docs/api.md, Batches).")

    list_display = ("batch_id", "owner", "endpoint", "status", "progress", "completed", "failed", "total",
                    "created_at", "expires_at")
    list_filter = ("status", "endpoint")
    search_fields = ("owner__username", "input_file_ref")
    list_select_related = ("owner",)
    readonly_fields = [*(f.name for f in Batch._meta.fields), "input_download", "output_download",
                       "error_download", "generations"]

    @admin.display(description="generations (its lines' records)")
    def generations(self, row):
        ref = batch_ref(row)
        count = batch_generations(ref=ref).count()
        if not count:
            return "none yet"
        url = reverse("admin:inference_sessions_generation_changelist")
        return format_html('<a id="batch-generations" href="{}?batch={}">{} generation{}</a>', url, ref, count,
                           "" if count == 1 else "s")

    @admin.display(description="input file")
    def input_download(self, row):
        return _download_link(row.input_file)

    @admin.display(description="output file (answers)")
    def output_download(self, row):
        return _download_link(row.output_file)

    @admin.display(description="error file")
    def error_download(self, row):
        return _download_link(row.error_file)

    @admin.display(description="id")
    def batch_id(self, row):
        return batch_ref(row)

    @admin.display(description="progress")
    def progress(self, row):
        done = row.completed + row.failed
        return f"{done}/{row.total} ({100 * done // row.total if row.total else 0}%)"
