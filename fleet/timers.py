"""Shared timeouts for the many short waits of streaming.

Each stream waits for its node's next frame (with the link check's timeout) and, on SSE, for its next event (with
the keep-alive's). With hundreds of streams those waits come thousands of times a second, and each ended long before
its timeout: one timer apiece (a handle made, pushed on the loop's heap, cancelled and swept out again) was a large
part of the head's work per token batch. Here the waits whose deadlines fall in one slice of time share one timer,
which fails those still waiting when it fires. A timeout fires up to a slice late: 5% of it, at most 0.25 s, which
the waits this serves (seconds-long checks and keep-alives) do not notice.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Awaitable
from typing import Any

GRAIN_SHARE = 0.05  # a timeout fires at most this share of itself late
MAX_GRAIN_S = 0.25

_slices: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, set[asyncio.Future]]] = (
    weakref.WeakKeyDictionary())


async def wait_for_future(waiter: asyncio.Future, timeout: float | None) -> Any:
    """Await `waiter`; TimeoutError, set on the waiter, if it is not done within about `timeout` seconds."""
    if timeout is None:
        return await waiter
    if timeout <= 0:
        if waiter.done():
            return waiter.result()
        waiter.cancel()
        raise TimeoutError
    loop = asyncio.get_running_loop()
    grain = min(MAX_GRAIN_S, timeout * GRAIN_SHARE)
    when = math.ceil((loop.time() + timeout) / grain) * grain
    slices = _slices.setdefault(loop, {})
    waiting = slices.get(when)
    if waiting is None:
        waiting = slices[when] = set()
        loop.call_at(when, _expire, slices, when)
    waiting.add(waiter)
    try:
        return await waiter
    finally:
        waiting.discard(waiter)


def _expire(slices: dict[float, set[asyncio.Future]], when: float) -> None:
    for waiter in slices.pop(when, ()):
        if not waiter.done():
            waiter.set_exception(TimeoutError())


async def wait_done(task: Awaitable[Any], timeout: float | None) -> bool:
    """Whether `task` (a future or task) is done within about `timeout` seconds; it goes on either way (unlike
    asyncio.wait_for, the timeout does not cancel it)."""
    task = asyncio.ensure_future(task)
    if task.done():
        return True
    waiter = asyncio.get_running_loop().create_future()

    def wake(_: Any) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)  # left on the task after a timeout: a later wake finds its waiter done
    try:
        await wait_for_future(waiter, timeout)
    except TimeoutError:
        return False
    return True
