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


def stream_text(client, kill=None, **request) -> tuple[str, str, object, str]:
    """Stream one chat; with `kill`, SIGKILL the node serving it once 40 characters have arrived.
    Returns (text, finish reason, usage, generation id)."""
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
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
        if kill is not None and not killed and len(text) > 40:
            kill(first_node.removeprefix("fleet:"))
            killed = True
    assert kill is None or killed
    return text, finish, usage, chunk_id.removeprefix("chatcmpl-")


def test_node_killed_mid_stream_the_stream_goes_on_token_for_token(head):
    """Greedy and seeded sampled generations whose node is killed mid-stream end exactly as uninterrupted runs
    of the same requests do: the next node continues from the exact token ids already streamed."""
    nodes = {name: start_node(head, "--max-batch", "2", identity=name) for name in ("node-a", "node-b", "node-c")}
    seeded = {**LONG, "temperature": 0.8, "seed": 7, "max_tokens": 60,
              "messages": [{"role": "user", "content": "Tell me about your favourite city."}]}
    try:
        head.wait_nodes(3, timeout=240)
        client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120)
        references = [stream_text(client, **request)[0] for request in (LONG, seeded)]
        victims = []

        def kill(name):
            victims.append(name)
            nodes[name].stop(signal.SIGKILL)

        for request, reference in zip((LONG, seeded), references, strict=True):
            text, finish, usage, gen_id = stream_text(client, kill=kill, **request)
            assert finish == "length" and usage.completion_tokens == request["max_tokens"]
            assert text == reference  # token for token: nothing lost, repeated or sampled differently
            record = generation_record(head, gen_id)
            assert record["status"] == "done" and len(record["nodes_used"]) == 2
            assert record["nodes_used"][0] == victims[-1] and record["nodes_used"][1] != victims[-1]
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
