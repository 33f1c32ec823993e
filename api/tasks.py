"""Celery tasks for batches: run one (in slices), and resume those whose worker is gone."""

from __future__ import annotations

import logging
import uuid

from celery import shared_task
from django.conf import settings
from django.db import OperationalError

from api.batch_run import batch_run, batches_stale
from api.batches import file_purge

log = logging.getLogger("api")

_SLICE = settings.FLEET_BATCH_SLICE_S


@shared_task(name="api.tasks.batch_run", bind=True, acks_late=True, ignore_result=True,
             soft_time_limit=_SLICE + 120, time_limit=_SLICE + 180,
             autoretry_for=(OperationalError,), retry_backoff=2, retry_backoff_max=60, retry_jitter=True,
             max_retries=5)
def batch_run_task(self, batch_id: str) -> None:
    """Run a batch for one slice; enqueue the next slice while it is not over. Idempotent: a second copy finds
    the batch held by a live runner and returns at once."""
    run_id = f"{self.request.hostname or 'worker'}:{uuid.uuid4().hex[:12]}"
    if batch_run(batch_id, run_id):
        batch_run_task.delay(batch_id)


@shared_task(name="api.tasks.batch_resume", soft_time_limit=30, time_limit=60, ignore_result=False)
def batch_resume_task() -> int:
    """Enqueue a run of every batch not over whose runner is gone (a worker killed mid-batch). Run by beat."""
    stale = batches_stale()
    for batch_id in stale:
        batch_run_task.delay(batch_id)
    if stale:
        log.info("batches resumed: %s", ", ".join(stale))
    return len(stale)


@shared_task(name="api.tasks.file_purge", soft_time_limit=120, time_limit=180, ignore_result=False,
             autoretry_for=(OperationalError,), retry_backoff=5, max_retries=3)
def file_purge_task() -> int:
    """Delete batch files past FLEET_FILE_RETENTION_DAYS. Run by beat; a second run finds nothing more."""
    count = file_purge(retention_days=settings.FLEET_FILE_RETENTION_DAYS)
    if count:
        log.info("purged %d batch file(s) older than %d days", count, settings.FLEET_FILE_RETENTION_DAYS)
    return count
