"""The Celery app: batch jobs and maintenance. Celery never carries tokens."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")

app = Celery("fleet")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
def _tracing(**_) -> None:
    """A worker traces its tasks when OTEL_EXPORTER_OTLP_ENDPOINT is set (the SDK's exporter survives a fork)."""
    from fleet import tracing

    tracing.setup("fleet-worker")
