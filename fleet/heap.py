"""The head process's garbage collector: what the head loads before it serves is frozen out of full collections.

Python's full collection (generation 2) stops the event loop while it scans every object the collector tracks. In
a head serving 500 streams (`bench/scale.py`) one ran every 2-3 s and scanned about 280,000 objects, over half of
them Django, the apps and the modules loaded at startup, for 150-200 ms in which no stream got its next token: the
largest part of the added chunk gap p99. What is loaded before the head serves lives as long as the process, so
scanning it never frees anything; frozen (`gc.freeze`), it is left out of every collection, and the full
collections in the same run scanned about 140,000 objects in 60-90 ms.

Frozen objects are still freed when their last reference goes; only a reference cycle among them would never be
collected, and the collection just before the freeze clears the cycles startup left behind. `FLEET_GC_FREEZE=0`
turns it off.

`held_disconnect` keeps each HTTP request's objects out of the collector's hands altogether (below).
"""

from __future__ import annotations

import asyncio
import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left (when FLEET_GC_FREEZE is on); how many objects are frozen now."""
    from django.conf import settings

    if settings.FLEET_GC_FREEZE:
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()


def held_disconnect(app):
    """ASGI wrapper for Django's HTTP app: once the response's last body has gone, the `http.disconnect` that daphne
    sends at once is held back from Django, not handed to it.

    Django's handler listens for the disconnect in a task of its own while it finishes the request (its
    `response.close` hop comes after the last body). Handed the disconnect then, that task failed with
    RequestAborted, and the handler, catching it, kept the exception in its own frame through the task: a cycle
    that made the whole request (its request, session, messages, response and headers, about 250 objects) garbage
    that only a full collection frees. Held back, the task is cancelled as the handler ends, and the request is
    freed as soon as it is done. A disconnect before the last body still reaches Django and stops a stream.
    """

    async def held(scope, receive, send):
        sent = False

        async def send_noting_the_end(message):
            nonlocal sent
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                sent = True

        async def receive_until_sent():
            message = await receive()
            if sent and message["type"] == "http.disconnect":
                await asyncio.Future()  # until the handler, done, cancels its listener
            return message

        await app(scope, receive_until_sent, send_noting_the_end)

    return held
