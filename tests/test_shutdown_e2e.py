"""A head told to stop (SIGTERM) drains, with real processes: new requests get a 503 with Retry-After, running
streams finish within the grace or end with an error event, and every generation has its record."""

import signal
import threading
import uuid

import httpx
import openai
import pytest
from openai import OpenAI

from tests.live import make_head, start_node, wait_for

pytestmark = pytest.mark.slow

LONG = dict(model="smollm2", temperature=0, stream=True,
            messages=[{"role": "user", "content": "Count from one to one hundred, in words, one per line."}],
            extra_body={"ignore_eos": True})


def head_with_node(tmp_path, grace_s: int):
    head = make_head(tmp_path, extra_env={"FLEET_SHUTDOWN_GRACE_S": str(grace_s)})
    head.start()
    node = start_node(head, "--max-batch", "2")
    head.wait_nodes(1)
    return head, node


class Streamed:
    """One chat streamed in a thread: its chunks as they come, and how it ended."""

    def __init__(self, client: OpenAI, max_tokens: int):
        self.client, self.max_tokens = client, max_tokens
        self.text, self.chunks, self.finish, self.error, self.gen_id = "", 0, None, None, ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for chunk in self.client.chat.completions.create(max_tokens=self.max_tokens, **LONG):
                self.gen_id = chunk.id.removeprefix("chatcmpl-")
                if chunk.choices:
                    self.chunks += 1
                    self.text += chunk.choices[0].delta.content or ""
                    self.finish = chunk.choices[0].finish_reason or self.finish
        except openai.APIError as exc:
            self.error = exc


def records(head, *gen_ids: str) -> list[dict]:
    """The generations' records, read from a head process started again on the same database."""
    head.start()
    found = []
    for gen_id in gen_ids:
        response = httpx.get(f"{head.url}/api/generations/{uuid.UUID(gen_id)}/",
                             headers={"Authorization": f"Bearer {head.api_key}"}, timeout=10)
        assert response.status_code == 200, response.text
        found.append(response.json())
    return found


def test_a_stopped_head_lets_running_streams_finish_and_refuses_new_requests(tmp_path):
    head, node = head_with_node(tmp_path, grace_s=120)
    client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0)
    try:
        streams = [Streamed(client, max_tokens=120) for _ in range(2)]
        wait_for(lambda: all(s.chunks >= 3 for s in streams), 120, "the streams did not start")
        head.proc.send_signal(signal.SIGTERM)
        refused = wait_for(lambda: _refused(head), 30, "the draining head still took new requests")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "head_shutting_down"
        for stream in streams:
            stream.thread.join(120)
        assert [(s.error, s.finish) for s in streams] == [(None, "length"), (None, "length")]
        head.proc.wait(60)  # it exits by itself once they are done
        written = records(head, *(s.gen_id for s in streams))
        assert [(r["status"], r["completion_tokens"]) for r in written] == [("done", 120), ("done", 120)]
    finally:
        node.stop()
        head.stop()


def test_streams_past_the_grace_end_with_an_error_event_and_are_recorded(tmp_path):
    head, node = head_with_node(tmp_path, grace_s=1)
    client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0)
    try:
        stream = Streamed(client, max_tokens=2000)
        wait_for(lambda: stream.chunks >= 3, 120, "the stream did not start")
        head.proc.send_signal(signal.SIGTERM)
        stream.thread.join(60)
        assert not stream.thread.is_alive()
        assert isinstance(stream.error, openai.APIError), stream.error  # an error event, not a cut connection
        assert "shutting down" in stream.error.message
        assert not isinstance(stream.error, openai.APIConnectionError)
        head.proc.wait(60)
        [record] = records(head, stream.gen_id)
        assert record["status"] == "failed"
        assert "shutting down" in record["error"]
        assert 0 < record["completion_tokens"] < 2000
        assert record["completion_tokens"] >= stream.chunks
    finally:
        node.stop()
        head.stop()


def _refused(head):
    try:
        response = httpx.post(f"{head.url}/v1/chat/completions", timeout=5,
                              headers={"Authorization": f"Bearer {head.api_key}"},
                              json={"model": "smollm2", "max_tokens": 1,
                                    "messages": [{"role": "user", "content": str(uuid.uuid4())}]})
    except httpx.HTTPError:
        return None
    return response if response.status_code == 503 else None


def test_a_stream_whose_head_was_killed_is_recorded_by_the_head_that_came_back(tmp_path):
    """SIGKILL gives a head no chance to write anything: the node ends the lane, and on its next link (the head
    started again) it reports the generation cut, which that head records as failed with the tokens made."""
    head, node = head_with_node(tmp_path, grace_s=30)
    client = OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0)
    try:
        stream = Streamed(client, max_tokens=2000)
        wait_for(lambda: stream.chunks >= 3, 120, "the stream did not start")
        head.proc.send_signal(signal.SIGKILL)
        head.proc.wait(30)
        stream.thread.join(30)
        assert not stream.thread.is_alive()  # its connection was cut: nothing was left to say more
        head.start()
        record = wait_for(lambda: _record(head, stream.gen_id), 60, "no record of the killed head's stream")
        assert record["status"] == "failed"
        assert record["error"].startswith("head_lost: head process")
        assert record["completion_tokens"] >= stream.chunks
        assert record["prompt_tokens"] > 0 and record["node"]
    finally:
        node.stop()
        head.stop()


def _record(head, gen_id: str) -> dict | None:
    response = httpx.get(f"{head.url}/api/generations/{uuid.UUID(gen_id)}/",
                         headers={"Authorization": f"Bearer {head.api_key}"}, timeout=10)
    return response.json() if response.status_code == 200 else None
