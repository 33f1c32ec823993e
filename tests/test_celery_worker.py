"""A real Celery worker process consumes the broker the head writes to (filesystem or Redis), not eager mode."""

import subprocess
import sys

import pytest

from tests.live import ROOT, make_head, wait_for

pytestmark = pytest.mark.slow

SEND = (
    "import django; django.setup()\n"
    "from django.utils import timezone\n"
    "from nodes.models import Node\n"
    "from nodes.tasks import node_sweep_lost_task\n"
    "from datetime import timedelta\n"
    "Node.objects.create(identity='silent', state='online', last_seen_at=timezone.now() - timedelta(hours=1))\n"
    "print('first', node_sweep_lost_task.delay().get(timeout=60))\n"
    "print('second', node_sweep_lost_task.delay().get(timeout=60))\n"
    "print('state', Node.objects.get(identity='silent').state)\n"
)


def test_worker_process_runs_the_sweep_task(tmp_path):
    head = make_head(tmp_path)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "fleet", "worker", "--pool=solo", "--loglevel=INFO",
         "-n", f"test-{head.port}@%h"],
        cwd=ROOT, env=head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out = subprocess.run([sys.executable, "-c", SEND], cwd=ROOT, env=head.env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
        assert lines == {"first": "1", "second": "0", "state": "offline"}
    finally:
        worker.terminate()
        worker_out = worker.communicate(timeout=30)[0]
    assert "nodes.tasks.node_sweep_lost" in worker_out and "succeeded" in worker_out
    wait_for(lambda: worker.returncode is not None, 5, "worker did not stop")
