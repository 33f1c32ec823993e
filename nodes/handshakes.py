"""The head's side of a node link's handshake (Noise XXpsk3: the fleet token's secret and both sides' static keys),
and the slots that bound the handshakes in progress.

A slot is held from the accept to the end of the handshake, and each stage has its own short deadline (the link
session's watchdog), so half-open links from one address, or from everywhere, cannot hold every slot for long.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from channels.db import database_sync_to_async
from django.conf import settings

from nodes import services
from nodes.link.channel import SecureChannel
from nodes.link.codes import CloseCode
from nodes.link.handshake import LOCAL_TOKEN_ID, Responder
from nodes.link.messages import LinkError
from nodes.models import FleetToken
from nodes.services import JoinRefused

log = logging.getLogger("fleet")

PROXY_HEADERS = {b"x-forwarded-for", b"forwarded", b"x-real-ip", b"x-forwarded-host"}


def is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _via_proxy(scope: dict) -> bool:
    """True when the peer relays someone else: it sent a forwarding header, or it is a configured proxy."""
    if any(name.lower() in PROXY_HEADERS for name, _ in scope.get("headers") or []):
        return True
    peer = (scope.get("client") or [None])[0]
    try:
        address = ipaddress.ip_address(peer)
    except (TypeError, ValueError):
        return False
    return any(address in ipaddress.ip_network(proxy, strict=False) for proxy in settings.FLEET_TRUSTED_PROXIES)


class HandshakeSlot:
    """One handshake's hold on the process's slots; given back once (the handshake ended, or the link did)."""

    def __init__(self, slots: HandshakeSlots, counted: str | None) -> None:
        self.slots, self.counted = slots, counted

    def release(self) -> None:
        if self.slots is not None:
            self.slots.give_back(self.counted)
            self.slots = None


class HandshakeSlots:
    """This head process's handshakes in progress: at most FLEET_MAX_HANDSHAKES, and FLEET_MAX_HANDSHAKES_PER_ADDRESS
    from one address (loopback not counted: the local node and tests)."""

    def __init__(self) -> None:
        self.in_progress = 0
        self.by_peer: Counter = Counter()

    def take(self, peer: str | None) -> HandshakeSlot | None:
        """A slot for a handshake from `peer`; None, logged, when none is free."""
        counted = None if is_loopback(peer) else peer
        if self.in_progress >= settings.FLEET_MAX_HANDSHAKES or (
                counted and self.by_peer[counted] >= settings.FLEET_MAX_HANDSHAKES_PER_ADDRESS):
            log.warning("fleet refused a node from %s: %d handshakes already in progress (%d from there)", peer,
                        self.in_progress, self.by_peer[counted] if counted else 0)
            return None
        self.in_progress += 1
        if counted:
            self.by_peer[counted] += 1
        return HandshakeSlot(self, counted)

    def give_back(self, counted: str | None) -> None:
        self.in_progress -= 1
        if counted:
            self.by_peer[counted] -= 1
            if self.by_peer[counted] <= 0:
                del self.by_peer[counted]


HANDSHAKES = HandshakeSlots()


class LinkHandshake:
    """One link's handshake, frame 1 to frame 3: its slot, the token the node named, the node's key once it proved
    the token's secret. `send_frame` puts a handshake frame on the link as it is."""

    def __init__(self, peer: str | None, scope: dict, send_frame: Callable[[bytes], Awaitable[None]]) -> None:
        self.peer, self.scope, self.send_frame = peer, scope, send_frame
        self.slot: HandshakeSlot | None = None
        self.responder: Responder | None = None
        self.token: FleetToken | None = None
        self.node_key = ""  # hex, once frame 3 proved it
        self.stage_at = time.monotonic()

    def begin(self) -> bool:
        """Take a slot; False when none is free (the link is refused as busy)."""
        self.slot = HANDSHAKES.take(self.peer)
        self.stage_at = time.monotonic()
        return self.slot is not None

    def over(self) -> None:
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    @property
    def done(self) -> bool:
        return bool(self.node_key)

    def late(self) -> bool:
        """Not done within its stage's deadline (frames or not: a slot is held only that long)."""
        return not self.done and time.monotonic() - self.stage_at > settings.FLEET_HANDSHAKE_STAGE_S

    async def step(self, frame: bytes) -> SecureChannel | None:
        """The next handshake frame; the open channel once it is the last."""
        if self.responder is None:
            await self._hello(frame)
            return None
        return self._finish(frame)

    async def _hello(self, frame: bytes) -> None:
        """Frame 1: find the named token's secret, answer with frame 2 (the head's static key)."""
        if self.slot is None:
            raise LinkError("unexpected frame")
        static = await database_sync_to_async(services.head_static_key)()
        self.responder = Responder(static, max_frame=settings.FLEET_LINK_MAX_FRAME_BYTES)
        hello = self.responder.read_hello(frame)
        if hello.token_id == LOCAL_TOKEN_ID and (not is_loopback(self.peer) or _via_proxy(self.scope)):
            raise JoinRefused(CloseCode.TOKEN_REQUIRED, "the local node's token is taken only from this host, "
                                                        "never through a proxy")
        self.token, psk = await database_sync_to_async(services.fleet_token_for_join)(public_id=hello.token_id)
        await self.send_frame(self.responder.respond(psk))
        self.stage_at = time.monotonic()  # the node's frame 3 is due within a stage from now

    def _finish(self, frame: bytes) -> SecureChannel:
        """Frame 3: the node's static key and its proof of the token's secret; then the channel is open."""
        channel = self.responder.finish(frame)
        self.node_key = self.responder.node_key.hex()
        self.over()
        return channel
