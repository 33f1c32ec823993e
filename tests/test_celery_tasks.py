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
