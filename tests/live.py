"""Real processes for end-to-end tests: a head (daphne on a free port) and nodes (`manage.py node_join`)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fleet.daphne_options import daphne_limit_args
from nodes.link.handshake import LOCAL_TOKEN_ID, format_token, make_secret

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Head:
    home: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    api_key: str = ""
    log_path: Path = field(default=None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run([PYTHON, str(ROOT / "manage.py"), *args], cwd=ROOT, env=self.env, capture_output=True,
                                text=True, timeout=timeout)
        if check and result.returncode:
            raise AssertionError(f"manage.py {' '.join(args)} failed ({result.returncode}): {result.stderr[-3000:]}")
        return result

    def start(self) -> None:
        self.log_path = self.home / f"daphne-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), *daphne_limit_args(),
             "fleet.asgi:application"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for(lambda: self.health() is not None, 60, f"head on port {self.port} did not start: {self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def health(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as resp:  # noqa: S310 - our own http URL
                return json.loads(resp.read())
        except OSError:
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def wait_nodes(self, count: int, timeout: float = 120) -> None:
        wait_for(lambda: (self.health() or {}).get("nodes", 0) >= count, timeout,
                 f"{count} node(s) did not join: {self.log()}")


@dataclass
class NodeProc:
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def wait_for(predicate, timeout: float, message: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(message)


def make_head(tmp: Path, *, extra_env: dict[str, str] | None = None, port: int | None = None,
              database_url: str | None = None) -> Head:
    home = tmp / f"head-{uuid.uuid4().hex[:6]}"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    # As under `manage.py up`: this head's own nodes (start_node) join with a local token made for the run.
    env.update({"FLEET_HOME": str(home), "FLEET_MDNS": "0", "DJANGO_SETTINGS_MODULE": "fleet.settings",
                "FLEET_LOCAL_NODE_TOKEN": format_token(LOCAL_TOKEN_ID, make_secret()),
                "FLEET_REDIS_PREFIX": f"fleet-test-{uuid.uuid4().hex[:8]}:",
                "PYTHONUNBUFFERED": "1", "DJANGO_SUPERUSER_PASSWORD": "test-password-1",
                "FLEET_METRICS_TOKEN": f"metrics-{uuid.uuid4().hex}",
                "FLEET_SHUTDOWN_GRACE_S": "3"})  # a test's head stopped mid-stream drains briefly
    if database_url:
        env["DATABASE_URL"] = database_url
    port = port or free_port()
    env["FLEET_HEAD_URL"] = f"http://127.0.0.1:{port}"  # where a Celery worker sends batch lines
    env.update(extra_env or {})
    head = Head(home=home, port=port, env=env)
    if database_url:  # the caller's own database: migrated here, in one process
        head.api_key = database_prepare(head)
    else:
        head.api_key = _database_from_template(env)
    return head


# One process migrates and makes the superuser and the tests' API key (three `manage.py` boots were one each).
_PREPARE = """
from django.contrib.auth import get_user_model
from django.core.management import call_command
from api.services import api_key_create
call_command("migrate", interactive=False, verbosity=0)
admin = get_user_model().objects.create_superuser("admin", "admin@example.com", "test-password-1")
print("API-KEY", api_key_create(owner=admin, name="tests")[1])
"""


def database_prepare(head: Head) -> str:
    """Migrate `head`'s database and make user `admin` and an API key named `tests` in it; returns the key."""
    out = head.manage("shell", "--no-startup", "-c", _PREPARE, timeout=300).stdout
    return next(line.split()[1] for line in out.splitlines() if line.startswith("API-KEY "))


@dataclass
class _Template:
    """A database migrated once a test session (with `admin` and the `tests` key in it); each head gets a copy."""

    api_key: str
    sqlite: Path | None = None  # the template's file (the embedded default)
    postgres: str = ""  # the template database's name (DATABASE_URL set)


_templates: dict[str, _Template] = {}


