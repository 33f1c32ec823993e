"""docs/operations.md, *Production layout*, followed as a script would follow it: every command is taken from the page
(asserted there word for word, then run with this machine's addresses), on a fresh PostgreSQL database and Redis.

migrate, `first_admin` (twice), two daphne head processes, a Celery worker and beat, `fleet_token` (its printed
line names FLEET_PUBLIC_ADDRESS), a node started from that printed line, then a stream through each head process
with the official client. With an nginx binary on the machine (on PATH, or FLEET_TEST_NGINX=path) the page's nginx
config runs in front: the node joins through it, a stream goes through it and an oversized body stops there.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.live import ROOT, _postgres_create, _postgres_drop, free_port, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")),
                       reason="the production layout runs on PostgreSQL and Redis (DATABASE_URL, REDIS_URL)"),
]

NGINX = os.environ.get("FLEET_TEST_NGINX") or shutil.which("nginx")
VENV_BIN = Path(sys.executable).parent


def production_page() -> str:
    """The page's section, with each command continued on a second line (`\\` and an indent) joined into one."""
    text = (ROOT / "docs" / "operations.md").read_text()
    return text[text.index("## Production layout"):text.index("## Maintenance")].replace("\\\n  ", "")


class Page:
    """The page's commands for this machine: its two head ports and its nginx become free ports on 127.0.0.1."""

    def __init__(self, ports: tuple[int, int]):
        self.text = production_page()
        self.swap = {"10.0.0.5": "127.0.0.1", "8001": str(ports[0]), "8002": str(ports[1]),
                     ".venv/bin/python": sys.executable, ".venv/bin/celery": str(VENV_BIN / "celery")}

    def command(self, line: str) -> tuple[dict[str, str], list[str]]:
        """The page's `line` (leading NAME=value words are its environment) as (environment, argv) here."""
        assert line in self.text, f"the production page no longer says: {line}"
        for old, new in self.swap.items():
            line = line.replace(old, new)
        words, env = shlex.split(line), {}
        while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        return env, words

    def nginx_config(self, listen: int) -> str:
        config = re.search(r"```nginx\n(.*?)```", self.text, re.S).group(1)
        for old, new in self.swap.items():
            config = config.replace(old, new)
        assert "listen 80;" in config
        return config.replace("listen 80;", f"listen 127.0.0.1:{listen};")


