"""The head's end of the node link: a Channels consumer at /ws/node/.

Handshake (Noise, keyed by the fleet token), registration, heartbeats, and the generation frames that it
hands to this process's relays. The database is written only on transitions: join, rejoin, lost.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.core.cache import cache

from fleet.links import NodeLost, registry
from nodes import services
from nodes.link.channel import SecureChannel
from nodes.link.handshake import Responder
from nodes.link.messages import (
    Accepted,
    Bye,
    Cancel,
    Done,
    Error,
    Generate,
    Heartbeat,
    LinkError,
    Register,
    Registered,
    StateOp,
    StateResult,
    TokenBatch,
    encode,
)
from nodes.link.routing import NodeSlot
from nodes.models import FleetToken

log = logging.getLogger("fleet")

CLOSE_TOKEN_REFUSED = 4001
CLOSE_TOKEN_REQUIRED = 4002
CLOSE_PROTOCOL = 4003
CLOSE_BUSY = 4008
HANDSHAKE_TIMEOUT_S = 10
TOUCH_EVERY_S = 30

_handshakes_in_progress = 0


def node_group(node_id: str) -> str:
    """The channel-layer group a node's link listens on (holds, drains), whichever process holds it."""
    return f"fleet.node.{node_id}"


def liveness_key(node_id: str) -> str:
    return f"fleet:node:{node_id}:heartbeat"


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NodeLinkConsumer(AsyncWebsocketConsumer):
    """One connected node. Implements fleet.links.LinkHandle for the dispatcher."""

    async def connect(self) -> None:
        global _handshakes_in_progress
        self.peer = (self.scope.get("client") or [None])[0]
        self.node_id = ""
        self.identity = ""
        self.channel_: SecureChannel | None = None
        self.token: FleetToken | None = None
        self.running: set[str] = set()
        self.remote: dict[str, str] = {}  # gen_id -> the head process channel its client waits on
        self.pending_ops: dict[str, asyncio.Future] = {}
        self.send_lock = asyncio.Lock()
        self.last_frame = time.monotonic()
        self.last_touch = 0.0
        self.in_handshake = False
        self.watchdog: asyncio.Task | None = None
        if _handshakes_in_progress >= settings.FLEET_MAX_HANDSHAKES:
            log.warning("fleet refused a node from %s: %d handshakes already in progress", self.peer,
                        _handshakes_in_progress)
            await self.close(code=CLOSE_BUSY, reason="too many handshakes in progress, retry")
            return
        _handshakes_in_progress += 1
        self.in_handshake = True
        await self.accept()
        self.watchdog = asyncio.ensure_future(self._watch())

    def _handshake_over(self) -> None:
        global _handshakes_in_progress
        if self.in_handshake:
            self.in_handshake = False
            _handshakes_in_progress -= 1

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        self.last_frame = time.monotonic()
        if bytes_data is None:
            await self._refuse(CLOSE_PROTOCOL, "the node link carries binary frames only")
            return
        try:
            if self.channel_ is None:
                await self._handshake(bytes_data)
            else:
                await self._on_message(self.channel_.open(bytes_data))
        except LinkError as exc:
            await self._refuse(CLOSE_PROTOCOL, f"protocol error: {exc}")

    async def _refuse(self, code: int, reason: str) -> None:
        log.warning("fleet refused node %s from %s: %s", self.identity or "(unregistered)", self.peer, reason)
        self._handshake_over()
        await self.close(code=code, reason=reason[:120])

    async def _handshake(self, frame: bytes) -> None:
        if not self.in_handshake:
            raise LinkError("unexpected frame")
        responder = Responder()
        hello = responder.read_hello(frame)
        psk = None
        if hello.token_id is None:
            if not (settings.FLEET_ALLOW_LOOPBACK_WITHOUT_TOKEN and _is_loopback(self.peer)):
                await self._refuse(CLOSE_TOKEN_REQUIRED, "a fleet token is required for nodes not on this host")
                return
        else:
            self.token, psk = await _token_and_secret(hello.token_id)
            if psk is None:
                await self._refuse(CLOSE_TOKEN_REFUSED, f"fleet token {hello.token_id!r} is unknown or revoked")
                return
        try:
            reply, self.channel_ = responder.respond(psk)
        except LinkError:
            await self._refuse(CLOSE_TOKEN_REFUSED, f"fleet token {hello.token_id!r}: wrong secret")
            return
        self._handshake_over()
        await self.send(bytes_data=reply)

    async def _on_message(self, msg: Any) -> None:
        if isinstance(msg, TokenBatch | Accepted):
            await self._relay(msg)
        elif isinstance(msg, Done | Error):
            self._generation_ended(msg.gen_id)
            await self._relay(msg, last=True)
        elif isinstance(msg, Heartbeat):
            await self._on_heartbeat(msg)
        elif isinstance(msg, StateResult):
            fut = self.pending_ops.pop(msg.op_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Register):
            await self._on_register(msg)
        elif isinstance(msg, Bye):
            await self.close(code=1000)
        else:
            raise LinkError(f"unexpected message {type(msg).__name__} from a node")

    async def _relay(self, msg: Any, *, last: bool = False) -> None:
        """To the generation's client: in this process directly, else over the channel layer (one per batch)."""
        reply_to = self.remote.pop(msg.gen_id, None) if last else self.remote.get(msg.gen_id)
        if reply_to is None:
            registry().relay_push(msg.gen_id, msg)
            return
        await self.channel_layer.send(reply_to, {"type": "relay.frame", "gen_id": msg.gen_id, "frame": encode(msg)})

    def _generation_ended(self, gen_id: str) -> None:
        if gen_id in self.running:
            self.running.discard(gen_id)
            reg = registry()
            reg.placement.release(self.node_id)
            reg.lanes.notify()

    async def _on_register(self, msg: Register) -> None:
        reg = await database_sync_to_async(services.node_register)(
            identity=msg.identity, address=self.peer or "", token=self.token,
            models=[m["name"] for m in msg.models], lanes=msg.lanes, context_window=msg.context_window,
            capabilities=msg.capabilities, engine=f"{msg.engine} {msg.engine_version}".strip(), version=msg.version,
            labels=msg.labels, replicas=msg.replicas,
        )
        node = reg.node
        self.node_id, self.identity = str(node.id), node.identity
        registry_ = registry()
        old = registry_.links.get(self.node_id)
        if old is not None and old is not self:
            await old.close(code=1000)  # a rejoin while the old link had not noticed it was gone
        registry_.links[self.node_id] = self
        registry_.placement.node_up(
            NodeSlot(self.node_id, node.identity, list(reg.model_names), msg.lanes, msg.context_window,
                     schedulable=node.schedulable),
            cache_cleared=msg.cache_cleared, channel=self.channel_name,
        )
        await self.channel_layer.group_add(node_group(self.node_id), self.channel_name)
        await self._send(Registered(node_id=self.node_id, model_names=reg.model_names,
                                    heartbeat_s=float(settings.FLEET_HEARTBEAT_S), warnings=reg.warnings))
        verb = "rejoined" if reg.rejoin else "joined"
        log.info("fleet node %r %s from %s: %s, context window %d tokens, %d lanes", node.identity, verb,
                 self.peer, ", ".join(reg.model_names) or "no model", msg.context_window, msg.lanes)
        for warning in reg.warnings:
            log.warning("fleet node %r: %s", node.identity, warning)
        registry_.lanes.notify()

    async def _on_heartbeat(self, msg: Heartbeat) -> None:
        if not self.node_id:
            raise LinkError("heartbeat before register")
        placement = registry().placement
        placement.node_alive(self.node_id)
        if msg.cache_cleared:
            placement.forget_node(self.node_id)
        stats = {"lanes_busy": msg.lanes_busy, "lanes": msg.lanes, "kv_used": msg.kv_used, "kv_total": msg.kv_total,
                 "tokens_per_s": msg.tokens_per_s, "replicas": msg.replicas, "at": time.time()}
        await database_sync_to_async(cache.set)(liveness_key(self.node_id), stats, settings.FLEET_NODE_TIMEOUT_S)
        now = time.monotonic()
        if now - self.last_touch > TOUCH_EVERY_S:
            self.last_touch = now
            await database_sync_to_async(services.node_touch)(node_id=self.node_id)

    async def _watch(self) -> None:
        """Close a link that stopped talking: no handshake in time, or heartbeats missed."""
        while True:
            await asyncio.sleep(1.0)
            quiet = time.monotonic() - self.last_frame
            if self.channel_ is None and quiet > HANDSHAKE_TIMEOUT_S:
                await self._refuse(CLOSE_PROTOCOL, "no handshake in time")
                return
            if self.channel_ is not None and quiet > settings.FLEET_NODE_TIMEOUT_S:
                log.warning("fleet node %r missed its heartbeats for %.0f s", self.identity, quiet)
                await self.close(code=1001)
                return

    async def disconnect(self, code: int) -> None:
        self._handshake_over()
        if self.watchdog is not None:
            self.watchdog.cancel()
        if not self.node_id:
            return
        reg = registry()
        if reg.links.get(self.node_id) is self:
            del reg.links[self.node_id]
            reg.placement.node_down(self.node_id)
            await database_sync_to_async(services.node_mark_offline)(node_id=self.node_id)
            log.warning("fleet node %r lost (link closed, code %s); %d generation(s) running there", self.identity,
                        code, len(self.running))
        for gen_id in list(self.running):
            reason = f"link closed (code {code})"
            reply_to = self.remote.pop(gen_id, None)
            if reply_to is None:
                reg.relay_push(gen_id, NodeLost(self.node_id, reason))
            else:
                await self.channel_layer.send(reply_to, {"type": "relay.lost", "gen_id": gen_id,
                                                         "node_id": self.node_id, "reason": reason})
        self.running.clear()
        for fut in self.pending_ops.values():
            if not fut.done():
                fut.set_exception(LinkError("the node link closed"))
        await self.channel_layer.group_discard(node_group(self.node_id), self.channel_name)
        reg.lanes.notify()

    # --- LinkHandle, used by fleet.dispatch ---
    async def _send(self, msg: Any) -> None:
        # The nonce counter lives in the cipher: sealing and sending must happen in one order.
        async with self.send_lock:
            await self.send(bytes_data=self.channel_.seal(msg))

    async def send_generate(self, gen_id: str, spec: dict[str, Any]) -> None:
        self.running.add(gen_id)
        try:
            await self._send(Generate(gen_id=gen_id, spec=spec))
        except Exception:
            self._generation_ended(gen_id)
            raise

    async def send_cancel(self, gen_id: str, reason: str) -> None:
        if gen_id in self.running:
            await self._send(Cancel(gen_id=gen_id, reason=reason))

    async def state_op(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        op_id = f"{op}-{time.monotonic_ns()}"
        fut = asyncio.get_running_loop().create_future()
        self.pending_ops[op_id] = fut
        await self._send(StateOp(op_id=op_id, op=op, args=args))
        try:
            result: StateResult = await asyncio.wait_for(fut, timeout)
        finally:
            self.pending_ops.pop(op_id, None)
        if not result.ok:
            raise LinkError(result.error or f"{op} failed on node {self.identity!r}")
        return result.result

    # --- channel-layer events ---
    async def link_generate(self, event: dict) -> None:
        """A generation placed on this node by another head process."""
        self.remote[event["gen_id"]] = event["reply_to"]
        try:
            await self.send_generate(event["gen_id"], event["spec"])
        except Exception as exc:
            self.remote.pop(event["gen_id"], None)
            await self.channel_layer.send(event["reply_to"], {"type": "relay.lost", "gen_id": event["gen_id"],
                                                              "node_id": self.node_id, "reason": str(exc)})

    async def link_cancel(self, event: dict) -> None:
        await self.send_cancel(event["gen_id"], event.get("reason", "cancelled"))

    async def node_hold(self, event: dict) -> None:
        registry().placement.set_schedulable(self.node_id, event["schedulable"])
        registry().lanes.notify()


@database_sync_to_async
def _token_and_secret(public_id: str) -> tuple[FleetToken | None, bytes | None]:
    token = FleetToken.objects.filter(public_id=public_id, revoked_at__isnull=True).first()
    if token is None:
        return None, None
    return token, services.fleet_token_secret(public_id=public_id)
