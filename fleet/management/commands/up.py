"""`manage.py up`: the whole embedded fleet in one command.

Migrates, creates an admin user and an API key on first run (printed once; `manage.py first_admin` alone does
that), then runs daphne, a Celery worker with beat, and a local node on the bundled model, until Ctrl-C stops them
all.
"""

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from api.management.commands.first_admin import first_admin_lines, lost_credentials_line
from api.services import first_admin_create
from fleet.daphne_options import daphne_limit_args
from fleet.discovery import Announcer
from nodes.link.handshake import LOCAL_TOKEN_ID, format_token, make_secret
from nodes.services import head_served_address_path

RESTARTED = {"celery"}  # the children `up` starts again when they exit; any other that exits stops the fleet
RESTARTS_PER_MINUTE = 5


class Command(BaseCommand):
    help = "Run the head (daphne), a Celery worker with beat, and a local node serving the bundled model."

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._spawners: dict[str, functools.partial] = {}
        self._restarts: dict[str, deque] = {}

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="address daphne listens on (127.0.0.1)")
        parser.add_argument("--port", type=int, default=8000, help="port daphne listens on (8000)")
        parser.add_argument("--model", default="smollm2", help="model for the local node (smollm2)")
        parser.add_argument("--max-batch", type=int, default=4, help="lanes of the local node (4)")
        parser.add_argument("--no-node", action="store_true", help="do not start a local node")
        parser.add_argument("--transcribe", default="whisper-tiny.en",
                            help="speech model the local node also serves for /v1/audio/transcriptions "
                                 "(whisper-tiny.en); an empty value serves none")
        parser.add_argument("--no-celery", action="store_true", help="do not start the Celery worker")

    def handle(self, *args, **options):
        _refuse_taken_port(options["host"], options["port"])
        call_command("migrate", interactive=False, verbosity=0)
        self._first_run(options)
        children = self._start(options)
        announcer = Announcer(options["port"], options["host"])
        if settings.FLEET_MDNS and not settings.FLEET_ANNOUNCE and options["host"] not in {"127.0.0.1", "localhost",
                                                                                          "::1"}:
            announcer.start([options["model"]] if not options["no_node"] else [])
        self.stdout.write(f"Fleet is up: http://{options['host']}:{options['port']}/admin/  (Ctrl-C stops it)\n")
        self.stdout.flush()
        try:
            self._watch(children)
        finally:
            announcer.stop()
            self._stop(children)

    def _first_run(self, options):
        """The admin and key of `manage.py first_admin`, with where to open them and a first request to try."""
        made = first_admin_create(username="admin")
        if not made.created:
            self.stdout.write(lost_credentials_line(made.username))
            return
        base = f"http://{options['host']}:{options['port']}"
        self.stdout.write(
            first_admin_lines(made, base)
            + f"  try:       curl {base}/v1/chat/completions -H \"Authorization: Bearer $KEY\" "
            "-H 'Content-Type: application/json' "
            f"-d '{{\"model\":\"{options['model']}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi\"}}]}}'\n"
            f"  API docs:  {base}/v1/docs/ (the /v1 API), {base}/api/docs/ (management)\n\n"
        )

    def _start(self, options) -> dict[str, subprocess.Popen]:
        python, manage = sys.executable, str(settings.BASE_DIR / "manage.py")
        # The local node's token, made for this run and known only to these children: the head takes it from
        # loopback only, never through a proxy; nothing else joins without a token from `manage.py fleet_token`.
        local_token = format_token(LOCAL_TOKEN_ID, make_secret())
        # The Celery worker sends batch lines to this head's /v1 (api.batch_run).
        head_host = "127.0.0.1" if options["host"] in {"0.0.0.0", "::"} else options["host"]
        outside = {k: v for k, v in os.environ.items() if k != "FLEET_TOKEN"}  # the local node joins with its own
        env = {**outside, "PYTHONUNBUFFERED": "1", "FLEET_LOCAL_NODE_TOKEN": local_token,
               "FLEET_HEAD_URL": os.environ.get("FLEET_HEAD_URL") or f"http://{head_host}:{options['port']}"}
        commands = {
            # No access line per request (every static file, every poll): Fleet logs each generation itself;
            # FLEET_ACCESS_LOG=- (or a path) brings daphne's access log back.
            # -v 0: not daphne's four lines of its own start (Fleet's loggers keep their level; `up` says it).
            "daphne": [python, "-m", "daphne", "-v", "0", "-b", options["host"], "-p", str(options["port"]),
                       "--access-log", os.environ.get("FLEET_ACCESS_LOG") or os.devnull,
                       *daphne_limit_args(), "fleet.asgi:application"],
        }
        if not options["no_celery"]:
            # --quiet: no banner (its warnings and errors still show)
            commands["celery"] = [python, "-m", "celery", "-A", "fleet", "--quiet", "worker", "-B", "--pool=solo",
                                  "--loglevel=WARNING", "-s", str(settings.FLEET_HOME / "celerybeat-schedule")]
        if not options["no_node"]:
            head = f"127.0.0.1:{options['port']}" if options["host"] in {"0.0.0.0", "127.0.0.1"} else \
                f"{options['host']}:{options['port']}"
            commands["node"] = [python, manage, "node_join", head, "--model", options["model"], "--identity", "local",
                                "--max-batch", str(options["max_batch"]), "--offline"]
            if options["transcribe"]:
                commands["node"] += ["--transcribe", options["transcribe"]]
        children, quiet = {}, _quiet_env()
        self._spawners = {}
        for name, argv in commands.items():
            # Own process groups: Ctrl-C reaches `up`, which stops each child in order.
            self._spawners[name] = functools.partial(subprocess.Popen, argv, env={**env, **quiet.get(name, {})},
                                                     cwd=settings.BASE_DIR, start_new_session=True)
            children[name] = self._spawners[name]()
            if name == "daphne":
                self._wait_listening(children[name], options["host"], options["port"])
                # what `fleet_token` prints for nodes to dial (nodes.services.fleet_token_head_address)
                head_served_address_path().write_text(f"{options['host']}:{options['port']}\n")
            self.stdout.write(f"  {name + ':':8} {_started_line(name, options)}\n")
            self.stdout.flush()
        return children

    def _wait_listening(self, proc: subprocess.Popen, host: str, port: int) -> None:
        """Start the node and say "up" only once the head answers."""
        address = "127.0.0.1" if host in {"0.0.0.0", "::"} else host
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CommandError(f"daphne exited with status {proc.returncode}; is port {port} already in use?",
                                   returncode=1)
            try:
                socket.create_connection((address, port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise CommandError(f"the head did not start listening on {host}:{port} within 60 s", returncode=1)

    def _watch(self, children):
        stop = {"now": False}

        def on_signal(signum, frame):
            stop["now"] = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stop["now"]:
            self._check(children)
            time.sleep(0.5)

    def _check(self, children: dict[str, subprocess.Popen]) -> None:
        """A child that exited: the Celery worker (with beat) is started again, at most RESTARTS_PER_MINUTE times a
        minute (it died of a broker outage once, taking batches and maintenance with it); any other stops the fleet."""
        for name, proc in list(children.items()):
            code = proc.poll()
            if code is None:
                continue
            now, restarts = time.monotonic(), self._restarts.setdefault(name, deque())
            while restarts and now - restarts[0] > 60:
                restarts.popleft()
            if name not in RESTARTED or len(restarts) >= RESTARTS_PER_MINUTE:
                raise CommandError(f"{name} exited with status {code}; stopping the fleet", returncode=1)
            restarts.append(now)
            self.stderr.write(f"  {name} exited with status {code}; starting it again\n")
            children[name] = self._spawners[name]()

    def _stop(self, children):
        self._stop_head(children.get("daphne"))
        for proc in reversed(list(children.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in children.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
        head_served_address_path().unlink(missing_ok=True)
        self.stdout.write("Fleet stopped.\n")


    def _stop_head(self, daphne: subprocess.Popen | None) -> None:
        """The head first, while its node still serves: it drains (fleet/shutdown.py), so running generations finish
        within FLEET_SHUTDOWN_GRACE_S or end with an error event, and each is recorded. Ctrl-C again ends them now."""
        if daphne is None or daphne.poll() is not None:
            return
        self.stdout.write(f"Stopping: running generations get {settings.FLEET_SHUTDOWN_GRACE_S} s to finish "
                          "(Ctrl-C again ends them now).\n")
        self.stdout.flush()
        signal.signal(signal.SIGINT, lambda signum, frame: daphne.poll() is None and daphne.send_signal(signal.SIGTERM))
        daphne.send_signal(signal.SIGTERM)
        try:
            daphne.wait(settings.FLEET_SHUTDOWN_GRACE_S + 30)
        except subprocess.TimeoutExpired:
            daphne.kill()


def _quiet_env() -> dict[str, dict[str, str]]:
    """What each child's environment adds for a quiet start. The worker runs as the user who ran `up`, who chose
    it: Celery's warning against root is not said again each start. The local node's own INFO lines (device, window,
    key pinned, joined) repeat what the head logs of its join in one line; FLEET_LOG_LEVEL set brings them back."""
    warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                      "ignore:You're running the worker with superuser privileges"]))
    return {"celery": {"PYTHONWARNINGS": warnings},
            "node": {"FLEET_LOG_LEVEL": os.environ.get("FLEET_LOG_LEVEL") or "WARNING"}}



def _started_line(name: str, options) -> str:
    """The one line `up` says of each child it started."""
    if name == "daphne":
        return f"the head, on http://{options['host']}:{options['port']}/"
    if name == "celery":
        return "the Celery worker, with beat (batch jobs, maintenance)"
    also = f" and {options['transcribe']}" if options["transcribe"] else ""
    return f"the local node, serving {options['model']}{also} on {options['max_batch']} lanes once loaded"


def _refuse_taken_port(host: str, port: int) -> None:
    """One line and exit status 2 when something else holds the port: otherwise `up` would take that other
    server's answer for its own head's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another head or server "
                               "holds the port?); stop it or pass --port", returncode=2) from None
