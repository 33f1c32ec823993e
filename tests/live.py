"""Real processes for end-to-end tests: a head (daphne on a free port) and nodes (`manage.py node_join`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
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


def _fresh_database_url() -> str | None:
    """With DATABASE_URL set (PostgreSQL), each live head gets a database of its own."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        return None
    import psycopg

    name = f"fleet_live_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


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
                "FLEET_METRICS_TOKEN": f"metrics-{uuid.uuid4().hex}"})
    db = database_url or _fresh_database_url()
    if db:
        env["DATABASE_URL"] = db
    port = port or free_port()
    env["FLEET_HEAD_URL"] = f"http://127.0.0.1:{port}"  # where a Celery worker sends batch lines
    env.update(extra_env or {})
    head = Head(home=home, port=port, env=env)
    head.manage("migrate", "--noinput")
    head.manage("createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com")
    out = head.manage("create_api_key", "--user", "admin", "--name", "tests").stdout
    head.api_key = next(line.strip() for line in out.splitlines() if line.strip().startswith("fk-"))
    return head


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


def make_peer_head(head: Head, tmp: Path) -> Head:
    """A second head process on the same database, Redis prefix and secret key (a multi-process head)."""
    home = tmp / f"peer-{uuid.uuid4().hex[:6]}"
    home.mkdir(parents=True)
    env = {**head.env, "FLEET_HOME": str(home), "SECRET_KEY": (head.home / "secret_key").read_text().strip()}
    if "DATABASE_URL" not in env:
        env["FLEET_SQLITE_PATH"] = str(head.home / "fleet.sqlite3")
    return Head(home=home, port=free_port(), env=env, api_key=head.api_key)


def blob_bytes_served(head: Head) -> float:
    """The head's `fleet_blob_bytes_served_total` (what nodes pulled: models, projectors, media), read from /metrics."""
    request = urllib.request.Request(f"{head.url}/metrics",  # noqa: S310 - our own head
                                     headers={"Authorization": f"Bearer {head.env['FLEET_METRICS_TOKEN']}"})
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - our own head
        text = response.read().decode()
    match = re.search(r"^fleet_blob_bytes_served_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
