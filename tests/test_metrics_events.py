"""What the head's own events count, in process: a generation that fails over through the dispatcher (fake node
links), and a node link that is refused or dropped (the real link consumer)."""

import pytest

from fleet import metric_store, metrics
from nodes.link.codes import CloseCode
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.test_metrics import fresh_store  # noqa: F401 - a store of each test's own
from tests.test_node_consumer import (  # noqa: F401 - the autouse fixtures apply here too
    _disconnect_all,
    _local_token,
    closed_with,
    communicator,
    joined,
)

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)


def counted(family: metrics.Family, *labels: str) -> float:
    store = metric_store.store()
    store.flush()
    return store.totals([family.name])[family.name].get(metrics.field_name(labels), 0.0)


async def test_a_failover_counts_both_placements_and_the_generation_where_it_ended(bearer, fresh_store):  # noqa: F811
    add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "lost-node",
                           Script(error=("node_lost", "the link dropped"))))
    add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "steady-node"))
    ex = await request("POST", "/v1/chat/completions", key=bearer,
                       body={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    assert ex.status == 200 and ex.headers["x-fleet-node"] == "steady-node"
    assert counted(metrics.FAILOVERS, "smollm2", "lost-node", "node_lost") == 1
    assert counted(metrics.PLACEMENTS, "smollm2", "lost-node", "load") == 1  # two idle nodes, no prefix held
    assert counted(metrics.PLACEMENTS, "smollm2", "steady-node", "only_candidate") == 1  # the lost one excluded
    assert counted(metrics.GENERATIONS, "smollm2", "steady-node", "done", "") == 1
    assert counted(metrics.PROMPT_TOKENS, "smollm2", "steady-node") == 11  # what the fake node reports
    assert counted(metrics.CACHED_TOKENS, "smollm2", "steady-node") == 3
    assert counted(metrics.COMPLETION_TOKENS, "smollm2", "steady-node") == 4


async def test_a_failed_generation_counts_its_error_code(bearer, fresh_store):  # noqa: F811
    add_fake_node(FakeLink(script=Script(error=("engine_crashed", "llama.cpp aborted"))))
    ex = await request("POST", "/v1/chat/completions", key=bearer,
                       body={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    assert ex.status == 502
    assert counted(metrics.GENERATIONS, "smollm2", "fake-node", "failed", "engine_crashed") == 1


async def test_a_refused_link_and_a_dropped_one_are_counted(fresh_store):  # noqa: F811
    comm = communicator()
    assert (await comm.connect())[0]
    await comm.send_to(text_data="hello")
    assert await closed_with(comm) == CloseCode.PROTOCOL
    assert counted(metrics.LINK_REFUSALS, "protocol") == 1

    node, _ = await joined()
    assert counted(metrics.LINK_DROPS, "gpu-7") == 0
    await node.disconnect()
    assert counted(metrics.LINK_DROPS, "gpu-7") == 1
