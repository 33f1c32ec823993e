"""The head's drain (fleet/shutdown.py) on its own: what it waits for, what it ends, and when."""

import asyncio
import contextlib
import gc

from fleet.shutdown import Shutdown


class Generation:
    """A running generation as the drain sees it: ends by itself after `runs_s`, or when stopped."""

    def __init__(self, shutdown: Shutdown, runs_s: float, records_s: float = 0.0):
        self.shutdown, self.runs_s, self.records_s = shutdown, runs_s, records_s
        self.stopped_with = ""
        shutdown.track(self)
        self.task = asyncio.ensure_future(self._run())

    async def _run(self):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(self.runs_s)
        await asyncio.sleep(self.records_s)  # its record being written
        self.shutdown.untrack(self)

    async def stop(self, code: str, message: str) -> None:
        self.stopped_with = code
        self.task.cancel()


async def test_a_drain_waits_for_running_generations_within_the_grace():
    shutdown = Shutdown()
    quick = Generation(shutdown, runs_s=0.05)
    ended = await shutdown.drain(grace_s=5)
    assert ended == 0
    assert quick.stopped_with == ""
    assert shutdown.draining and shutdown.running == 0


async def test_what_outlives_the_grace_is_stopped_and_its_record_awaited():
    shutdown = Shutdown()
    quick, slow = Generation(shutdown, runs_s=0.05), Generation(shutdown, runs_s=60, records_s=0.1)
    ended = await shutdown.drain(grace_s=0.3)
    assert ended == 1
    assert (quick.stopped_with, slow.stopped_with) == ("", "head_shutting_down")
    assert shutdown.running == 0  # the stopped one's record was written before the drain returned


async def test_a_second_signal_cuts_the_grace_short():
    shutdown = Shutdown()
    slow = Generation(shutdown, runs_s=60)
    drain = asyncio.ensure_future(shutdown.drain(grace_s=60))
    await asyncio.sleep(0.05)
    shutdown.cut_short()
    assert await asyncio.wait_for(drain, 5) == 1
    assert slow.stopped_with == "head_shutting_down"


async def test_a_generation_dropped_without_its_end_is_not_waited_for():
    shutdown = Shutdown()

    class Dropped:
        async def stop(self, code, message):
            raise AssertionError("never running, never stopped")

    shutdown.track(Dropped())  # its server never started it, and let it go
    gc.collect()
    assert await asyncio.wait_for(shutdown.drain(grace_s=30), 5) == 0
