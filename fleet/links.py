"""This head process's live node links and waiting generations (the in-process relay).

A node's link consumer registers itself here; a generation placed on a node whose link lives in this
process sends its frames through the link directly and gets the node's frames back through a bounded
in-process queue: no channel layer, no ORM, no re-encoding on the hot path.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from django.conf import settings

from fleet.timers import wait_for_future
from nodes.link.lifecycle import PlacementLifecycle, aio
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
    """The bounded queue between a node link (producer) and one generation's client stream (consumer): a deque and
    at most one waiter, woken by the push that ends its wait."""

    def __init__(self, gen_id: str, node_id: str = ""):
        self.gen_id = gen_id
        self.node_id = node_id  # the node this attempt runs on: frames from another (an earlier attempt's) are dropped
        self.frames: deque[Any] = deque()
        self.overflowed = False
        self._waiter: asyncio.Future | None = None

    def push(self, event: Any) -> None:
        # Never block the node link: a client this far behind loses its generation, not the node its lanes.
        if len(self.frames) >= RELAY_CAPACITY:
            self.overflowed = True
            return
        self.frames.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def head(self) -> Any:
        """The next frame when it is here already (it stays queued), else None."""
        return self.frames[0] if self.frames else None

    async def get(self, timeout: float | None) -> Any:
        """The next frame; TimeoutError after about `timeout` s without one (fleet.timers: a timer shared with the
        other streams' waits). A frame already here costs no timer."""
        while not self.frames:
            self._waiter = asyncio.get_running_loop().create_future()
            await wait_for_future(self._waiter, timeout)
        return self.frames.popleft()


class LaneSignal:
    """Generations waiting for a lane, per model in the order lanes go to them (batch lines after interactive ones,
    then by deadline), woken by events, never by polling: a lane freed or a node joined, in this process
    (`notify`) or in another head process (the Redis placement's lanes channel). Each wake reads a model's free
    lanes once and wakes that many of its first waiters (one at least: it may preempt a batch line), not all."""

    def __init__(self, free_lanes: Callable[[str], Awaitable[int]], listen: Callable | None = None) -> None:
        self._free_lanes, self._listen = free_lanes, listen
        self._order: dict[str, list[tuple]] = {}  # model -> waiters' keys, sorted
        self._events: dict[tuple, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pass: asyncio.Task | None = None
        self._again = False
        self._listener: asyncio.Task | None = None

    def join(self, model: str, key: tuple) -> None:
        self._loop = asyncio.get_running_loop()
        bisect.insort(self._order.setdefault(model, []), key)
        self._events[key] = asyncio.Event()
        if self._listen is not None and (self._listener is None or self._listener.done()):
            self._listener = asyncio.ensure_future(self._listen(self.notify))

    def leave(self, model: str, key: tuple) -> None:
        keys = self._order.get(model, [])
        at = bisect.bisect_left(keys, key)
        if at < len(keys) and keys[at] == key:
            del keys[at]
        if not keys:
            self._order.pop(model, None)
        self._events.pop(key, None)

    def ahead(self, model: str, key: tuple) -> int:
        """How many of the model's waiters go before `key`."""
        return bisect.bisect_left(self._order.get(model, []), key)

    async def wait(self, key: tuple, timeout: float) -> None:
        """Until woken (at once if a wake came while this waiter was not asleep) or `timeout` s."""
        event = self._events[key]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        event.clear()

    def notify(self) -> None:
        """A lane may be free: wake the waiters it could go to. Callable from any thread."""
        loop = self._loop
        if loop is None or not self._order:
            return
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self._schedule()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._schedule)

    def _schedule(self) -> None:
        if self._pass is not None and not self._pass.done():
            self._again = True  # one more pass once this one ends: what it read may be stale already
        elif self._order:
            self._pass = asyncio.ensure_future(self._wake())

    async def _wake(self) -> None:
        self._again = True
        while self._again:
            self._again = False
            for model in list(self._order):
                free = await self._free_lanes(model)
                for key in self._order.get(model, [])[:max(free, 1)]:
                    event = self._events.get(key)
                    if event is not None:
                        event.set()


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
        self.lanes = LaneSignal(lambda model: self.aplacement.free_lanes(model),
                                listen=getattr(self.aplacement, "listen", None))

    @property
    def aplacement(self) -> Any:
        """The placement state's operations as coroutines (redis.asyncio over Redis): what async code calls."""
        return aio(self.placement)

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
