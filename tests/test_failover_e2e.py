"""Nodes dying under load, with real processes: the client's stream goes on, or ends with a clear error."""

import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.live import make_head, start_node, wait_for

pytestmark = pytest.mark.slow

LONG = dict(model="smollm2", max_tokens=160, temperature=0,
            messages=[{"role": "user", "content": "Count from one to one hundred, in words, one per line."}],
            extra_body={"ignore_eos": True})


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def engine_worker_pid(node) -> int:
    """The node agent's engine worker: its spawned child that is not multiprocessing's resource tracker."""
    def find():
        for pid in children(node.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return pid
        return None
    return wait_for(find, 30, "no engine worker process found")


@pytest.fixture
def head(tmp_path):
    head = make_head(tmp_path)
    head.start()
    yield head
    head.stop()


def generation_record(head, gen_id: str) -> dict:
    response = httpx.get(f"{head.url}/api/generations/{uuid.UUID(gen_id)}/",
                         headers={"Authorization": f"Bearer {head.api_key}"}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_node_killed_mid_stream_the_stream_goes_on_on_another_node(head):
    nodes = {name: start_node(head, "--max-batch", "2", identity=name) for name in ("node-a", "node-b")}
    try:
        head.wait_nodes(2, timeout=240)
        client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120)
        stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **LONG)
        text, first_node, killed, finish, usage, chunk_id = "", None, False, None, None, None
        for chunk in stream:
            chunk_id = chunk.id
            if chunk.usage:
                usage = chunk.usage
            if not chunk.choices:
                continue
            first_node = first_node or chunk.system_fingerprint
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            if not killed and len(text) > 40:
                victim = first_node.removeprefix("fleet:")
                nodes[victim].stop(signal.SIGKILL)
                killed = True
        assert killed and finish == "length"
        assert usage.completion_tokens == LONG["max_tokens"]
        record = generation_record(head, chunk_id.removeprefix("chatcmpl-"))
        assert record["status"] == "done" and len(record["nodes_used"]) == 2
        assert record["nodes_used"][0] == victim and record["nodes_used"][1] != victim
        assert "Traceback" not in head.log()
    finally:
        for node in nodes.values():
            node.stop()


def test_engine_worker_killed_gives_a_clear_error_and_the_node_serves_the_next(head):
    node = start_node(head, "--max-batch", "2", identity="node-crash")
    try:
        head.wait_nodes(1, timeout=180)
        worker = engine_worker_pid(node)
        client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120)
        stream = client.chat.completions.create(stream=True, **LONG)
        error, text = None, ""
        try:
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if len(text) > 20 and worker:
                    os.kill(worker, signal.SIGKILL)
                    worker = 0
        except Exception as exc:  # the openai client raises on the stream's error event
            error = exc
        assert error is not None, f"the stream ended without an error: {text!r}"
        assert "engine worker died" in str(error)
        answer = client.chat.completions.create(model="smollm2", max_tokens=8,
                                                messages=[{"role": "user", "content": "Say hi"}])
        assert answer.choices[0].message.content
        assert node.proc.poll() is None  # the agent survived its worker
    finally:
        node.stop()
