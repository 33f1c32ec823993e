"""Celery tasks for node maintenance."""

import logging

from celery import shared_task

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
