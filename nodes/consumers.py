"""The head's end of the node link: a Channels consumer at /ws/node/, the link's transport.

Binary frames in (each spends the node's flood budget, then opens on the link's channel, or is a handshake frame)
and out (sealed in one order), refusals (a CloseCode, a `refusal` message where the node can read one, one log line
and a link event) and close. What the frames mean is the link session's (nodes.link_session: hello to serving, the
node's LinkHandle) and the frame router's (nodes.link_router: each message type to its handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from fleet import metrics
from fleet.dbsweep import FramesSkipSweep
from fleet.links import registry
from nodes import services
from nodes.link.channel import SecureChannel
from nodes.link.codes import REFUSALS, CloseCode
from nodes.link.handshake import TokenRefused
from nodes.link.messages import Bundle, LinkError, Message, Refusal, unbundle
from nodes.link_router import FrameRouter
from nodes.link_session import LinkSession
from nodes.models import LinkEvent
from nodes.services import JoinRefused

log = logging.getLogger("fleet")

MAX_BUDGETED_LANES = 1024  # lanes are the node's own claim: the frame rate they buy is bounded


class FrameBudget:
    """A token bucket over a node's frames: `rate` a second sustained, bursts up to twice that."""

    def __init__(self, rate: float) -> None:
        self.rate, self.capacity = rate, rate * 2
        self.tokens, self.at = self.capacity, time.monotonic()

    def take(self, count: int = 1) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < count:
            return False
        self.tokens -= count
        return True


