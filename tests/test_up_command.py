"""`manage.py up`'s children, without starting them: the head, the Celery worker with beat, the local node."""

import pytest

from fleet.management.commands.up import Command

OPTIONS = {"host": "127.0.0.1", "port": 8000, "model": "smollm2", "max_batch": 4, "no_node": False,
           "transcribe": "", "no_celery": False}


def started(monkeypatch, **options) -> dict[str, list[str]]:
    class Popen:  # a child that is never started: its command line and environment are kept
        def __init__(self, argv, **kwargs):
            self.argv, self.env = argv, kwargs["env"]

    monkeypatch.setattr("fleet.management.commands.up.subprocess.Popen", Popen)
    monkeypatch.setattr(Command, "_wait_listening", lambda self, proc, host, port: None)
    return {name: child.argv for name, child in Command()._start({**OPTIONS, **options}).items()}


@pytest.mark.parametrize("no_celery", [False, True])
def test_up_starts_the_celery_worker_with_beat_unless_told_not_to(monkeypatch, no_celery):
    children = started(monkeypatch, no_celery=no_celery)
    assert set(children) == ({"daphne", "node"} if no_celery else {"daphne", "celery", "node"})
    if not no_celery:
        worker = children["celery"]
        assert worker[1:7] == ["-m", "celery", "-A", "fleet", "--quiet", "worker"]  # --quiet: no banner
        assert "-B" in worker  # beat runs the maintenance tasks (fleet/settings.py CELERY_BEAT_SCHEDULE)


def started_with_env(monkeypatch, **options) -> tuple[dict, str]:
    """Each child's environment, and what `up` said as it started them."""
    import io

    envs, out = {}, io.StringIO()

    class Popen:
        def __init__(self, argv, **kwargs):
            self.argv, self.env = argv, kwargs["env"]

    monkeypatch.setattr("fleet.management.commands.up.subprocess.Popen", Popen)
    monkeypatch.setattr(Command, "_wait_listening", lambda self, proc, host, port: None)
    for name, child in Command(stdout=out)._start({**OPTIONS, **options}).items():
        envs[name] = {"argv": child.argv, "env": child.env}
    return envs, out.getvalue()


def test_up_says_one_line_of_each_child_and_quiets_their_own_starts(monkeypatch):
    import subprocess
    import sys

    from celery.platforms import ROOT_DISCOURAGED

    monkeypatch.delenv("FLEET_LOG_LEVEL", raising=False)
    children, said = started_with_env(monkeypatch, transcribe="whisper-tiny.en")
    assert said.splitlines() == [
        "  daphne:  the head, on http://127.0.0.1:8000/",
        "  celery:  the Celery worker, with beat (batch jobs, maintenance)",
        "  node:    the local node, serving smollm2 and whisper-tiny.en on 4 lanes once loaded"]
    assert children["daphne"]["argv"][3:5] == ["-v", "0"]  # not daphne's four start lines
    assert children["node"]["env"]["FLEET_LOG_LEVEL"] == "WARNING"
    assert "FLEET_LOG_LEVEL" not in children["celery"]["env"]
    monkeypatch.undo()  # subprocess.Popen itself again
    # Celery's own warning to root, under the worker's environment, prints nothing
    warn = ("import warnings; from celery.exceptions import SecurityWarning; "
            f"warnings.warn(SecurityWarning({ROOT_DISCOURAGED.format(uid=0, euid=0, gid=0, egid=0)!r}))")
    quiet = subprocess.run([sys.executable, "-c", warn], env=children["celery"]["env"], capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == ""
    loud = subprocess.run([sys.executable, "-c", warn], env=children["daphne"]["env"], capture_output=True, text=True)
    assert "superuser privileges" in loud.stderr  # the filter is the worker's alone


def test_a_log_level_the_operator_set_reaches_the_local_node(monkeypatch):
    monkeypatch.setenv("FLEET_LOG_LEVEL", "DEBUG")
    children, _ = started_with_env(monkeypatch)
    assert children["node"]["env"]["FLEET_LOG_LEVEL"] == "DEBUG"


@pytest.mark.django_db
def test_the_first_run_gives_the_key_as_an_export_line_and_later_runs_say_how_to_reset(tmp_path):
    import io
    import re

    from api.services import api_key_authenticate

    first = io.StringIO()
    Command(stdout=first)._first_run(OPTIONS)
    key = re.search(r"API key:\s+(\S+)", first.getvalue()).group(1)
    assert f"export KEY={key}" in first.getvalue() and api_key_authenticate(key=key) is not None
    assert "-H \"Authorization: Bearer $KEY\"" in first.getvalue()  # the try line runs once KEY is exported

    later = io.StringIO()
    Command(stdout=later)._first_run(OPTIONS)
    assert "manage.py changepassword admin" in later.getvalue()
    assert "manage.py create_api_key --user admin" in later.getvalue()
    assert key not in later.getvalue() and "user admin   password" not in later.getvalue()


@pytest.mark.django_db
def test_fleet_token_prints_the_address_up_bound_its_head_to(monkeypatch, settings, tmp_path):
    """`up --host 0.0.0.0 --port 8765` says where it listens; `fleet_token` on the same machine then prints a
    `make node HEAD=` line for that port (this machine's name for 0.0.0.0), not a guess of 8000."""
    import io
    import socket

    from django.core.management import call_command

    monkeypatch.delenv("FLEET_PUBLIC_ADDRESS", raising=False)
    settings.FLEET_HOME = tmp_path
    started_with_env(monkeypatch, host="0.0.0.0", port=8765)
    out = io.StringIO()
    call_command("fleet_token", "--name", "far", stdout=out, stderr=io.StringIO())
    assert f"make node HEAD={socket.gethostname()}:8765" in out.getvalue()


def test_a_celery_worker_that_exits_is_started_again_and_any_other_child_stops_the_fleet(monkeypatch):
    """The worker died after a Redis blip (in kombu, while acking), taking batches and maintenance with it: `up`
    starts it again (at most five times a minute), while a head or node that exits still stops the fleet."""
    import io

    from django.core.management.base import CommandError

    from fleet.management.commands import up

    class Popen:
        started: list[str] = []

        def __init__(self, argv, **kwargs):
            self.argv, self.code = argv, None
            Popen.started.append(argv[2])  # daphne, celery, node_join

        def poll(self):
            return self.code

    monkeypatch.setattr("fleet.management.commands.up.subprocess.Popen", Popen)
    monkeypatch.setattr(Command, "_wait_listening", lambda self, proc, host, port: None)
    command = Command(stdout=io.StringIO(), stderr=io.StringIO())
    children = command._start(dict(OPTIONS))
    for _ in range(up.RESTARTS_PER_MINUTE):
        children["celery"].code = 1
        command._check(children)
        assert children["celery"].code is None  # a new worker
    assert Popen.started.count("celery") == 1 + up.RESTARTS_PER_MINUTE
    assert "celery exited with status 1; starting it again" in command.stderr.getvalue()
    children["celery"].code = 1
    with pytest.raises(CommandError, match="celery exited"):  # a sixth time within the minute: something is wrong
        command._check(children)
    children = command._start(dict(OPTIONS))
    children["node"].code = 2
    with pytest.raises(CommandError, match="node exited with status 2"):
        command._check(children)
