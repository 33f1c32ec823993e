"""Admin for API keys: created here, shown once, revoked with an action."""

from django.contrib import admin, messages
from django.utils.html import format_html

from api.models import ApiKey
from api.services import api_key_create, api_key_revoke


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "owner", "active", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix", "owner__username")
    list_select_related = ("owner",)
    readonly_fields = ("prefix", "created_at", "last_used_at", "revoked_at")
    fields = ("name", "owner", "prefix", "created_at", "last_used_at", "revoked_at")
    autocomplete_fields = ()
    actions = ("revoke",)

    @admin.display(boolean=True)
    def active(self, key):
        return key.is_active

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        key, secret = api_key_create(owner=obj.owner, name=obj.name)
        obj.pk, obj.prefix, obj.key_hash = key.pk, key.prefix, key.key_hash
        obj._state.adding = False
        self.message_user(request, format_html("API key created; it is shown only this once: <code>{}</code>", secret),
                          messages.WARNING)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset):
        count = sum(api_key_revoke(key=k) for k in queryset)
        self.message_user(request, f"{count} key(s) revoked.", messages.SUCCESS)