class Processes:
    """The processes the page starts, each with its log, stopped in reverse order."""

    def __init__(self, home: Path):
        self.home, self.started = home, []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Path:
        log = self.home / f"{name}.log"
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "ab"),  # noqa: SIM115 - the child owns it
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append((proc, log))
        return log

    def stop(self) -> None:
        for proc, _ in reversed(self.started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.started:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def health(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def stream(url: str, key: str) -> tuple[int, str]:
    """(content chunks, finish reason) of one streamed chat through `url`."""
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    chunks = [c for c in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12,
        temperature=0, stream=True) if c.choices]
    return sum(1 for c in chunks if c.choices[0].delta.content), chunks[-1].choices[0].finish_reason


def run(env: dict[str, str], argv: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr[-3000:]}"
    return result


@pytest.fixture
def database():
    url = os.environ["DATABASE_URL"]
    name = f"fleet_production_{uuid.uuid4().hex[:10]}"
    yield _postgres_create(url, name)
    _postgres_drop(url, name)


def test_the_production_page_followed_literally_serves_a_stream_through_each_head(tmp_path, database):
    ports = (free_port(), free_port())
    page, procs = Page(ports), Processes(tmp_path)
    heads = [f"http://127.0.0.1:{port}" for port in ports]
    proxy = free_port() if NGINX else None
    public = f"127.0.0.1:{proxy or ports[0]}"  # nginx's address; without one, a head's (nodes join through it)
    # 1. the settings every process reads (the page's names; this machine's values)
    settings = {"DATABASE_URL": database, "REDIS_URL": os.environ["REDIS_URL"], "SECRET_KEY": secrets.token_urlsafe(50),
                "FLEET_HOME": str(tmp_path / "head"), "FLEET_PUBLIC_ADDRESS": public,
                "FLEET_HEAD_URL": f"http://{public}", "FLEET_ALLOWED_HOSTS": "127.0.0.1,localhost",
                "FLEET_CSRF_TRUSTED_ORIGINS": f"http://{public}", "FLEET_TRUSTED_PROXIES": "127.0.0.1"}
    for name in settings:
        assert f"\n{name}=" in page.text, f"the production page no longer sets {name}"
    outside = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "FLEET_", "DJANGO_"))}
    prefix = f"fleet-production-{uuid.uuid4().hex[:8]}:"  # this run's keys in a shared Redis
    env = {**outside, **settings, "FLEET_MDNS": "0", "PYTHONUNBUFFERED": "1", "FLEET_SHUTDOWN_GRACE_S": "3",
           "FLEET_REDIS_PREFIX": prefix}
    try:
        # 2. the database, then the first admin and its key (a second run makes nothing and says so)
        run(env, page.command(".venv/bin/python manage.py migrate")[1])
        first = run(env, page.command(".venv/bin/python manage.py first_admin")[1]).stdout
        key = re.search(r"export KEY=(\S+)", first).group(1)
        assert re.search(r"user admin\s+password \S+", first), first
        again = run(env, page.command(".venv/bin/python manage.py first_admin")[1]).stdout
        assert "An admin user exists already (admin)" in again and key not in again

        # 3. two head processes with the page's options; 4. the Celery worker and beat
        for i, port in enumerate(("8001", "8002")):
            own, argv = page.command(f"FLEET_LINK_URL=ws://10.0.0.5:{port}/ws/node/ .venv/bin/python -m daphne "
                                     f"-b 10.0.0.5 -p {port} --websocket-max-message-size 4259840 "
                                     "--websocket-max-frame-size 4259840 fleet.asgi:application")
            assert own == {"FLEET_LINK_URL": f"ws://127.0.0.1:{ports[i]}/ws/node/"}
            procs.start(f"head-{i + 1}", argv, {**env, **own})
        worker_log = procs.start("worker", page.command(".venv/bin/celery -A fleet worker --loglevel=INFO")[1], env)
        procs.start("beat", page.command(".venv/bin/celery -A fleet beat --loglevel=INFO")[1], env)
        for i, url in enumerate(heads, 1):
            wait_for(lambda url=url: health(url), 90, f"head {url} did not start: {_tail(tmp_path / f'head-{i}.log')}")
        if proxy:  # 5. the page's nginx in front
            _start_nginx(page, proxy, tmp_path, procs)

        # 6. a fleet token: its printed line names FLEET_PUBLIC_ADDRESS; a node host runs that line
        token = subprocess.run(page.command(".venv/bin/python manage.py fleet_token --name nodes")[1], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=120)
        assert token.returncode == 0 and "warning" not in token.stderr, token.stderr
        secret = re.search(rf"FLEET_TOKEN=(\S+) make node HEAD={re.escape(public)}\n", token.stdout).group(1)
        installed = re.search(r"FLEET_TOKEN=\S+ (\.venv/bin/python manage\.py node_join .*)", token.stdout).group(1)
        node_home = tmp_path / "node-host"  # another host: its own FLEET_HOME, none of the head's settings
        argv = shlex.split(installed.replace("<path.gguf|smollm2>", "smollm2").replace(".venv/bin/python",
                                                                                        sys.executable))
        assert argv[3] == public, installed
        procs.start("node", [*argv, "--identity", "production-node", "--offline", "--max-batch", "2"],
                    {**outside, "FLEET_HOME": str(node_home), "FLEET_MDNS": "0", "FLEET_TOKEN": secret,
                     "PYTHONUNBUFFERED": "1"})
        for url in heads:  # it joined through one address, and links both head processes
            wait_for(lambda url=url: (health(url) or {}).get("nodes", 0) >= 1, 240,
                     f"the node did not link {url}: {_tail(tmp_path / 'node.log')}")

        # a stream through each head process (and through nginx)
        for url in heads + ([f"http://{public}"] if proxy else []):
            tokens, finish = stream(url, key)
            assert tokens >= 2 and finish in {"length", "stop"}, (url, tokens, finish)
        if proxy:  # a body over client_max_body_size stops at nginx
            big = httpx.post(f"http://{public}/v1/chat/completions", content=b"x" * (6 << 20),
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            assert big.status_code == 413 and "nginx" in big.text
        # beat schedules, the worker runs (the batch resume is due every 15 s)
        wait_for(lambda: re.search(r"Task api\.tasks\.batch_resume\[\S+\] succeeded", worker_log.read_text()), 60,
                 f"the worker ran no task beat sent: {_tail(worker_log)}")
    finally:
        procs.stop()
        _redis_forget(prefix)


def _start_nginx(page: Page, listen: int, tmp_path: Path, procs: Processes) -> None:
    """The page's nginx config in an http {} of its own (temp files and logs under tmp_path), as nginx's conf.d."""
    root = tmp_path / "nginx"
    root.mkdir()
    (root / "fleet.conf").write_text(page.nginx_config(listen))
    temp = " ".join(f"{kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (root / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"worker_processes 1;\npid {root / 'nginx.pid'};\nerror_log {root / 'error.log'};\n"
        f"events {{ worker_connections 1024; }}\nhttp {{ access_log off; {temp} include {root / 'fleet.conf'}; }}\n")
    argv = [NGINX, "-p", str(root), "-c", str(root / "nginx.conf"), "-e", str(root / "error.log")]
    checked = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    procs.start("nginx", [*argv, "-g", "daemon off;"], dict(os.environ))
    wait_for(lambda: health(f"http://127.0.0.1:{listen}"), 30, f"nginx did not answer: {_tail(root / 'error.log')}")


def _redis_forget(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    for key in client.scan_iter(f"{prefix}*", count=1000):
        client.delete(key)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""
