"""`manage.py up`'s children, without starting them: the head, the Celery worker with beat, the local node."""

import pytest

from fleet.management.commands.up import Command

OPTIONS = {"host": "127.0.0.1", "port": 8000, "model": "smollm2", "max_batch": 4, "no_node": False,
           "transcribe": "", "no_celery": False}


def started(monkeypatch, **options) -> dict[str, list[str]]:
    class Popen:  # a child that is never started: its command line is kept
        def __init__(self, argv, **kwargs):
            self.argv = argv

    monkeypatch.setattr("fleet.management.commands.up.subprocess.Popen", Popen)
    monkeypatch.setattr(Command, "_wait_listening", lambda self, proc, host, port: None)
    return {name: child.argv for name, child in Command()._start({**OPTIONS, **options}).items()}


@pytest.mark.parametrize("no_celery", [False, True])
def test_up_starts_the_celery_worker_with_beat_unless_told_not_to(monkeypatch, no_celery):
    children = started(monkeypatch, no_celery=no_celery)
    assert set(children) == ({"daphne", "node"} if no_celery else {"daphne", "celery", "node"})
    if not no_celery:
        worker = children["celery"]
        assert worker[1:6] == ["-m", "celery", "-A", "fleet", "worker"]
        assert "-B" in worker  # beat runs the maintenance tasks (fleet/settings.py CELERY_BEAT_SCHEDULE)
