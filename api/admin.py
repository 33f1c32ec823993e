"""Admin for API keys: created here, shown once, revoked with an action; their quotas set here."""

from django.contrib import admin, messages
from django.utils.html import format_html

from api.models import ApiKey
from api.services import api_key_create, api_key_revoke


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "owner", "active", "requests_per_minute", "tokens_per_minute", "tokens_per_day",
                    "concurrent_streams", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix", "owner__username")
    list_select_related = ("owner",)
    readonly_fields = ("prefix", "created_at", "last_used_at", "revoked_at")
    fieldsets = (
        (None, {"fields": ("name", "owner", "prefix", "created_at", "last_used_at", "revoked_at")}),
        ("Quotas (empty: the FLEET_QUOTA_* default; 0: unlimited)",
         {"fields": ApiKey.QUOTA_FIELDS}),
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
                                     quotas={f: getattr(obj, f) for f in ApiKey.QUOTA_FIELDS})
        obj.pk, obj.prefix, obj.key_hash = key.pk, key.prefix, key.key_hash
        obj._state.adding = False
        self.message_user(request, format_html("API key created; it is shown only this once: <code>{}</code>", secret),
                          messages.WARNING)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset):
        count = sum(api_key_revoke(key=k) for k in queryset)
        self.message_user(request, f"{count} key(s) revoked.", messages.SUCCESS)
