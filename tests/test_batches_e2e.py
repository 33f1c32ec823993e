"""OpenAI's Files and Batch APIs as a user drives them: the official `openai` client against a real head (daphne),
a real mock-engine node and a real Celery worker on the broker the environment selects (the filesystem broker on
the embedded default; Redis, and PostgreSQL, when REDIS_URL and DATABASE_URL are set)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from tests.live import ROOT, make_head, wait_for
from tests.mock_node import start_mock_node

pytestmark = pytest.mark.slow

MODEL = "smollm2"


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    head = make_head(tmp_path_factory.mktemp("batches"), extra_env={
        "FLEET_QUOTA_REQUESTS_PER_MINUTE": "0", "FLEET_BATCH_CONCURRENCY": "3", "FLEET_BATCH_LEASE_S": "3",
        "FLEET_BATCH_RESUME_S": "1"})
    head.start()
    node = start_mock_node(head, "batch-node", lanes=4, decode_tps=40.0)
    head.wait_nodes(1, timeout=120)
    yield head
    node.stop()
    head.stop()


@pytest.fixture
def client(head) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=60)


class Worker:
    """A `celery worker` process (with beat when asked) in its own process group, for SIGKILL."""

    def __init__(self, head, *, beat: bool = False):
        self.log_path = head.home / f"worker-{time.monotonic_ns()}.log"
        args = ["-B", "-s", str(head.home / "beat-schedule")] if beat else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fleet", "worker", "--pool=solo", "--loglevel=INFO",
             "-n", f"batch-{time.monotonic_ns()}@%h", *args],
            cwd=ROOT, env=head.env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def worker(head):
    worker = Worker(head)
    yield worker
    worker.kill()


def chat_line(custom_id: str, words: str = "Say hello.", max_tokens: int = 4) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}}


def upload(client, lines: list[dict | str]):
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return client.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch")


def wait_status(client, batch_id: str, statuses: set[str], timeout: float = 120):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, timeout,
                    f"batch {batch_id} never reached {statuses}: {client.batches.retrieve(batch_id)}")


def entries(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {row["custom_id"]: row for row in rows}


def test_the_openai_clients_batch_flow(head, client, worker):
    lines = [chat_line(f"chat-{i}", max_tokens=3 + i) for i in range(3)]
    lines += ["this is not json", chat_line("chat-0"), {**chat_line("wrong-url"), "url": "/v1/embeddings"}]
    source = upload(client, lines)
    assert source.purpose == "batch" and source.bytes > 0 and source.filename == "input.jsonl"
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "e2e"})
    assert batch.status == "validating" and batch.metadata == {"run": "e2e"}

    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 3, 3)
    output = entries(client, done.output_file_id)
    assert sorted(output) == ["chat-0", "chat-1", "chat-2"]
    for i in range(3):
        response = output[f"chat-{i}"]["response"]
        assert response["status_code"] == 200 and output[f"chat-{i}"]["error"] is None
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["usage"]["completion_tokens"] == 3 + i
    errors = list(map(json.loads, client.files.content(done.error_file_id).text.splitlines()))
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (None, "invalid_json_line"), ("chat-0", "duplicate_custom_id"), ("wrong-url", "invalid_url")]
    assert batch.id in [b.id for b in client.batches.list()]
    assert client.files.retrieve(source.id).id == source.id


def test_completions_and_embeddings_batches(client, worker):
    prompts = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"Count to {i}", "max_tokens": 2}} for i in range(2)]
    embeds = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
               "body": {"model": MODEL, "input": f"text {i}"}} for i in range(2)]
    completion = client.batches.create(input_file_id=upload(client, prompts).id, endpoint="/v1/completions",
                                       completion_window="24h")
    embedding = client.batches.create(input_file_id=upload(client, embeds).id, endpoint="/v1/embeddings",
                                      completion_window="24h")
    for batch, kind in ((completion, "text_completion"), (embedding, "list")):
        done = wait_status(client, batch.id, {"completed", "failed"})
        assert done.status == "completed" and done.request_counts.completed == 2, done
        assert {row["response"]["body"]["object"] for row in entries(client, done.output_file_id).values()} == {kind}


def test_an_input_that_is_not_jsonl_fails_the_batch(client, worker):
    source = client.files.create(file=("input.jsonl", io.BytesIO(b"a,b,c\n1,2,3\n")), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_status(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and failed.errors.data[0].code == "invalid_file_format"


def test_files_and_batches_belong_to_their_owner(head, client):
    source = upload(client, [chat_line("x")])
    head.manage("shell", "-c", "from django.contrib.auth.models import User; User.objects.get_or_create("
                "username='other')")
    out = head.manage("create_api_key", "--user", "other", "--name", "other").stdout
    other = openai.OpenAI(base_url=f"{head.url}/v1", max_retries=0,
                          api_key=next(line.strip() for line in out.splitlines() if line.strip().startswith("fk-")))
    with pytest.raises(openai.NotFoundError):
        other.files.content(source.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert source.id not in [f.id for f in other.files.list()]
    assert client.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)


def test_cancel_stops_new_lines_and_keeps_the_finished(client, worker):
    source = upload(client, [chat_line(f"slow-{i}", max_tokens=20) for i in range(30)])
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 120, "no line finished")
    cancel_at = time.time()
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    at_cancel = cancelling.request_counts.completed
    cancelled = wait_status(client, batch.id, {"cancelled"})
    # Only the lines already running (3 at once) may finish after the cancel; none starts.
    assert at_cancel <= cancelled.request_counts.completed <= at_cancel + 3 < 30
    answered = entries(client, cancelled.output_file_id)
    assert len(answered) == cancelled.request_counts.completed
    # and none started 2 s or more after it (`created` is when the head took the line's request, in seconds)
    assert max(row["response"]["body"]["created"] for row in answered.values()) < cancel_at + 2


def test_completion_window_ends_the_batch_expired(client, worker):
    source = upload(client, [chat_line(f"late-{i}", max_tokens=20) for i in range(30)])
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="2s")
    expired = wait_status(client, batch.id, {"expired", "completed"})
    assert expired.status == "expired" and expired.request_counts.completed < 30
    late = entries(client, expired.error_file_id)
    assert {row["error"]["code"] for row in late.values()} == {"batch_expired"}
    assert len(late) + len(entries(client, expired.output_file_id)) == 30


def test_a_worker_killed_mid_batch_is_resumed_and_every_line_answered_once(head, client):
    first = Worker(head)
    try:
        source = upload(client, [chat_line(f"k-{i}", max_tokens=10) for i in range(24)])
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4, 120, first.log())
    finally:
        first.kill(signal.SIGKILL)
    assert client.batches.retrieve(batch.id).request_counts.completed < 24
    second = Worker(head, beat=True)  # beat's batch_resume finds the dead runner's batch and runs it again
    try:
        done = wait_status(client, batch.id, {"completed"}, timeout=180)
    finally:
        second.kill()
    assert (done.request_counts.completed, done.request_counts.failed) == (24, 0)
    rows = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(row["custom_id"] for row in rows) == sorted(f"k-{i}" for i in range(24))


def test_two_workers_share_the_batches_and_answer_every_line_once(head, client, worker):
    """A second worker process on the same broker: both take batches (one runner a batch at a time), and every line
    of every batch is answered exactly once."""
    second = Worker(head)
    try:
        wait_for(lambda: " ready." in second.log(), 60, f"the second worker did not start: {second.log()}")
        batches = []
        for b in range(3):
            source = upload(client, [chat_line(f"b{b}-{i}", max_tokens=20) for i in range(10)])
            batches.append(client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h"))
        done = [wait_status(client, batch.id, {"completed", "failed"}, timeout=180) for batch in batches]
    finally:
        second.kill()
    for b, batch in enumerate(done):
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 10, 0)
        rows = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(row["custom_id"] for row in rows) == sorted(f"b{b}-{i}" for i in range(10))
    assert "api.tasks.batch_run[" in second.log()  # the second worker ran a slice of one (not only its banner)
