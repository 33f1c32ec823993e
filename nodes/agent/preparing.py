"""What a node tells the heads while it pulls or loads its own model before it joins (`preparing` on the link), so
the live fleet page shows it on its way in rather than nothing until it registers."""

from __future__ import annotations

import asyncio
from typing import Any

FIRST_S = 1.0  # a load quicker than this says nothing
EVERY_S = 2.0  # each report is a handshake of its own: a few, not a stream
STOP_WAIT_S = 0.5  # stop() waits this long for the task to end, no longer


class PreparingReports:
    """The node's latest (model, state, progress), set from any thread (a pull's, the loop's), reported by one task
    every EVERY_S from FIRST_S on, until stop(): the node is about to register."""

    def __init__(self, asker: Any) -> None:
        self.asker = asker
        self.now: tuple[str, str, float] | None = None
        self.task: asyncio.Task | None = None
        self.stopped = False

    def set(self, model: str, state: str, progress: float = 0.0) -> None:
        self.now = (model, state, progress)  # one assignment: read whole by the reporting task

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._report())
        self.task.add_done_callback(lambda task: task.cancelled() or task.exception())  # best effort: no error kept

    async def _report(self) -> None:
        await asyncio.sleep(FIRST_S)
        while not self.stopped:
            if self.now is not None:
                await self.asker.report_preparing(*self.now)
            await asyncio.sleep(EVERY_S)

    async def stop(self) -> None:
        """Ends the reports without waiting on them: a cancel can be lost (Python 3.11's `asyncio.wait_for` returns
        the result of an await that finished as the cancel came, and a report's handshake awaits that way), so the
        task also ends by itself at its next turn, and the join never waits behind it."""
        self.stopped = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=STOP_WAIT_S)
