"""Receivers that make every head process verify API keys again when a key or its owner changes.

They decide nothing: each enqueues a new revocation stamp for after the commit (api.services.api_keys_changed).
They catch the changes that do not go through api_key_revoke: a key edited (its quotas) or deleted in the admin,
and a user deactivated or deleted (deleting a user deletes its keys). A bulk QuerySet.update sends no signal;
the verified-key cache's TTL bounds that.
"""

from django.conf import settings
from django.db.models.signals import post_delete, post_save

from api.models import ApiKey
from api.services import api_keys_changed


def _key_saved(sender, instance, created, **kwargs) -> None:
    if not created:
        api_keys_changed()


def _key_deleted(sender, instance, **kwargs) -> None:
    api_keys_changed()


def _user_saved(sender, instance, created, **kwargs) -> None:
    if not created and not instance.is_active:
        api_keys_changed()


def connect() -> None:
    post_save.connect(_key_saved, sender=ApiKey, dispatch_uid="api-key-saved")
    post_delete.connect(_key_deleted, sender=ApiKey, dispatch_uid="api-key-deleted")
    post_save.connect(_user_saved, sender=settings.AUTH_USER_MODEL, dispatch_uid="api-key-owner-saved")
