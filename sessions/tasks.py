"""Celery beat's maintenance of conversations, handles and generation records. Each task does what is due and
returns how many rows it changed; run twice, the second finds nothing. A database that is briefly unreachable is
retried; anything else fails the run, and the next beat tries again."""

import logging

from celery import shared_task
from django.conf import settings
from django.db import OperationalError

from sessions.services import generation_purge, handle_expire, session_expire, stored_response_expire

log = logging.getLogger("sessions")

RETRY = {"autoretry_for": (OperationalError,), "retry_backoff": 5, "max_retries": 3, "ignore_result": False}


def _run(job, days: int, done: str) -> int:
    """Run one maintenance job with its setting in days; log what it did (`done`: "%d ... %d days")."""
    count = job(days)
    if count:
        log.info(done, count, days)
    return count


@shared_task(name="sessions.tasks.session_expire", soft_time_limit=120, time_limit=180, **RETRY)
def session_expire_task() -> int:
    days = settings.FLEET_SESSION_TTL_DAYS
    # Stored /v1/responses are conversations too: they keep the sessions' retention.
    return (_run(lambda days: session_expire(ttl_days=days), days, "deleted %d session(s) untouched for %d days")
            + _run(lambda days: stored_response_expire(ttl_days=days), days,
                   "deleted %d stored response(s) older than %d days"))


@shared_task(name="sessions.tasks.handle_expire", soft_time_limit=60, time_limit=90, **RETRY)
def handle_expire_task() -> int:
    return _run(lambda days: handle_expire(ttl_days=days), settings.FLEET_HANDLE_TTL_DAYS,
                "freed %d handle(s) unused for %d days")


@shared_task(name="sessions.tasks.generation_purge", soft_time_limit=300, time_limit=360, **RETRY)
def generation_purge_task() -> int:
    return _run(lambda days: generation_purge(retention_days=days), settings.FLEET_GENERATION_RETENTION_DAYS,
                "purged %d generation record(s) older than %d days")
