"""Celery tasks for node maintenance: lost nodes, and the media blobs requests left on the head."""

import logging

from celery import shared_task
from django.conf import settings
from django.db import OperationalError

from nodes.registry import media_purge
from nodes.services import node_sweep_lost

log = logging.getLogger("nodes")


@shared_task(name="nodes.tasks.node_sweep_lost", soft_time_limit=30, time_limit=60, ignore_result=False)
def node_sweep_lost_task() -> int:
    """Mark nodes whose heartbeats stopped as offline. Running it twice marks nothing more."""
    count = node_sweep_lost()
    if count:
        log.info("fleet marked %d node(s) offline after missed heartbeats", count)
        from fleet.live import fleet_changed

        fleet_changed()
    return count


@shared_task(name="nodes.tasks.media_purge", soft_time_limit=120, time_limit=180, ignore_result=False,
             autoretry_for=(OperationalError,), retry_backoff=5, max_retries=3)
def media_purge_task() -> int:
    """Delete media blobs (audio requests sent) past FLEET_MEDIA_RETENTION_DAYS, never a model's file. Run by beat;
    a second run finds nothing more."""
    count = media_purge(retention_days=settings.FLEET_MEDIA_RETENTION_DAYS)
    if count:
        log.info("purged %d media blob(s) older than %d days", count, settings.FLEET_MEDIA_RETENTION_DAYS)
    return count
