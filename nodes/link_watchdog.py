"""A node link's watchdog: once a second it closes a link that stopped talking (no handshake in time, heartbeats
missed) or, on a head whose channel layer cannot carry another process's revocation, one whose token or node key was
revoked."""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError

from nodes import services
from nodes.handshakes import LinkHandshake
from nodes.link.codes import CloseCode
from nodes.link_transport import LinkedNode, LinkTransport

log = logging.getLogger("fleet")

REVOCATION_CHECK_S = 1


class LinkWatchdog:
    """One link's watchdog task, from the accept to the link's end."""

    def __init__(self, node: LinkedNode, handshake: LinkHandshake, link: LinkTransport) -> None:
        self.node, self.handshake, self.link = node, handshake, link
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _watch(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(1.0)
            ticks += 1
            if self.node.node_id and ticks % REVOCATION_CHECK_S == 0 and _layer_is_process_local(
                    self.link.channel_layer):
                # The in-memory layer cannot carry a revocation made in another process (`manage.py fleet_token
                # --revoke` on the embedded default), so such a head looks the link's token and key up itself.
                try:
                    refusal = await database_sync_to_async(services.link_refusal)(
                        token=self.handshake.token, public_key=self.handshake.node_key)
                except DatabaseError:  # the database away: the link goes on; the look-up is made again next tick
                    refusal = None
                if refusal is not None:
                    await self.link.refuse(refusal.code, refusal.reason)
                    return
            quiet = self.link.quiet_s()
            if self.handshake.late():  # each handshake stage has its own short deadline, frames or not
                await self.link.refuse(CloseCode.PROTOCOL, "no handshake in time")
                return
            if self.handshake.done and quiet > settings.FLEET_NODE_TIMEOUT_S:
                log.warning("fleet node %r missed its heartbeats for %.0f s", self.node.identity, quiet)
                await self.link.end(1001)
                return


def _layer_is_process_local(layer) -> bool:
    return type(layer).__name__ == "InMemoryChannelLayer"
