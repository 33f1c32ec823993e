"""Two head processes sharing Redis (and the database): every node links both, each head serves over its own links,
placement stays fleet-wide, and a SIGKILLed head costs only its own streams."""

import os
import signal
import threading
import uuid

import httpx
import pytest
from openai import OpenAI

from tests.live import start_node, two_heads, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="several head processes share state through Redis"),
]

SYSTEM = ("You are the support assistant of a bicycle shop. " * 40).strip()


@pytest.fixture
def heads(tmp_path):
    with two_heads(tmp_path) as pair:
        yield pair


def _stream(client, messages, max_tokens, started=None, ids=None, **extra):
    """(text, finish reason, completion tokens) of one streamed chat, read to its end; `started` is set at its first
    token, and `ids` gets its generation's id."""
    chunks = []
    for chunk in client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                **extra):
        chunks.append(chunk)
        if ids is not None and not ids:
            ids.append(chunk.id.removeprefix("chatcmpl-"))
        if started is not None and chunk.choices and chunk.choices[0].delta.content:
            started.set()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    return text, finish, chunks[-1].usage.completion_tokens


def test_every_node_links_every_head_and_a_killed_head_costs_only_its_own_streams(heads):
    first, second = heads
    # both nodes are given the first head only: they learn the second from it and dial it too
    nodes = [start_node(first, "--max-batch", "2", identity="node-1"),
             start_node(first, "--max-batch", "2", identity="node-2")]
    try:
        first.wait_nodes(2, timeout=240)
        second.wait_nodes(2, timeout=60)
        for head in (first, second):  # each head keys prompts by the nodes' tokenizer once its file is in
            wait_for(lambda head=head: "sent tokenizer" in head.log(), 60, f"no tokenizer reached {head.url}")
        clients = [OpenAI(base_url=f"{h.url}/v1", api_key=first.api_key, max_retries=0, timeout=120)
                   for h in (first, second)]
        messages = [{"role": "system", "content": SYSTEM}]
        served = []
        for turn in range(3):  # one prefix index: the conversation goes back to its node whichever head takes it
            messages.append({"role": "user", "content": f"Question {turn + 1}: do you repair tyres?"})
            reply = clients[turn % 2].chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                                              temperature=0)
            served.append(reply.system_fingerprint)
            if turn > 0:
                assert reply.usage.prompt_tokens_details.cached_tokens > reply.usage.prompt_tokens // 2
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert len(set(served)) == 1, served
        # each head embeds over its own link
        embedded = [c.embeddings.create(model="smollm2", input=["a cat"]).data[0].embedding for c in clients]
        assert embedded[0] == embedded[1] and len(embedded[0]) > 8

        # SIGKILL the second head while both heads stream: the first head's stream loses nothing
        ask = [{"role": "user", "content": "Count from one to forty in words, separated by commas."}]
        expected = _stream(clients[0], ask, 40)
        got, lost, cut = {}, {}, []
        started = {"first": threading.Event(), "second": threading.Event()}

        def run(name, client):
            try:
                if name == "first":
                    got[name] = _stream(client, ask, 40, started[name])
                else:  # long enough to be cut
                    got[name] = _stream(client, ask, 1500, started[name], cut, extra_body={"ignore_eos": True})
            except Exception as exc:  # the killed head's own stream may break: that is its cost
                lost[name] = exc

        threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("first", clients[0]),
                                                                          ("second", clients[1]))]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in started.values()), lost
        second.stop(signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        assert "first" not in lost, lost
        assert got["first"] == expected  # no error, no lost or repeated token
        assert clients[0].chat.completions.create(model="smollm2", messages=ask, max_tokens=4).choices[0]
        # the stream the killed head cut still has its record, written by the head its node told
        assert "second" in lost and cut, got.get("second")
        record = wait_for(lambda: _record(first, cut[0]), 60, "no record of the killed head's stream")
        assert record["status"] == "failed" and record["error"].startswith("head_lost: head process")
        assert record["completion_tokens"] > 0
        # the killed head comes back: the nodes link to it again within the redial backoff
        second.start()
        second.wait_nodes(2, timeout=90)
        assert clients[1].chat.completions.create(model="smollm2", messages=ask, max_tokens=4).choices[0]
    finally:
        for node in nodes:
            node.stop()


def _record(head, gen_id: str) -> dict | None:
    response = httpx.get(f"{head.url}/api/generations/{uuid.UUID(gen_id)}/",
                         headers={"Authorization": f"Bearer {head.api_key}"}, timeout=10)
    return response.json() if response.status_code == 200 else None
