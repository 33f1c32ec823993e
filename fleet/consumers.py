"""The live fleet page's socket at /ws/fleet/: a staff session's browser gets a snapshot of the fleet on connect and
again after every change (see fleet.live), with no reload.

Refused sockets are closed with 4401 (no session) or 4403 (not staff, or from another site's page) after an
error frame that says why (daphne drops close reasons). Frames out: `fleet` snapshots with a `seq`, and `error`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from api.consumers import CLOSE_UNAUTHORIZED, same_origin
from fleet.live import PUSH_EVERY_S, WAITING_STALE_S
from fleet.names import fleet_page_group
from fleet.selectors import fleet_live

CLOSE_FORBIDDEN = 4403


def _refusal(scope: dict) -> tuple[int, str] | None:
    user = scope.get("user")
    if user is None or not user.is_authenticated:
        return CLOSE_UNAUTHORIZED, "log in to the admin first: the fleet page needs a staff session"
    if not (user.is_active and user.is_staff):
        return CLOSE_FORBIDDEN, "only staff users may watch the fleet"
    if not same_origin(scope):
        return CLOSE_FORBIDDEN, "the fleet socket must come from this site's own pages (Origin)"
    return None


class FleetPageConsumer(AsyncJsonWebsocketConsumer):
    """One open fleet page. Changes only mark it dirty; one task renders and sends at most every PUSH_EVERY_S."""

    async def connect(self) -> None:
        self.seq = 0
        # head process -> (waiting per model, per priority class and per key, when)
        self.waiting: dict[str, tuple[dict[str, int], dict[str, dict[str, int]], float]] = {}
        self.dirty = asyncio.Event()
        self.pusher: asyncio.Task | None = None
        await self.accept()
        if refusal := _refusal(self.scope):
            code, reason = refusal
            await self.send_json({"type": "error", "seq": 0, "code": "unauthorized", "message": reason})
            await self.close(code=code, reason=reason)
            return
        await self.channel_layer.group_add(fleet_page_group(), self.channel_name)
        self.dirty.set()
        self.pusher = asyncio.ensure_future(self._push())

    async def fleet_changed(self, event: dict) -> None:
        self.waiting[event["process"]] = (event["waiting"], event.get("classes") or {}, time.monotonic())
        self.dirty.set()

    def _waiting(self) -> dict[str, int]:
        now, total = time.monotonic(), {}
        for counts, _, at in self.waiting.values():
            if now - at < WAITING_STALE_S:
                for model, n in counts.items():
                    total[model] = total.get(model, 0) + n
        return total

    def _classes(self) -> dict[str, dict[str, int]]:
        now, total = time.monotonic(), {"priority": {}, "key": {}}
        for _, classes, at in self.waiting.values():
            if now - at < WAITING_STALE_S:
                for kind, counts in classes.items():
                    bucket = total.setdefault(kind, {})
                    for name, n in counts.items():
                        bucket[name] = bucket.get(name, 0) + n
        return total

    async def _push(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            snapshot = await database_sync_to_async(fleet_live)(waiting=self._waiting(), classes=self._classes())
            self.seq += 1
            await self.send_json({"type": "fleet", "seq": self.seq, **snapshot})
            await asyncio.sleep(PUSH_EVERY_S)

    async def receive_json(self, content, **kwargs) -> None:
        """The page sends nothing; anything it does send is ignored."""

    async def disconnect(self, code: int) -> None:
        if self.pusher is not None:
            self.pusher.cancel()
            with suppress(asyncio.CancelledError):
                await self.pusher
            await self.channel_layer.group_discard(fleet_page_group(), self.channel_name)
