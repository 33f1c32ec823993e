"""Shared fixtures. `live_head` and `live_node` are real processes: daphne and `manage.py node_join`."""

from __future__ import annotations

import pytest

from tests.live import Head, NodeProc, make_head, start_node


@pytest.fixture(scope="session")
def live_head(tmp_path_factory) -> Head:
    """One real head for the session (daphne on a free port, its own FLEET_HOME and database)."""
    head = make_head(tmp_path_factory.mktemp("live"))
    head.start()
    yield head
    head.stop()


@pytest.fixture
def fresh_head(tmp_path) -> Head:
    """A real head of this test's own (daphne on a free port), stopped after it."""
    head = make_head(tmp_path)
    head.start()
    yield head
    head.stop()


@pytest.fixture(scope="session")
def live_node(live_head) -> NodeProc:
    """A real node on the bundled SmolLM2 model, joined to `live_head` over loopback (no token needed)."""
    node = start_node(live_head, "--max-batch", "4", identity="node-a")
    live_head.wait_nodes(1, timeout=180)
    yield node
    node.stop()


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each in-process test starts with an empty link registry and placement state."""
    from django.conf import settings

    if not settings.configured:  # plain (Django-free) runs of the link and engine tests
        yield
        return
    from channels.layers import channel_layers

    from fleet.links import registry, registry_reset

    # In-process tests never share placement keys with a live head or a real fleet on the same Redis.
    settings.FLEET_REDIS_PREFIX = "fleet-pytest:"
    # Nor a channel layer: each test runs on an event loop of its own, and channels-redis keeps asyncio locks per
    # layer; one left held by a receive an earlier test's loop never finished is "bound to a different event loop".
    channel_layers.backends.clear()
    registry_reset()
    _clear_placement(registry())
    yield
    _clear_placement(registry())
    registry_reset()
    from sessions.writer import writers_close

    writers_close()  # their connections would outlive the test's database (PostgreSQL cannot drop it then)


def _clear_placement(reg) -> None:
    clear = getattr(reg.placement, "clear", None)
    if clear is not None:
        clear()
