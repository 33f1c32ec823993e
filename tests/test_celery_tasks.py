"""The maintenance task, run twice, gives the same result."""

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import Node
from nodes.tasks import node_sweep_lost_task
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def test_sweep_task_is_idempotent():
    NodeFactory.create_batch(2, last_seen_at=timezone.now() - timedelta(minutes=10))
    NodeFactory()
    assert node_sweep_lost_task.apply().get() == 2
    states_after_first = sorted(Node.objects.values_list("state", flat=True))
    assert node_sweep_lost_task.apply().get() == 0
    assert sorted(Node.objects.values_list("state", flat=True)) == states_after_first == ["offline", "offline",
                                                                                           "online"]


# Every periodic task and how often beat sends it (FLEET_MAINTENANCE_S and FLEET_BATCH_RESUME_S at their defaults).
PERIODIC = {
    "nodes.tasks.node_sweep_lost": 30.0, "api.tasks.batch_resume": 15.0,
    "sessions.tasks.session_expire": 3600.0, "sessions.tasks.handle_expire": 3600.0,
    "sessions.tasks.generation_purge": 3600.0, "api.tasks.file_purge": 3600.0, "nodes.tasks.media_purge": 3600.0,
}


def test_celery_beat_sends_each_maintenance_task_on_its_interval(tmp_path):
    """Beat as the worker's -B runs it: the schedule it reads from the settings, each entry a registered task
    that is due once its interval has passed."""
    from celery.beat import Scheduler

    from fleet.celery import app

    app.loader.import_default_modules()
    scheduler = Scheduler(app, lazy=True)
    scheduler.setup_schedule()
    entries = {entry.task: entry for entry in scheduler.schedule.values()}
    assert {task: entry.schedule.run_every.total_seconds() for task, entry in entries.items()
            if task in PERIODIC} == PERIODIC
    for task in PERIODIC:
        assert task in app.tasks, task
        entry = entries[task]
        assert not entry.is_due()[0]  # not at once: after its interval
        assert entry.schedule.is_due(timezone.now() - timedelta(seconds=PERIODIC[task] + 1))[0]
