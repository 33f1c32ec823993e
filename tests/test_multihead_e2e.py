"""Two head processes sharing Redis (and the database) place consistently and relay across processes."""

import os

import pytest
from openai import OpenAI

from tests.live import make_head, make_peer_head, start_node, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="several head processes share state through Redis"),
]

SYSTEM = ("You are the support assistant of a bicycle shop. " * 40).strip()


@pytest.fixture
def heads(tmp_path):
    first = make_head(tmp_path)
    first.start()
    second = make_peer_head(first, tmp_path)
    second.start()
    yield first, second
    second.stop()
    first.stop()


def test_a_conversation_goes_back_to_its_node_whichever_head_takes_the_turn(heads):
    first, second = heads
    nodes = [start_node(first, "--max-batch", "2", identity="node-1"),
             start_node(second, "--max-batch", "2", identity="node-2")]
    try:
        first.wait_nodes(1, timeout=240)
        second.wait_nodes(1, timeout=240)
        for head in (first, second):  # each head keys prompts by the nodes' tokenizer once its file is in
            wait_for(lambda head=head: "sent tokenizer" in head.log(), 60, f"no tokenizer reached {head.url}")
        clients = [OpenAI(base_url=f"{h.url}/v1", api_key=first.api_key, max_retries=0, timeout=120)
                   for h in (first, second)]
        messages = [{"role": "system", "content": SYSTEM}]
        served = []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn + 1}: do you repair tyres?"})
            client = clients[turn % 2]  # alternate heads
            if turn == 3:  # the last turn streams, so tokens cross processes through the channel layer
                chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                                             temperature=0, stream=True))
                answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                served.append(chunks[0].system_fingerprint)
            else:
                reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                                       temperature=0)
                answer = reply.choices[0].message.content
                served.append(reply.system_fingerprint)
                if turn > 0:
                    assert reply.usage.prompt_tokens_details.cached_tokens > reply.usage.prompt_tokens // 2
            assert answer
            messages.append({"role": "assistant", "content": answer})
        assert len(set(served)) == 1, served
        # with its own node gone, the second head embeds on the first head's node, through the channel layer
        nodes[1].stop()
        local = clients[0].embeddings.create(model="smollm2", input=["a cat", "a stock market report"])
        remote = clients[1].embeddings.create(model="smollm2", input=["a cat", "a stock market report"])
        assert [d.embedding for d in remote.data] == [d.embedding for d in local.data]
        assert len(remote.data[0].embedding) > 8
    finally:
        for node in nodes:
            node.stop()
