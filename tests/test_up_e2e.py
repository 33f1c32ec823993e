"""`manage.py up`: the embedded fleet in one command, as a new user starts it, and Ctrl-C stops it all."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.live import ROOT, free_port, wait_for

pytestmark = pytest.mark.slow


def test_up_serves_the_admin_and_a_local_node_then_stops_cleanly(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update({"FLEET_HOME": str(tmp_path), "FLEET_MDNS": "0", "PYTHONUNBUFFERED": "1",
                "FLEET_REDIS_PREFIX": f"fleet-up-{uuid.uuid4().hex[:6]}:"})
    log = tmp_path / "up.log"
    proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "up", "--port", str(port), "--max-batch", "2"],
                            cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    try:
        text = wait_for(lambda: log.read_text() if "Fleet is up" in log.read_text() else None, 120,
                        f"up did not start: {log.read_text() if log.exists() else ''}")
        password = re.search(r"user admin\s+password (\S+)", text).group(1)
        key = re.search(r"API key:\s+(\S+)", text).group(1)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: "smollm2" in httpx.get(f"{base}/healthz").json()["models"], 180, "the local node never joined")
        assert "whisper-tiny.en" in httpx.get(f"{base}/healthz").json()["models"]  # it transcribes too (--transcribe)
        reply = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                           json={"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
        with httpx.Client(base_url=base, follow_redirects=True) as admin:
            page = admin.get("/admin/login/")
            csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            admin.post("/admin/login/?next=/admin/fleet/", data={"csrfmiddlewaretoken": csrf, "username": "admin",
                                                                 "password": password, "next": "/admin/fleet/"})
            fleet = admin.get("/admin/fleet/").text
        assert "local" in fleet and "online" in fleet and "smollm2" in fleet
        # A second start prints no new credentials.
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(40)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert "Fleet stopped." in out and "Traceback" not in out
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz")
