from django.apps import AppConfig


class InferenceSessionsConfig(AppConfig):
    # django.contrib.sessions owns the label "sessions".
    name = "sessions"
    label = "inference_sessions"
    verbose_name = "Conversations and generations"
    default_auto_field = "django.db.models.BigAutoField"
