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


def with_worker(tmp_path, script: str, name: str) -> tuple[dict[str, str], str]:
    """Run `script` (it sends tasks and prints `key value` lines) against a head's broker while a real worker
    process consumes it; its lines as a dict, and the worker's output."""
    head = make_head(tmp_path)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "fleet", "worker", "--pool=solo", "--loglevel=INFO",
         "-n", f"{name}-{head.port}@%h"],
        cwd=ROOT, env=head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=head.env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
    finally:
        worker.terminate()
        worker_out = worker.communicate(timeout=30)[0]
    wait_for(lambda: worker.returncode is not None, 5, "worker did not stop")
    return dict(line.split(" ", 1) for line in out.stdout.strip().splitlines()), worker_out


def test_worker_process_runs_the_sweep_task(tmp_path):
    lines, worker_out = with_worker(tmp_path, SEND, "test")
    assert lines == {"first": "1", "second": "0", "state": "offline"}
    assert "nodes.tasks.node_sweep_lost" in worker_out and "succeeded" in worker_out


MAINTAIN = (
    "import django; django.setup()\n"
    "from datetime import timedelta\n"
    "from django.utils import timezone\n"
    "from django.contrib.auth.models import User\n"
    "from api.models import BatchFile\n"
    "from sessions.models import Generation, GrammarHandle, InferenceSession\n"
    "from api.tasks import file_purge_task\n"
    "from sessions.tasks import generation_purge_task, handle_expire_task, session_expire_task\n"
    "long_ago = timezone.now() - timedelta(days=400)\n"
    "owner = User.objects.create(username='maintained')\n"
    "InferenceSession.objects.filter(pk=InferenceSession.objects.create(model='m').pk).update(updated_at=long_ago)\n"
    "InferenceSession.objects.create(model='m')\n"
    "GrammarHandle.objects.filter(pk=GrammarHandle.objects.create(kind='gbnf', source='root ::= \"a\"').pk)"
    ".update(updated_at=long_ago)\n"
    "Generation.objects.create(model='m', status='done', created_at=long_ago)\n"
    "Generation.objects.create(model='m', status='done', created_at=timezone.now())\n"
    "f = BatchFile.objects.create(owner=owner, filename='x', purpose='batch', bytes=2, content=b'{}')\n"
    "BatchFile.objects.filter(pk=f.pk).update(created_at=long_ago)\n"
    "for task in (session_expire_task, handle_expire_task, generation_purge_task, file_purge_task):\n"
    "    print(task.name, task.delay().get(timeout=60), task.delay().get(timeout=60))\n"
    "print('left', InferenceSession.objects.count(), Generation.objects.count(), BatchFile.objects.count(),"
    " GrammarHandle.objects.filter(freed_at__isnull=True).count())\n"
)


def test_worker_process_runs_the_maintenance_tasks_once_each(tmp_path):
    """Each maintenance task, sent twice to a real worker: the first run does what is due, the second nothing."""
    lines, _ = with_worker(tmp_path, MAINTAIN, "test-maintain")
    assert lines == {"sessions.tasks.session_expire": "1 0", "sessions.tasks.handle_expire": "1 0",
                     "sessions.tasks.generation_purge": "1 0", "api.tasks.file_purge": "1 0", "left": "1 1 0 0"}
