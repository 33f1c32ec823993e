"""A head process that is told to stop drains before it exits.

On SIGTERM (or SIGINT) the process stops taking new work (new requests and node links get a 503 with Retry-After,
so a load balancer or a client goes to another head), lets the generations running here finish for
FLEET_SHUTDOWN_GRACE_S, then ends the rest with their API's error event (never a cut connection), and waits for
every record to be written before the server stops. A second signal cuts the grace short: the running generations
are ended at once, their records still written.

The server is daphne on Twisted; nothing of either is changed. The process's SIGTERM and SIGINT handlers are set,
once the reactor runs, to one that drains first and then calls the handler Twisted had installed, which stops the
reactor as it always does (daphne then finds no application left to kill).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("fleet")

RECORDS_WAIT_S = 15.0  # after the grace: how long the ended generations' records may take to be written
RETRY_AFTER_S = 2


class Stoppable(Protocol):
    """A running generation as the drain sees it (api.generation.Run)."""

    async def stop(self, code: str, message: str) -> None: ...


class Shutdown:
    """This process's drain: whether it takes new work, and the generations it must see to their end."""

    def __init__(self) -> None:
        self.draining = False
        self.since = 0.0
        # weak: a generation dropped without its end (never started by its server) is not waited for
        self._running: weakref.WeakSet[Stoppable] = weakref.WeakSet()
        self._idle: asyncio.Event | None = None
        self._cut_short: asyncio.Event | None = None

    def track(self, generation: Stoppable) -> None:
        self._running.add(generation)

    def untrack(self, generation: Stoppable) -> None:
        """Its record is written: the drain no longer waits for it."""
        self._running.discard(generation)
        if not self._running and self._idle is not None:
            self._idle.set()

    @property
    def running(self) -> int:
        return len(self._running)

    def generations(self) -> list[Stoppable]:
        """The generations running in this process now."""
        return list(self._running)

    def begin(self) -> None:
        if not self.draining:
            self.draining, self.since = True, time.time()

    def cut_short(self) -> None:
        """A second signal: end the running generations now."""
        if self._cut_short is not None:
            self._cut_short.set()

    async def drain(self, grace_s: float, records_wait_s: float = RECORDS_WAIT_S) -> int:
        """No new work from now; wait up to `grace_s` for the running generations, end the rest with an error
        event, and wait for every record. Returns how many generations were ended by the drain."""
        self.begin()
        self._idle, self._cut_short = asyncio.Event(), asyncio.Event()
        if self._running:
            log.warning("fleet head: stopping; %d generation(s) running get %.0f s to finish (new requests get 503)",
                        len(self._running), grace_s)
            await _first(self._idle.wait(), self._cut_short.wait(), timeout=grace_s)
        ended = list(self._running)
        for generation in ended:
            await generation.stop("head_shutting_down", "This head is shutting down and ended the generation before "
                                  "it finished; retry it (another head takes it).")
        if self._running:
            await _first(self._idle.wait(), timeout=records_wait_s)
        if self._running:
            log.error("fleet head: %d generation record(s) were not written before the head stopped",
                      len(self._running))
        elif ended:
            log.warning("fleet head: %d generation(s) ended by the shutdown, each recorded", len(ended))
        return len(ended)


async def _first(*waits: Any, timeout: float) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def install_drain_on_signals(shutdown: Callable[[], Shutdown], grace_s: float) -> None:
    """Under daphne: once the reactor runs (it has set its own handlers by then), SIGTERM and SIGINT drain
    `shutdown()` (the process's Shutdown, read when the signal comes) first.

    Elsewhere (a test importing the ASGI app, another server) nothing is changed: the reactor is only used where
    daphne installed it already."""
    reactor = sys.modules.get("twisted.internet.reactor")
    if reactor is None:
        return
    reactor.callWhenRunning(_install, shutdown, grace_s)


def _install(shutdown: Callable[[], Shutdown], grace_s: float) -> None:
    loop = asyncio.get_event_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if not callable(previous):  # the reactor installed none (daphne run without its signal handlers)
            continue
        signal.signal(signum, _handler(loop, shutdown, grace_s, previous))


def _handler(loop: asyncio.AbstractEventLoop, current: Callable[[], Shutdown], grace_s: float, previous: Any):
    def on_signal(signum: int, frame: Any) -> None:
        shutdown = current()
        if shutdown.draining:
            loop.call_soon_threadsafe(shutdown.cut_short)
            return
        shutdown.begin()
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_drain_then_stop(shutdown, grace_s, previous,
                                                                                 signum)))

    return on_signal


async def _drain_then_stop(shutdown: Shutdown, grace_s: float, previous: Any, signum: int) -> None:
    try:
        await shutdown.drain(grace_s)
    except Exception:
        log.exception("fleet head: the drain failed; stopping")
    finally:
        previous(signum, None)  # the reactor's own handler: it stops as it would have without the drain
