"""The live fleet page's push: one Channels group that every head process tells when the fleet changed.

Events (a node joined, left, was drained or cordoned, a heartbeat, a generation waiting, placed or ended) call
`fleet_changed()`. Each head process coalesces them into at most one group message every GROUP_EVERY_S, so hundreds
of streams starting and ending do not flood the channel layer (a group message costs two Redis calls even with no
page open, so a busy process makes them once a second, not per event); each page socket (fleet.consumers) coalesces
again and sends its browser one snapshot at most every PUSH_EVERY_S. The group is on the Redis layer when REDIS_URL is
set, so a node linked to one head process shows on a page served by another.

The message carries the sender's generations waiting for a lane, per model (and per priority class and API key):
they live in each process's
dispatcher, so a page sums what every process last announced. A process with waiting generations re-announces
them every ANNOUNCE_EVERY_S; a page forgets a process it has not heard from for WAITING_STALE_S.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from channels.layers import get_channel_layer

from fleet.links import registry
from fleet.names import fleet_page_group

log = logging.getLogger("fleet")

PUSH_EVERY_S = 0.25
GROUP_EVERY_S = 1.0
ANNOUNCE_EVERY_S = 5.0
WAITING_STALE_S = 15.0
PROCESS_ID = uuid.uuid4().hex[:12]


def changed_event() -> dict:
    waiting = registry().waiting
    return {"type": "fleet.changed", "process": PROCESS_ID, "waiting": waiting.by_model(),
            "classes": waiting.by_class()}


class _Pusher:
    """At most one group message every GROUP_EVERY_S from this process: the first event goes out at once, the
    ones that follow within the interval go out together at its end (so the last change is never lost)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.last = 0.0
        self.tasks: set[asyncio.Task] = set()

    def poke(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # a new event loop (tests): the old one's timer is gone with it
            self.loop, self.handle, self.last = loop, None, 0.0
        if self.handle is not None:
            return
        self.handle = loop.call_later(max(self.last + GROUP_EVERY_S - loop.time(), 0.0), self._fire)

    def _fire(self) -> None:
        self.handle = None
        self.last = self.loop.time()
        task = self.loop.create_task(self._send())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self) -> None:
        event = changed_event()
        try:
            await get_channel_layer().group_send(fleet_page_group(), event)
        except Exception:  # the page is a view; a layer hiccup must not reach the link or the generation
            log.warning("fleet page push failed", exc_info=True)
        if any(event["waiting"].values()) and self.loop is not None:
            self.loop.call_later(ANNOUNCE_EVERY_S, self.poke)


_pusher = _Pusher()


def fleet_changed() -> None:
    """Tell every open fleet page that the fleet changed. Cheap (a timer at most) in async code; from sync code
    with no event loop (a Celery task) it sends at once."""
    try:
        _pusher.poke()
    except RuntimeError:  # no running event loop in this thread
        from asgiref.sync import async_to_sync

        async_to_sync(get_channel_layer().group_send)(fleet_page_group(), changed_event())