def _database_from_template(env: dict[str, str]) -> str:
    """Give the head whose environment is `env` a copy of the migrated template (SQLite: a file copy, PostgreSQL:
    CREATE DATABASE ... TEMPLATE); returns the template's API key, which the copy holds."""
    url = os.environ.get("DATABASE_URL", "")
    template = _templates.get(url) or _templates.setdefault(url, _template_make(url))
    if template.postgres:
        env["DATABASE_URL"] = _postgres_copy(url, template.postgres)
    else:
        target = Path(env.get("FLEET_SQLITE_PATH") or Path(env["FLEET_HOME"]) / "fleet.sqlite3")
        with contextlib.closing(sqlite3.connect(template.sqlite)) as source, \
                contextlib.closing(sqlite3.connect(target)) as copy:
            source.backup(copy)
    return template.api_key


def _template_make(url: str) -> _Template:
    home = Path(tempfile.mkdtemp(prefix="fleet-template-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update({"FLEET_HOME": str(home), "DJANGO_SETTINGS_MODULE": "fleet.settings", "FLEET_MDNS": "0"})
    env.pop("FLEET_SQLITE_PATH", None)
    name = ""
    if url:
        name = f"fleet_template_{uuid.uuid4().hex[:10]}"
        env["DATABASE_URL"] = _postgres_create(url, name)
        atexit.register(_postgres_drop, url, name)
    key = database_prepare(Head(home=home, port=0, env=env))
    return _Template(api_key=key, sqlite=None if url else home / "fleet.sqlite3", postgres=name)


def _postgres_create(url: str, name: str, template: str = "") -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


def _postgres_drop(url: str, name: str) -> None:
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def _postgres_copy(url: str, template: str) -> str:
    return _postgres_create(url, f"fleet_live_{uuid.uuid4().hex[:10]}", template)


def start_node(head: Head, *args: str, identity: str = "test-node", model: str = "smollm2",
               extra_env: dict[str, str] | None = None, discover: bool = False, offline: bool = True) -> NodeProc:
    """A node_join process for `head`; with `discover`, given no address, so it must find the head by mDNS. With an
    address it runs `--offline` (no mDNS) unless `offline` is False: then it may pull a registry model."""
    log_path = head.home / f"node-{identity}-{uuid.uuid4().hex[:4]}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    env = {**head.env, **(extra_env or {})}
    proc = subprocess.Popen(
        [PYTHON, str(ROOT / "manage.py"), "node_join", *([] if discover else [head.address]), "--model", model,
         "--identity", identity, *([] if discover or not offline else ["--offline"]), *args],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return NodeProc(proc, log_path)


@contextlib.contextmanager
def two_heads(tmp: Path):
    """A head and a peer head process on its database and Redis (a multi-process head), both stopped after."""
    first = make_head(tmp)
    first.start()
    second = make_peer_head(first, tmp)
    try:
        second.start()
        yield first, second
    finally:
        second.stop()
        first.stop()


def make_peer_head(head: Head, tmp: Path) -> Head:
    """A second head process on the same database, Redis prefix and secret key (a multi-process head)."""
    home = tmp / f"peer-{uuid.uuid4().hex[:6]}"
    home.mkdir(parents=True)
    env = {**head.env, "FLEET_HOME": str(home), "SECRET_KEY": _secret_key_of(head)}
    if "DATABASE_URL" not in env:
        env["FLEET_SQLITE_PATH"] = str(head.home / "fleet.sqlite3")
    return Head(home=home, port=free_port(), env=env, api_key=head.api_key)


def _secret_key_of(head: Head) -> str:
    """The head's SECRET_KEY: the one it keeps in its FLEET_HOME. A head made from the template database has not run
    a `manage.py` of its own, so before its first start there is none yet: one is made and kept there for it."""
    if head.env.get("SECRET_KEY"):
        return head.env["SECRET_KEY"]
    path = head.home / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50) + "\n")
        path.chmod(0o600)
    return path.read_text().strip()


def blob_bytes_served(head: Head) -> float:
    """The head's `fleet_blob_bytes_served_total` (what nodes pulled: models, projectors, media), read from /metrics."""
    request = urllib.request.Request(f"{head.url}/metrics",  # noqa: S310 - our own head
                                     headers={"Authorization": f"Bearer {head.env['FLEET_METRICS_TOKEN']}"})
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - our own head
        text = response.read().decode()
    match = re.search(r"^fleet_blob_bytes_served_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
