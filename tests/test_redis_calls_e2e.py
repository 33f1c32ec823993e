"""What a stream costs Redis with two head processes: the same small number of calls whatever its length.

Two real heads share Redis; a mock node links both. Redis' MONITOR counts every call the heads make under their
prefix (tests/redis_monitor.py: a MULTI block is one call, a Lua script is one call) while a stream of 20 tokens
and then one of 400 run through either head. What a stream costs is all of it but the calls made on timers,
whatever the traffic: the nodes' heartbeats and the heads' beats, and the writers that carry many streams' counts
together once a second (metrics, the quota tally), the fleet page's push, the revocation stamp's read, and the
read of the fleet's slots every few seconds.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import redis

from tests.live import two_heads, wait_for
from tests.mock_node import start_mock_node
from tests.redis_monitor import Monitor

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="several head processes share state through Redis"),
]

# Calls on timers, whatever the traffic: a node's heartbeat (each link's) and a head's beat; the writers that send
# what a process gathered once a second (metrics, the quota tally), the fleet page's push (once a second), the
# revocation stamp's read (twice), the fleet's slots read again (every 5 s), the channel layer's receive loop (its
# cleanup script and blocking pop, every 5 s) and the connections those open.
TIMED = ("evalsha node_beat", "evalsha head_beat", ":heartbeat", "api-keys:stamp", "multi[hincrbyfloat metrics",
         "multi[del metrics", "multi[expire quota, incrby quota]", "asgi:group:fleet.page", "bzpopmin asgi",
         "eval local backed_up", "hello",
         "evalsha nodes")
UNLIMITED = {"requests_per_minute": 0, "tokens_per_minute": 0, "tokens_per_day": 0, "concurrent_streams": 0}
MAKE_KEY = """
from django.contrib.auth import get_user_model
from api.services import api_key_create
owner = get_user_model().objects.get(username="admin")
print("API-KEY", api_key_create(owner=owner, name="unlimited", quotas={quotas!r})[1])
"""


@pytest.fixture
def fleet(tmp_path):
    with two_heads(tmp_path) as (first, second):
        node = start_mock_node(first, "calls-node", lanes=4, decode_tps=400)
        try:
            first.wait_nodes(1, timeout=120)
            second.wait_nodes(1, timeout=60)
            yield first, second
        finally:
            node.stop()


def stream(head, key: str, tokens: int) -> int:
    """Stream a chat of `tokens` tokens through `head` (SSE, read to its end); the tokens counted."""
    body = {"model": "smollm2", "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about bicycles."}]}
    got = 0
    with httpx.stream("POST", f"{head.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                got += 1
    return got


def stream_calls(monitor: Monitor, head, key: str, tokens: int) -> Counter[str]:
    """The calls one stream made, timed ones left out."""
    monitor.start()
    assert stream(head, key, tokens) > 0
    kinds = monitor.stop()
    return Counter({kind: n for kind, n in kinds.items() if not any(t in kind for t in TIMED)})


def test_a_400_token_stream_costs_redis_what_a_20_token_one_does_through_either_head(fleet):
    first, second = fleet
    unlimited = first.manage("shell", "--no-startup", "-c", MAKE_KEY.format(quotas=UNLIMITED)).stdout
    unlimited = next(line.split()[1] for line in unlimited.splitlines() if line.startswith("API-KEY "))
    client = redis.Redis.from_url(first.env["REDIS_URL"])
    monitor = Monitor(client, db=client.connection_pool.connection_kwargs.get("db", 0),
                      prefix=first.env["FLEET_REDIS_PREFIX"])
    for head in (first, second):  # each head's first stream reads what it then keeps (the key, the nodes)
        wait_for(lambda head=head: stream(head, first.api_key, 4) and stream(head, unlimited, 4), 60,
                 f"no stream through {head.url}")
    for head in (first, second):
        # a key with no limit: the placement's choose and finish, nothing else
        short, long = stream_calls(monitor, head, unlimited, 20), stream_calls(monitor, head, unlimited, 400)
        assert short == long == {"evalsha choose": 1, "evalsha finish": 1}, (head.url, short, long)
        # the default limits: the admission (one script) and the settlement (one MULTI) too
        short, long = stream_calls(monitor, head, first.api_key, 20), stream_calls(monitor, head, first.api_key, 400)
        assert short == long == {"evalsha choose": 1, "evalsha finish": 1, "evalsha quota_admit": 1,
                                 "multi[expire quota, incrby quota, zrem quota]": 1}, (head.url, short, long)
