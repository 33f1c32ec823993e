from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "api"
    verbose_name = "API access"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import api.schema  # noqa: F401  (registers the OpenAPI description of API-key auth)
        from api import signals

        signals.connect()
