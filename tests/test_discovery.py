"""mDNS: the head announces `_fleet._tcp` with its models, and a node with no address finds it."""

from fleet.discovery import Announcer
from nodes.agent.discovery import find_head
from tests.live import free_port


def test_a_node_finds_the_announced_head():
    port = free_port()
    announcer = Announcer(port)
    announcer.start(["smollm2"])
    try:
        found = find_head(timeout=8)
    finally:
        announcer.stop()
    assert found is not None and found.endswith(f":{port}")


def test_no_head_announced_finds_nothing_quickly():
    assert find_head(timeout=1.5) is None


def test_a_node_given_no_address_joins_a_daphne_head_found_by_mdns(tmp_path):
    """A production head (daphne, not `manage.py up`) with FLEET_ANNOUNCE set is found by a node with no address."""
    import pytest

    from tests.live import make_head, start_node, wait_for

    port = free_port()
    head = make_head(tmp_path, port=port, extra_env={"FLEET_MDNS": "1", "FLEET_ANNOUNCE": f"127.0.0.1:{port}"})
    head.start()
    node = None
    try:
        node = start_node(head, "--max-batch", "1", identity="found-by-mdns", discover=True)
        head.wait_nodes(1, timeout=180)
        wait_for(lambda: "joined" in node.log(), 30, "no join line")  # logged once Registered arrives
        assert head.address.split(":")[1] in node.log()
    except AssertionError:
        pytest.fail(f"the node did not find the head by mDNS: {node.log() if node else ''}\nhead: {head.log()}")
    finally:
        if node is not None:
            node.stop()
        head.stop()
