"""This head process's live node links and waiting generations (the in-process relay).

A node's link session (nodes.link_session) registers itself here; a generation placed on a node whose link lives
in this process sends its frames through the link directly and gets the node's frames back through a bounded
in-process queue: no channel layer, no ORM, no re-encoding on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from django.conf import settings

from fleet.aliases import AliasTable
from fleet.heads import HeadBeat
from fleet.loading_state import LoadingState
from fleet.running import Running
from fleet.shutdown import Shutdown
from fleet.timers import wait_for_future
from fleet.waiting import ModelQueue, Waiter, WaitingRoom
from nodes.link.lifecycle import PlacementLifecycle, aio
from nodes.link.placement import PlacementState

T = TypeVar("T")
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
    """Generations waiting for a lane, per model in the order lanes go to them (fleet.waiting: priority classes,
    batch lines last; keys in turn within a class; deadline within a key), woken by events, never by polling: a
    lane freed or a node joined, in this process (`notify`) or in another head process (the Redis placement's lanes
    channel). Each wake reads a model's free lanes once and wakes that many of its first waiters (one at least: it
    may preempt a batch line), not all."""

    def __init__(self, free_lanes: Callable[[str], Awaitable[int]], listen: Callable | None = None,
                 fair: bool = True) -> None:
        self._free_lanes, self._listen, self._fair = free_lanes, listen, fair
        self._order: dict[str, ModelQueue] = {}  # model -> its waiters, in order
        self._events: dict[Waiter, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pass: asyncio.Task | None = None
        self._again = False
        self._listener: asyncio.Task | None = None

    def join(self, model: str, key: Waiter) -> None:
        self._loop = asyncio.get_running_loop()
        self._order.setdefault(model, ModelQueue(self._fair)).add(key)
        self._events[key] = asyncio.Event()
        if self._listen is not None and (self._listener is None or self._listener.done()):
            self._listener = asyncio.ensure_future(self._listen(self.notify))

    def leave(self, model: str, key: Waiter, *, placed: bool = False) -> None:
        """`placed`: it leaves with a lane (its key's turn is used); else unserved."""
        queue = self._order.get(model)
        if queue is not None:
            queue.remove(key, placed=placed)
            if not len(queue):
                del self._order[model]
        self._events.pop(key, None)

    def ahead(self, model: str, key: Waiter) -> int:
        """How many of the model's waiters go before `key` (a waiter of the model)."""
        return self._order[model].ahead(key)

    def above(self, model: str, rank: int) -> int:
        """How many of the model's waiters are of a class better than `rank` (fleet.waiting.RANKS)."""
        queue = self._order.get(model)
        return queue.above(rank) if queue is not None else 0

    async def wait(self, key: Waiter, timeout: float) -> None:
        """Until woken (at once if a wake came while this waiter was not asleep) or `timeout` s."""
        event = self._events[key]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        event.clear()

    def wake(self, key: Waiter) -> None:
        """Wake this one waiter now (a generation the head's drain ends while it waits)."""
        event = self._events.get(key)
        if event is not None:
            event.set()

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
                queue = self._order.get(model)
                for key in queue.first(max(free, 1)) if queue is not None else ():
                    event = self._events.get(key)
                    if event is not None:
                        event.set()


class Registry:
    """Process-wide: links by node id, relays by generation id, the placement state, the lane signal, the waiting
    room's counts, what on-demand loading remembers and the process's drain."""

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
                                listen=getattr(self.aplacement, "listen", None),
                                fair=settings.FLEET_WAITING_ORDER == "fair")
        self.waiting = WaitingRoom()  # who waits here for a lane, and how fast waiting ones took lanes
        self.loading = LoadingState()  # on-demand models: this process's placements and queue waits (fleet.loading)
        self.shutdown = Shutdown()  # draining on SIGTERM: no new work, the running generations seen to their end
        self.running = Running()  # the generations placed here and not over: counts, and lanes preemption may take
        self.heads = HeadBeat(lambda: self.placement)  # where this process is served, its beat, the live heads
        self.aliases = AliasTable()  # model aliases as every API resolves them, kept a few seconds
        self._owned: dict[str, Any] = {}  # what modules keep for the process (caches, stores): `own`
        self._owned_lock = threading.Lock()

    def own(self, name: str, make: Callable[[], T]) -> T:
        """A piece of process state a module keeps (a cache, a store), made by `make` on first use, once, and gone
        with this registry: the module holds no state of its own, and a test's fresh registry starts it anew."""
        with self._owned_lock:
            if name not in self._owned:
                self._owned[name] = make()
            return self._owned[name]

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
    """Tests only: a fresh registry (the old one's head beat stops; the new one's starts when asked for the heads)."""
    global _registry
    if _registry is not None:
        _registry.heads.stop()
    _registry = None
