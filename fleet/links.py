"""This head process's live node links and waiting generations (the in-process relay).

A node's link consumer registers itself here; a generation placed on a node whose link lives in this
process sends its frames through the link directly and gets the node's frames back through a bounded
in-process queue: no channel layer, no ORM, no re-encoding on the hot path.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from django.conf import settings

from nodes.link.lifecycle import PlacementLifecycle
from nodes.link.placement import PlacementState

log = logging.getLogger("fleet")

RELAY_CAPACITY = 4096  # token batches; a generation whose client falls this far behind is cancelled


class LinkHandle(Protocol):
    node_id: str
    identity: str

    async def send_generate(self, gen_id: str, spec: dict[str, Any]) -> None: ...

    async def send_cancel(self, gen_id: str, reason: str) -> None: ...

    async def state_op(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]: ...


@dataclass
class NodeLost:
    """Pushed into a relay when the node's link dropped with the generation still running."""

    node_id: str
    reason: str


class Relay:
    """The bounded queue between a node link (producer) and one generation's client stream (consumer)."""

    def __init__(self, gen_id: str, node_id: str = ""):
        self.gen_id = gen_id
        self.node_id = node_id  # the node this attempt runs on: frames from another (an earlier attempt's) are dropped
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=RELAY_CAPACITY)
        self.overflowed = False

    def push(self, event: Any) -> None:
        # Never block the node link: a client this far behind loses its generation, not the node its lanes.
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True

    async def get(self, timeout: float | None) -> Any:
        return await asyncio.wait_for(self.queue.get(), timeout)


class LaneSignal:
    """Wakes generations waiting for a lane when one frees or a node joins."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()

    def notify(self) -> None:
        for fut in list(self._waiters):
            if not fut.done():
                fut.get_loop().call_soon_threadsafe(_set_if_pending, fut)

    async def wait(self, timeout: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)


def _set_if_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Registry:
    """Process-wide: links by node id, relays by generation id, the placement state and the lane signal."""

    def __init__(self) -> None:
        self.links: dict[str, LinkHandle] = {}
        self.relays: dict[str, Relay] = {}
        if settings.REDIS_URL:
            from fleet.placement_redis import RedisPlacementState

            self.placement = RedisPlacementState(settings.REDIS_URL, prefix=settings.FLEET_REDIS_PREFIX,
                                                 load_tokens=settings.FLEET_LOAD_TOKENS,
                                                 node_ttl_s=settings.FLEET_NODE_TIMEOUT_S * 3)
        else:
            self.placement = PlacementState(load_tokens=settings.FLEET_LOAD_TOKENS)
        self.lanes = LaneSignal()

    @property
    def lifecycle(self) -> PlacementLifecycle:
        """Every placement step goes through this (over whichever state this process uses, even one a test set)."""
        return PlacementLifecycle(self.placement)

    def relay_push(self, gen_id: str, event: Any, node_id: str = "") -> bool:
        relay = self.relays.get(gen_id)
        if relay is None or (node_id and relay.node_id and node_id != relay.node_id):
            return False
        relay.push(event)
        return True


_registry: Registry | None = None


def registry() -> Registry:
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry


def registry_reset() -> None:
    """Tests only: a fresh registry."""
    global _registry
    _registry = None