class NodeLinkConsumer(FramesSkipSweep, AsyncWebsocketConsumer):
    """One connected node's transport; its session (`self.session`) is the node's fleet.links.LinkHandle."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # A head process shutting down (daphne on SIGTERM) cancels every connection with no disconnect event.
            # Run it now: this process's generations on the node end (placed again by the dispatcher) and the
            # node's link leaves placement; else the node stayed placeable from here until its TTL.
            # Not re-raised: daphne gathers the cancelled connections and exits when the first one raises, which
            # cut the other links' cleanup short.
            session = getattr(self, "session", None)
            if session is not None and session.busy():
                await self.disconnect(1001)

    async def connect(self) -> None:
        self.peer = (self.scope.get("client") or [None])[0]
        registry().heads.served_at(self.scope)
        self.channel_: SecureChannel | None = None
        self.budget = FrameBudget(settings.FLEET_LINK_MAX_FRAMES_PER_S)
        self.send_lock = asyncio.Lock()
        self.last_frame = time.monotonic()
        self.closing = False
        self.ended: asyncio.Task | None = None  # the session's end, run once (end(), or daphne's disconnect)
        self.session = LinkSession(self)
        self.router = FrameRouter(self.session)
        if not self.session.begin():
            metrics.link_refused(code=CloseCode.BUSY)
            # Accepted first: a socket closed before it is accepted is an HTTP 403 from daphne, with no close code
            await self.accept()
            await self.close(code=int(CloseCode.BUSY), reason="too many handshakes in progress, retry")
            return
        await self.accept()
        self.session.watch()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closing:
            return  # queued before the node saw our close frame: one refusal, one log line, per link
        self.last_frame = time.monotonic()
        if bytes_data is None:
            await self.refuse(CloseCode.PROTOCOL, "the node link carries binary frames only")
            return
        if not self.budget.take():
            await self.refuse(CloseCode.FLOOD, f"more than {self.budget.rate:.0f} frames a second")
            return
        try:
            if self.channel_ is not None:
                await self._on_message(self.channel_.open(bytes_data))
            elif (channel := await self.session.step(bytes_data)) is not None:
                self.channel_ = channel
                await self.session.opened()
        except JoinRefused as exc:
            await self.refuse(exc.code, exc.reason)
        except TokenRefused as exc:
            await self.refuse(CloseCode.TOKEN_REFUSED, str(exc))
        except LinkError as exc:
            await self.refuse(CloseCode.PROTOCOL, f"protocol error: {exc}")

    async def _on_message(self, msg: Message) -> None:
        if not isinstance(msg, Bundle):
            await self.router.route(msg)
            return
        # messages the node sent at once: each handled as if it had a frame of its own
        if not self.session.node_id:
            raise LinkError("bundle before the node registered")
        if not self.budget.take(max(len(msg.parts) - 1, 0)):  # each message counts as the frame it could have had
            await self.refuse(CloseCode.FLOOD, f"more than {self.budget.rate:.0f} frames a second "
                                               "(a bundle's messages count one each)")
            return
        for part, _ in unbundle(msg):
            await self.router.route(part)

    async def refuse(self, code: int, reason: str) -> None:
        if self.closing:
            return
        session = self.session
        log.warning("fleet refused node %s from %s: %s", session.identity or "(unregistered)", self.peer, reason)
        metrics.link_refused(code=code)
        session.handshake.over()
        if code in REFUSALS and self.channel_ is not None and not self.channel_.broken:
            with contextlib.suppress(LinkError):  # the reason in a message too: daphne sends no close reason
                await self.send_sealed(Refusal(code=int(code), reason=reason))
        await self.close(code=int(code), reason=reason[:120])
        await database_sync_to_async(services.link_event_record)(
            kind=LinkEvent.Kind.REFUSED, node_id=session.node_id or None, identity=session.identity,
            peer=self.peer or "", code=int(code), detail=reason)
        self._end_session(int(code))

    async def close(self, code: int | None = None, reason: str | None = None) -> None:
        self.closing = True
        await super().close(code=code, reason=reason)

    async def end(self, code: int) -> None:
        """Close the link and end its session now (a node that stopped heartbeating)."""
        await self.close(code=code)
        self._end_session(code)

    def _end_session(self, code: int) -> None:
        """The head closed this link: its session ends now, in a task of its own (not the watchdog's, which it
        stops), not when daphne says the socket closed. A node gone without a FIN never answers the close, and its
        link stayed in placement and /healthz as a zombie until TCP gave up."""
        if self.ended is None:
            self.ended = asyncio.ensure_future(self.session.lost(code))

    async def disconnect(self, code: int) -> None:
        if self.ended is None:
            self.ended = asyncio.ensure_future(self.session.lost(code))
        await asyncio.shield(self.ended)

    # --- what the session sends and asks through ---
    async def send_sealed(self, msg: Message) -> None:
        # The nonce counter lives in the cipher: sealing and sending must happen in one order.
        async with self.send_lock:
            await self.send(bytes_data=self.channel_.seal(msg))

    async def send_frame(self, frame: bytes) -> None:
        await self.send(bytes_data=frame)

    async def join(self, group: str) -> None:
        await self.channel_layer.group_add(group, self.channel_name)

    async def leave(self, group: str) -> None:
        await self.channel_layer.group_discard(group, self.channel_name)

    def quiet_s(self) -> float:
        """Seconds since the node's last frame."""
        return time.monotonic() - self.last_frame

    def budget_lanes(self, lanes: int) -> None:
        # A busy node's token batches grow with its lanes: a fixed rate cut a legitimate node (200 lanes at 40/s)
        self.budget = FrameBudget(max(settings.FLEET_LINK_MAX_FRAMES_PER_S,
                                      min(lanes, MAX_BUDGETED_LANES) * settings.FLEET_LINK_MAX_FRAMES_PER_LANE_S))

    # --- channel-layer events (control only: no generation crosses between head processes) ---
    async def link_close(self, event: dict) -> None:
        """The operator revoked this link's token or node key (in any head process): close it now."""
        await self.refuse(event["code"], event["reason"])

    async def node_deploy(self, event: dict) -> None:
        """A deployment changed, or another node now serves a model this one keeps for it: send the list again."""
        if not self.closing:
            await self.session.redeploy()

    async def node_hold(self, event: dict) -> None:
        await self.session.hold(event["schedulable"])
