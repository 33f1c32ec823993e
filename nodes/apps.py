from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        # This process sees an alias change at once; other head processes within fleet.aliases.ALIASES_TTL_S.
        post_save.connect(_aliases_changed, sender="nodes.ModelAlias", dispatch_uid="model-alias-saved")
        post_delete.connect(_aliases_changed, sender="nodes.ModelAlias", dispatch_uid="model-alias-deleted")


def _aliases_changed(**_kwargs) -> None:
    from fleet.links import registry

    registry().aliases.changed()
