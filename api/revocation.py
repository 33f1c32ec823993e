"""A key that stops (revoked, deleted, its owner deactivated) ends its running generations within a second.

Every change that can stop a key writes a new revocation stamp (api.services), which every head process reads at
most every STAMP_READ_S. While a process runs generations for keys it watches that stamp; when it changes, the
keys of the generations running here are checked against the database once, and each generation of a key no longer
active ends with its API's error event (`key_revoked`, an authentication error; a 401 before its headers went out),
its lane freed and its record written as failed. A request of a stopped key was refused already (api.auth).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import sync_to_async

from api.services import STAMP_READ_S, api_keys_active, key_stamp

log = logging.getLogger("api")

MESSAGE = "The API key of this request was revoked, deleted or deactivated; the generation was ended."


class KeyWatch:
    """The watch of one process: a task while generations for keys run here, none otherwise."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None

    def start(self, running: Any) -> None:
        """`running`: the process's running generations (fleet.shutdown.Shutdown), each with its `request`."""
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(self._watch(running))

    async def _watch(self, running: Any) -> None:
        seen = await key_stamp()
        while keyed := _keyed(running):
            await asyncio.sleep(STAMP_READ_S)
            stamp = await key_stamp()
            if stamp == seen:
                continue
            seen = stamp
            try:
                await self.end_stopped(_keyed(running) or keyed)
            except Exception:  # the database away: look again at the next stamp, or the next change
                log.warning("api: could not check the running generations' keys", exc_info=True)
                seen = None

    @staticmethod
    async def end_stopped(runs: list[Any]) -> int:
        """End the runs whose key is no longer active; how many were ended."""
        active = await sync_to_async(api_keys_active)(pks={run.request.api_key.pk for run in runs})
        ended = [run for run in runs if run.request.api_key.pk not in active and not run.over]
        for run in ended:
            log.warning("api: generation %s ended: its key %s stopped", run.request.gen_id, run.request.api_key.prefix)
            await run.stop("key_revoked", MESSAGE, status=401, retry_after=None, kind="authentication_error")
        return len(ended)


def _keyed(running: Any) -> list[Any]:
    return [run for run in running.generations()
            if getattr(run, "request", None) is not None and run.request.api_key is not None and not run.over]


_watch = KeyWatch()


def watch(running: Any) -> None:
    """Watch the stamp while generations for keys run in this process (started once; it ends when none is left)."""
    _watch.start(running)
