"""Shared timeouts (fleet.timers): waits whose deadlines fall in one slice share one timer and end by it."""

from __future__ import annotations

import asyncio

import pytest

from fleet.timers import _slices, wait_done, wait_for_future


async def test_waits_ending_in_one_slice_share_one_timer_and_each_times_out(monkeypatch):
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    lateness: list[float] = []  # each timer's deadline past the 0.2 s asked, from when it was set
    call_at = loop.call_at

    def counting(when, *args, **kwargs):
        timers.append(when)
        lateness.append(when - (loop.time() + 0.2))
        return call_at(when, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting)
    waiters = [loop.create_future() for _ in range(50)]
    started = loop.time()
    results = await asyncio.gather(*(wait_for_future(w, 0.2) for w in waiters), return_exceptions=True)
    waited = loop.time() - started
    assert all(isinstance(r, TimeoutError) for r in results)
    assert len(set(timers)) <= 2  # the 50 deadlines fall in one slice of 10 ms, or straddle two
    assert max(lateness) <= 0.2 * 0.05  # a short timeout is late by a short slice (a busy machine aside)
    assert 0.2 <= waited < 1.0  # not early; late by a slice, and by however busy the loop is


async def test_a_wait_ends_when_its_future_does_leaving_nothing_in_its_slice(monkeypatch):
    loop = asyncio.get_running_loop()
    deadlines: list[float] = []
    call_at = loop.call_at
    monkeypatch.setattr(loop, "call_at", lambda when, *args, **kw: deadlines.append(when) or call_at(when, *args, **kw))
    waiter = loop.create_future()
    loop.call_later(0.05, waiter.set_result, "frame")
    asked = loop.time() + 30
    assert await wait_for_future(waiter, 30) == "frame"
    assert 0 <= deadlines[-1] - asked <= 0.25 + 0.01  # a long timeout is at most a quarter second late
    assert not any(_slices[loop].values())  # its slice keeps no done waiter until it expires


async def test_a_cancelled_wait_is_a_cancel_not_a_timeout():
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(wait_for_future(loop.create_future(), 0.05))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)  # its slice expires with nobody left in it


async def test_wait_done_leaves_the_task_running_past_its_timeout():
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(asyncio.sleep(0.1, "late"))
    assert await wait_done(task, 0.02) is False and not task.done()
    assert await wait_done(task, 5) is True and task.result() == "late"
    assert await wait_done(loop.create_future(), 0) is False
