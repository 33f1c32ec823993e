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
