"""A node with two engine replicas: requests spread over both, and a killed replica heals while the other serves."""

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.live import make_head, start_node, wait_for
from tests.test_failover_e2e import children

pytestmark = pytest.mark.slow


def worker_pids(node) -> list[int]:
    pids = []
    for pid in children(node.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return sorted(pids)


def _pair(pids: list[int]) -> list[int] | None:
    return pids if len(pids) == 2 else None


def test_killed_replica_heals_while_the_other_serves(tmp_path):
    head = make_head(tmp_path)
    head.start()
    node = start_node(head, "--replicas", "2", "--max-batch", "2", identity="node-r")
    try:
        head.wait_nodes(1, timeout=240)
        before = wait_for(lambda: _pair(worker_pids(node)), 60, "two replicas expected")
        auth = {"Authorization": f"Bearer {head.api_key}"}
        status = httpx.get(f"{head.url}/api/nodes/", headers=auth, timeout=10).json()
        listed = status["results"] if isinstance(status, dict) else status
        assert listed[0]["lanes"] == 4 and len(listed[0]["replicas"]) == 2
        os.kill(before[0], signal.SIGKILL)
        for i in range(3):  # served by the surviving replica meanwhile
            reply = httpx.post(f"{head.url}/v1/completions", headers=auth, timeout=120,
                               json={"model": "smollm2", "prompt": f"Number {i}:", "max_tokens": 4})
            assert reply.status_code == 200, reply.text
        after = wait_for(lambda: (p if (p := _pair(worker_pids(node))) and p != before else None), 60,
                         f"the killed replica did not come back: {node.log()}")
        assert before[1] in after and before[0] not in after
        assert node.proc.poll() is None
    finally:
        node.stop()
        head.stop()
