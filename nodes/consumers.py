"""The head's end of the node link: a Channels consumer at /ws/node/.

Handshake (Noise XXpsk3: the fleet token's secret and both sides' static keys), registration (the identity must be
bound to the node's key), heartbeats, and the generation frames that it hands to this process's relays. The
database is written only on transitions: join, rejoin, lost. Every refusal closes the link with a CloseCode and
logs one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections import Counter, deque
from typing import Any

from cachetools import TTLCache
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError
from redis.exceptions import RedisError

from fleet import heads, metrics
from fleet.dbsweep import FramesSkipSweep
from fleet.links import NodeLost, registry
from fleet.live import fleet_changed
from fleet.names import liveness_key, node_group, token_group
from nodes import link_deploy, preparing, services, tokenizers
from nodes import registry as model_registry
from nodes.link.channel import SecureChannel
from nodes.link.codes import REFUSALS, CloseCode
from nodes.link.device import DeviceReport
from nodes.link.handshake import LOCAL_TOKEN_ID, Responder, TokenRefused
from nodes.link.messages import (
    Accepted,
    Bundle,
    Bye,
    Cancel,
    Check,
    Cut,
    Done,
    Error,
    Feature,
    Generate,
    Heads,
    Heartbeat,
    LinkClosed,
    LinkError,
    Models,
    ModelState,
    Preparing,
    Pull,
    Refusal,
    Register,
    Registered,
    StateOp,
    StateResult,
    TokenBatch,
    TokenizerFile,
    unbundle,
)
from nodes.link.placement import NodeSlot
from nodes.models import FleetToken, LinkEvent, Node
from nodes.services import JoinRefused
from sessions import cuts

log = logging.getLogger("fleet")

REVOCATION_CHECK_S = 1
TOUCH_EVERY_S = 30
NODE_DOWN_RETRY_FIRST_S, NODE_DOWN_RETRY_MAX_S = 1.0, 30.0
REDIS_AWAY = (RedisError, OSError)  # Redis unreachable: placement and the channel layer raise these
MAX_BUDGETED_LANES = 1024  # lanes are the node's own claim: the frame rate they buy is bounded
TOKENS_HISTORY_S = 600  # the fleet page's tokens/s chart: this much of each node's heartbeats, kept with them
PROXY_HEADERS = {b"x-forwarded-for", b"forwarded", b"x-real-ip", b"x-forwarded-host"}

_handshakes_in_progress = 0
_handshakes_by_peer: Counter = Counter()  # handshakes in progress by address (loopback not counted)


def _is_loopback(host: str | None) -> bool:
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


def _layer_is_process_local(layer) -> bool:
    return type(layer).__name__ == "InMemoryChannelLayer"


def _text_problem(name: str, text: str) -> str | None:
    if (not text and name == "identity") or "\x00" in text or len(text) > Node._meta.get_field(name).max_length:
        return f"{name} {text[:40]!r} is empty, too long or holds a NUL character"
    return None


def _json_problem(**values: Any) -> str | None:
    """Why node-sent values cannot be stored as JSON (msgpack also carries bytes, NaN, extension types, depth)."""
    try:
        stored = json.dumps(values, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return f"{', '.join(values)} must be plain JSON (no bytes, NaN, infinity or extension types, little nesting)"
    return f"{', '.join(values)} must hold no NUL character" if "\\u0000" in stored else None


def _files(models: list[dict[str, Any]]) -> dict[str, str]:
    """The models' file fingerprints a register names (64 hex digits each; anything else is left out)."""
    return {m["name"]: m["file"] for m in models if isinstance(m.get("file"), str) and len(m["file"]) == 64
            and all(c in "0123456789abcdef" for c in m["file"])}


def _register_problem(msg: Register) -> str | None:
    """What makes a Register unstorable beyond the outer field types that messages.decode checked; None if nothing."""
    engine = f"{msg.engine} {msg.engine_version}".strip()
    for problem in (_text_problem("identity", msg.identity), _text_problem("engine", engine),
                    _text_problem("version", msg.version)):
        if problem:
            return problem
    if not all(isinstance(m, dict) and isinstance(m.get("name"), str) and m["name"] for m in msg.models):
        return "every model must be a map with a non-empty string name"
    if not (0 <= msg.lanes < 2**31 and 0 <= msg.context_window < 2**31):
        return "lanes and context window must be from 0 to 2**31-1"
    if not all(isinstance(r, dict) for r in msg.replicas):
        return "every replica must be a map"
    if not all(isinstance(k, str) and tokenizers.valid_fingerprint(v) for k, v in msg.tokenizers.items()):
        return "tokenizers must map model names to tokenizer fingerprints (64 hex digits, or mock or bytes)"
    if not all(isinstance(g, str) and 0 < len(g) <= 64 for g in msg.warm) or len(msg.warm) > 64 * max(msg.lanes, 1):
        return "warm must list generation ids (at most 64 per lane)"
    return _json_problem(models=msg.models, capabilities=msg.capabilities, labels=msg.labels, replicas=msg.replicas,
                         device=msg.device)


async def _node_down(reg, node_id: str) -> bool:
    """Take a lost link's node out of this process's placement links; True while another head process still links
    it. With Redis away (an outage) that failed, and the rest of the link's cleanup with it: the node stayed
    placeable, generations went nowhere (node_stuck) until a restart. Now the rest goes on, and this is tried again,
    backing off, until Redis is back (unless the node rejoined meanwhile)."""
    try:
        return await reg.aplacement.node_down(node_id, heads.PROCESS_ID)
    except REDIS_AWAY as exc:
        log.warning("fleet node %s: placement cannot be told it is gone (%s); again once Redis is back", node_id, exc)
        asyncio.ensure_future(_node_down_later(reg, node_id))
        return False  # not known: the node is marked offline, as a lost link's node is


async def _node_down_later(reg, node_id: str) -> None:
    delay = NODE_DOWN_RETRY_FIRST_S
    while True:
        await asyncio.sleep(delay)
        if node_id in reg.links:
            return  # it rejoined: its new link put it back in placement
        try:
            await reg.aplacement.node_down(node_id, heads.PROCESS_ID)
        except REDIS_AWAY:
            delay = min(delay * 2, NODE_DOWN_RETRY_MAX_S)
            continue
        log.info("fleet node %s: taken out of placement now that Redis is back", node_id)
        return


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
    """One connected node. Implements fleet.links.LinkHandle for the dispatcher."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # A head process shutting down (daphne on SIGTERM) cancels every connection with no disconnect event.
            # Run it now: this process's generations on the node end (placed again by the dispatcher) and the
            # node's link leaves placement; else the node stayed placeable from here until its TTL.
            # Not re-raised: daphne gathers the cancelled connections and exits when the first one raises, which
            # cut the other links' cleanup short.
            if getattr(self, "node_id", "") and (registry().links.get(self.node_id) is self or self.running):
                await self.disconnect(1001)

    async def connect(self) -> None:
        global _handshakes_in_progress
        self.peer = (self.scope.get("client") or [None])[0]
        heads.served_at(self.scope)
        self.node_id = ""
        self.identity = ""
        self.fleet_names: dict[str, str] = {}  # the node's own model names -> the names the head registered them as
        self.channel_: SecureChannel | None = None
        self.responder: Responder | None = None
        self.token: FleetToken | None = None
        self.node_key = ""
        self.running: set[str] = set()
        self.ended: TTLCache = TTLCache(maxsize=4096, ttl=60)  # generations that ended: stragglers are dropped
        self.budget = FrameBudget(settings.FLEET_LINK_MAX_FRAMES_PER_S)
        self.heads_sent: list[str] | None = None  # the live heads last told to a node that takes `heads`
        self.pending_ops: dict[str, asyncio.Future] = {}
        self.send_lock = asyncio.Lock()
        self.last_frame = time.monotonic()
        self.last_touch = 0.0
        self.held = False  # drained or cordoned by the operator
        self.engine_ready = True  # the node's engine worker is up (heartbeats say so)
        self.keep_alive: dict[str, int] = {}  # on-demand model -> its keep-alive (s), as the last `deploy` put it here
        self.tokenizers: dict[str, str] = {}  # the names it serves under -> their tokenizers' fingerprints
        self.tokenizers_due: dict[str, list[bytes]] = {}  # fingerprints asked for at register -> the parts so far
        self.tokens_history: deque = deque(maxlen=TOKENS_HISTORY_S // max(settings.FLEET_HEARTBEAT_S, 1) + 1)
        self.in_handshake = False
        self.counted_peer: str | None = None
        self.stage_at = time.monotonic()
        self.closing = False
        self.said_bye = False
        self.watchdog: asyncio.Task | None = None
        counted = None if _is_loopback(self.peer) else self.peer
        if _handshakes_in_progress >= settings.FLEET_MAX_HANDSHAKES or (
                counted and _handshakes_by_peer[counted] >= settings.FLEET_MAX_HANDSHAKES_PER_ADDRESS):
            log.warning("fleet refused a node from %s: %d handshakes already in progress (%d from there)", self.peer,
                        _handshakes_in_progress, _handshakes_by_peer[counted] if counted else 0)
            metrics.link_refused(code=CloseCode.BUSY)
            # Accepted first: a socket closed before it is accepted is an HTTP 403 from daphne, with no close code
            await self.accept()
            await self.close(code=int(CloseCode.BUSY), reason="too many handshakes in progress, retry")
            return
        _handshakes_in_progress += 1
        self.in_handshake, self.counted_peer, self.stage_at = True, counted, time.monotonic()
        if counted:
            _handshakes_by_peer[counted] += 1
        await self.accept()
        self.watchdog = asyncio.ensure_future(self._watch())

    def _handshake_over(self) -> None:
        global _handshakes_in_progress
        if self.in_handshake:
            self.in_handshake = False
            _handshakes_in_progress -= 1
            if self.counted_peer:
                _handshakes_by_peer[self.counted_peer] -= 1
                if _handshakes_by_peer[self.counted_peer] <= 0:
                    del _handshakes_by_peer[self.counted_peer]

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closing:
            return  # queued before the node saw our close frame: one refusal, one log line, per link
        self.last_frame = time.monotonic()
        if bytes_data is None:
            await self._refuse(CloseCode.PROTOCOL, "the node link carries binary frames only")
            return
        if not self.budget.take():
            await self._refuse(CloseCode.FLOOD, f"more than {self.budget.rate:.0f} frames a second")
            return
        try:
            if self.channel_ is not None:
                await self._on_message(*self.channel_.open_with_body(bytes_data))
            elif self.responder is None:
                await self._hello(bytes_data)
            else:
                await self._finish_handshake(bytes_data)
        except JoinRefused as exc:
            await self._refuse(exc.code, exc.reason)
        except TokenRefused as exc:
            await self._refuse(CloseCode.TOKEN_REFUSED, str(exc))
        except LinkError as exc:
            await self._refuse(CloseCode.PROTOCOL, f"protocol error: {exc}")

    async def _refuse(self, code: int, reason: str) -> None:
        if self.closing:
            return
        log.warning("fleet refused node %s from %s: %s", self.identity or "(unregistered)", self.peer, reason)
        metrics.link_refused(code=code)
        self._handshake_over()
        if code in REFUSALS and self.channel_ is not None and not self.channel_.broken:
            with contextlib.suppress(LinkError):  # the reason in a message too: daphne sends no close reason
                await self._send(Refusal(code=int(code), reason=reason))
        await self.close(code=int(code), reason=reason[:120])
        await database_sync_to_async(services.link_event_record)(
            kind=LinkEvent.Kind.REFUSED, node_id=self.node_id or None, identity=self.identity, peer=self.peer or "",
            code=int(code), detail=reason)

    async def close(self, code: int | None = None, reason: str | None = None) -> None:
        self.closing = True
        await super().close(code=code, reason=reason)

    async def _hello(self, frame: bytes) -> None:
        """Frame 1: find the named token's secret, answer with frame 2 (the head's static key)."""
        if not self.in_handshake:
            raise LinkError("unexpected frame")
        static = await database_sync_to_async(services.head_static_key)()
        self.responder = Responder(static, max_frame=settings.FLEET_LINK_MAX_FRAME_BYTES)
        hello = self.responder.read_hello(frame)
        if hello.token_id == LOCAL_TOKEN_ID and (not _is_loopback(self.peer) or _via_proxy(self.scope)):
            raise JoinRefused(CloseCode.TOKEN_REQUIRED, "the local node's token is taken only from this host, "
                                                        "never through a proxy")
        self.token, psk = await database_sync_to_async(services.fleet_token_for_join)(public_id=hello.token_id)
        await self.send(bytes_data=self.responder.respond(psk))
        self.stage_at = time.monotonic()  # the node's frame 3 is due within a stage from now

    async def _finish_handshake(self, frame: bytes) -> None:
        """Frame 3: the node's static key and its proof of the token's secret; then the channel is open."""
        self.channel_ = self.responder.finish(frame)
        self.node_key = self.responder.node_key.hex()
        self._handshake_over()
        if self.token is not None:
            await self.channel_layer.group_add(token_group(self.token.public_id), self.channel_name)

    async def _on_message(self, msg: Any, body: bytes = b"") -> None:
        if isinstance(msg, Bundle):  # messages the node sent at once: each handled as if it had a frame of its own
            if not self.node_id:
                raise LinkError("bundle before the node registered")
            if not self.budget.take(max(len(msg.parts) - 1, 0)):  # each message counts as the frame it could have had
                await self._refuse(CloseCode.FLOOD, f"more than {self.budget.rate:.0f} frames a second "
                                                    "(a bundle's messages count one each)")
                return
            for part, part_body in unbundle(msg):
                await self._on_message(part, part_body)
        elif isinstance(msg, TokenBatch | Accepted | Done | Error):
            if msg.gen_id not in self.running:
                if msg.gen_id in self.ended:
                    return  # a straggler after a cancel raced the node's own end of the generation
                raise LinkError(f"{type(msg).__name__} for generation {msg.gen_id[:40]!r}, which this node lacks")
            if isinstance(msg, Done | Error):
                await self._generation_ended(msg.gen_id)
            registry().relay_push(msg.gen_id, msg, node_id=self.node_id)
        elif isinstance(msg, Heartbeat):
            await self._on_heartbeat(msg)
        elif isinstance(msg, Models) and self.node_id:
            await link_deploy.on_models(self, msg)
            await self._models_tokenizers(msg)
        elif isinstance(msg, TokenizerFile) and msg.fingerprint in self.tokenizers_due:
            await self._on_tokenizer_file(msg)
        elif isinstance(msg, ModelState) and self.node_id:
            await link_deploy.on_model_state(self, msg)
        elif isinstance(msg, StateResult):
            fut = self.pending_ops.pop(msg.op_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Register) and not self.node_id:
            await self._on_register(msg)
        elif isinstance(msg, Check) and not self.node_id:
            if problem := _text_problem("identity", msg.identity):
                raise LinkError(f"check: {problem}")
            await database_sync_to_async(services.node_key_check)(identity=msg.identity, public_key=self.node_key)
            await self.close(code=int(CloseCode.NORMAL))
        elif isinstance(msg, Pull) and not self.node_id:
            await self._on_pull(msg)
        elif isinstance(msg, Preparing) and not self.node_id:
            await preparing.on_preparing(self, msg)
        elif isinstance(msg, Cut) and self.node_id:
            cuts.reported(node_id=self.node_id, node=self.identity, cut=msg)
        elif isinstance(msg, Bye):
            self.said_bye = True  # stopped on purpose: logged as left, not lost
            await self.close(code=1000)
        else:
            raise LinkError(f"unexpected message {type(msg).__name__} from a node")

    async def _on_pull(self, msg: Pull) -> None:
        """A node that may join asks where to pull a model from: answer with a grant (or why not), then close."""
        if problem := _text_problem("identity", msg.identity):
            raise LinkError(f"pull: {problem}")
        if not msg.model or len(msg.model) > 200 or "\x00" in msg.model:
            raise LinkError("pull: the model name is empty, too long or holds a NUL character")
        await database_sync_to_async(services.node_key_check)(identity=msg.identity, public_key=self.node_key)
        grant = await database_sync_to_async(model_registry.model_grant)(name=msg.model, identity=msg.identity)
        log.info("fleet node %r from %s asked to pull %r: %s", msg.identity, self.peer, msg.model,
                 grant.error or f"granted {grant.sha256[:12]}")
        await self._send(grant)
        await self.close(code=int(CloseCode.NORMAL))

    async def _generation_ended(self, gen_id: str) -> None:
        if gen_id in self.running:
            self.running.discard(gen_id)
            self.ended[gen_id] = True
            reg = registry()
            if gen_id not in reg.relays:  # its dispatcher is gone (else it frees the lane itself, with its record)
                await reg.lifecycle.aended(self.node_id, gen_id)
            reg.lanes.notify()
            fleet_changed()

    async def _on_tokenizer_file(self, msg: TokenizerFile) -> None:
        """A part of a tokenizer file the head asked for; the last one is checked and kept, and once every asked-for
        file is in, the node takes generations."""
        parts = self.tokenizers_due[msg.fingerprint]
        if msg.part != len(parts) or not 0 < msg.parts <= 64 or msg.part >= msg.parts:
            raise LinkError(f"tokenizer_file: part {msg.part} of {msg.parts} out of order")
        parts.append(msg.data)
        if len(parts) < msg.parts:
            return
        try:
            await asyncio.to_thread(tokenizers.tokenizer_receive, msg.fingerprint, b"".join(parts))
        except tokenizers.TokenizerRefused as exc:
            raise LinkError(f"tokenizer_file: {exc}") from None
        del self.tokenizers_due[msg.fingerprint]
        log.info("fleet node %r sent tokenizer %s", self.identity, msg.fingerprint[:12])
        if not self.tokenizers_due:
            await self._apply_schedulable()

    async def _models_tokenizers(self, msg: Models) -> None:
        """A node that loaded a deployed model: the registry's tokenizer keys its prompts (its file is the
        registry's own)."""
        names = [m["name"] for m in msg.models if isinstance(m, dict) and isinstance(m.get("name"), str)]
        added = [name for name in names if name not in self.tokenizers]
        if added:
            found = await database_sync_to_async(lambda: {n: tokenizers.registry_fingerprint(n) for n in added})()
            self.tokenizers.update({name: fp for name, fp in found.items() if fp})
            await registry().aplacement.node_tokenizers(self.node_id, dict(self.tokenizers))

    async def _on_register(self, msg: Register) -> None:
        if problem := _register_problem(msg):
            raise LinkError(f"register: {problem}")
        register = database_sync_to_async(services.node_register)
        fields = dict(
            identity=msg.identity, public_key=self.node_key, address=self.peer or "", token=self.token,
            models=[m["name"] for m in msg.models], lanes=msg.lanes, context_window=msg.context_window,
            capabilities=msg.capabilities, engine=f"{msg.engine} {msg.engine_version}".strip(), version=msg.version,
            labels=msg.labels, replicas=msg.replicas, tokenizers=msg.tokenizers, files=_files(msg.models),
            device=DeviceReport.from_wire(msg.device).to_wire() if msg.device else {},
        )
        try:
            reg = await register(**fields)
        except IntegrityError:  # two first joins under one new identity raced; the second now sees the first's row
            reg = await register(**fields)
        node = reg.node
        self.node_id, self.identity = str(node.id), node.identity
        # A busy node's token batches grow with its lanes: a fixed rate cut a legitimate node (200 lanes at 40/s)
        self.budget = FrameBudget(max(settings.FLEET_LINK_MAX_FRAMES_PER_S,
                                      min(msg.lanes, MAX_BUDGETED_LANES) * settings.FLEET_LINK_MAX_FRAMES_PER_LANE_S))
        self.fleet_names = dict(zip(fields["models"], reg.model_names, strict=False))
        registry_ = registry()
        old = registry_.links.get(self.node_id)
        if old is not None and old is not self:
            await old.close(code=1000)  # a rejoin while the old link had not noticed it was gone
        # Registered goes out before the node is placeable: a generation placed in between went out first, and the
        # node, waiting for Registered, dropped the link ("expected registered, got Generate") at every rejoin. Its
        # slot (what it serves and holds) is in placement before, unschedulable until Registered has gone.
        self.tokenizers = reg.tokenizers
        wanted = await asyncio.to_thread(lambda: sorted({fp for fp in reg.tokenizers.values()
                                                         if not tokenizers.tokenizer_known(fp)}))
        self.tokenizers_due = {fp: [] for fp in wanted}
        await registry_.aplacement.node_up(
            NodeSlot(self.node_id, node.identity, list(reg.model_names), msg.lanes, msg.context_window,
                     schedulable=False,
                     capabilities=sorted(k for k, v in (msg.capabilities or {}).items() if v is True),
                     tokenizers=dict(reg.tokenizers)),
            cache_cleared=msg.cache_cleared, head=heads.PROCESS_ID, warm=msg.warm,
        )
        if Feature.HEADS in msg.features:
            self.heads_sent = await asyncio.to_thread(heads.heads_live)
        await self._send(Registered(node_id=self.node_id, model_names=reg.model_names,
                                    heartbeat_s=float(settings.FLEET_HEARTBEAT_S), warnings=reg.warnings,
                                    tokenizers_wanted=wanted, features=[Feature.BUNDLE.value, Feature.CUT.value],
                                    head=heads.link_url(), heads=self.heads_sent or []))
        registry_.links[self.node_id] = self
        self.held, self.engine_ready = not node.schedulable, True
        await registry_.aplacement.set_schedulable(self.node_id, self._placeable())
        await self.channel_layer.group_add(node_group(self.node_id), self.channel_name)
        verb = "rejoined" if reg.rejoin else "joined"
        log.info("fleet node %r %s from %s: %s, context window %d tokens, %d lanes", node.identity, verb,
                 self.peer, ", ".join(reg.model_names) or "no model", msg.context_window, msg.lanes)
        for warning in reg.warnings:
            log.warning("fleet node %r: %s", node.identity, warning)
        registry_.lanes.notify()
        await preparing.node_preparing_forget(node.identity)
        fleet_changed()
        await link_deploy.forget_gone(self, reg.model_names)
        await link_deploy.send_deployments(self, joined=True)

    async def _on_heartbeat(self, msg: Heartbeat) -> None:
        if not self.node_id:
            raise LinkError("heartbeat before register")
        if not all(isinstance(r, dict) for r in msg.replicas) or _json_problem(replicas=msg.replicas):
            raise LinkError("heartbeat: every replica must be a map of plain JSON")
        if not all(isinstance(f, dict) for f in msg.models.values()) or _json_problem(models=msg.models):
            raise LinkError("heartbeat: each model's figures must be a map of plain JSON")
        placement = registry().aplacement
        if msg.cache_cleared:
            await placement.forget_node(self.node_id)
        # schedulable is set on every heartbeat: it also undoes a head that stopped placing here on an
        # engine_unavailable answer. Alive, measured and schedulable: one round trip over Redis.
        changed, self.engine_ready = msg.engine_ready != self.engine_ready, msg.engine_ready
        await placement.node_beat(self.node_id, prefill_tps=msg.prefill_tps, decode_slowdown_ms=msg.decode_slowdown_ms,
                                  schedulable=self._placeable())
        if changed:
            registry().lanes.notify()
        now_s = time.time()
        self.tokens_history.append((round(now_s, 1), round(msg.tokens_per_s, 1)))
        stats = {"lanes_busy": msg.lanes_busy, "lanes": msg.lanes, "kv_used": msg.kv_used, "kv_total": msg.kv_total,
                 "tokens_per_s": msg.tokens_per_s, "replicas": msg.replicas, "at": now_s,
                 "prefill_tps": msg.prefill_tps, "decode_slowdown_ms": msg.decode_slowdown_ms,
                 "history": list(self.tokens_history), "models": link_deploy.fleet_figures(self, msg.models)}
        stats.update(memory_free=msg.memory_free, on_demand=msg.on_demand)  # room for on-demand models
        if msg.device:  # its GPUs' memory now (an older node sends none: the registered report stands)
            stats["device"] = DeviceReport.from_wire(msg.device).to_wire()
        await database_sync_to_async(cache.set)(liveness_key(self.node_id), stats, settings.FLEET_NODE_TIMEOUT_S)
        await link_deploy.check_idle(self, stats["models"])
        fleet_changed()
        if self.heads_sent is not None and (live := heads.heads_live()) != self.heads_sent:
            self.heads_sent = live
            await self._send(Heads(heads=live))  # a head process started or died: the node dials the new ones
        now = time.monotonic()
        if now - self.last_touch > TOUCH_EVERY_S:
            self.last_touch = now
            await database_sync_to_async(services.node_touch)(node_id=self.node_id)

    async def _watch(self) -> None:
        """Close a link that stopped talking (no handshake in time, heartbeats missed) or was revoked elsewhere."""
        ticks = 0
        while True:
            await asyncio.sleep(1.0)
            ticks += 1
            if self.node_id and ticks % REVOCATION_CHECK_S == 0 and _layer_is_process_local(self.channel_layer):
                # The in-memory layer cannot carry a revocation made in another process (`manage.py fleet_token
                # --revoke` on the embedded default), so such a head looks the link's token and key up itself.
                refusal = await database_sync_to_async(services.link_refusal)(
                    token=self.token, public_key=self.node_key)
                if refusal is not None:
                    await self._refuse(refusal.code, refusal.reason)
                    return
            quiet = time.monotonic() - self.last_frame
            # Each handshake stage has its own short deadline, frames or not: a slot is held only that long
            if self.channel_ is None and time.monotonic() - self.stage_at > settings.FLEET_HANDSHAKE_STAGE_S:
                await self._refuse(CloseCode.PROTOCOL, "no handshake in time")
                return
            if self.channel_ is not None and quiet > settings.FLEET_NODE_TIMEOUT_S:
                log.warning("fleet node %r missed its heartbeats for %.0f s", self.identity, quiet)
                await self.close(code=1001)
                return

    async def disconnect(self, code: int) -> None:
        self._handshake_over()
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.token is not None and self.channel_ is not None:
            with contextlib.suppress(*REDIS_AWAY):  # a group's membership expires by itself
                await self.channel_layer.group_discard(token_group(self.token.public_id), self.channel_name)
        if not self.node_id:
            return
        reg = registry()
        if reg.links.get(self.node_id) is self:
            del reg.links[self.node_id]
            if not await _node_down(reg, self.node_id):  # its last link, fleet-wide
                await database_sync_to_async(services.node_mark_offline)(node_id=self.node_id)
            await database_sync_to_async(services.link_event_record)(
                kind=LinkEvent.Kind.DROPPED, node_id=self.node_id, identity=self.identity, peer=self.peer or "",
                code=code, detail=f"{len(self.running)} generation(s) running there")
            metrics.link_dropped(node=self.identity)
            if self.said_bye:
                log.info("fleet node %r left (it said goodbye); %d generation(s) running there", self.identity,
                         len(self.running))
            else:
                log.warning("fleet node %r lost (link closed, code %s); %d generation(s) running there",
                            self.identity, code, len(self.running))
            fleet_changed()
        for gen_id in list(self.running):
            if not reg.relay_push(gen_id, NodeLost(self.node_id, f"link closed (code {code})"), node_id=self.node_id):
                # its dispatcher is gone (its client left; the cancel found no node): the lane is freed here, as the
                # node's other links keep it in placement
                await reg.lifecycle.aended(self.node_id, gen_id)
        self.running.clear()
        for fut in self.pending_ops.values():
            if not fut.done():
                fut.set_exception(LinkClosed("the node link closed"))
        with contextlib.suppress(*REDIS_AWAY):
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
            await self._generation_ended(gen_id)
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

    # --- channel-layer events (control only: no generation crosses between head processes) ---
    async def link_close(self, event: dict) -> None:
        """The operator revoked this link's token or node key (in any head process): close it now."""
        await self._refuse(event["code"], event["reason"])

    async def node_deploy(self, event: dict) -> None:
        """A deployment changed, or another node now serves a model this one keeps for it: send the list again."""
        if self.node_id and not self.closing:
            await link_deploy.send_deployments(self)

    async def node_hold(self, event: dict) -> None:
        self.held = not event["schedulable"]
        await self._apply_schedulable()

    async def _apply_schedulable(self) -> None:
        """Placement sends work here only while the operator does not hold the node and its engine is up."""
        await registry().aplacement.set_schedulable(self.node_id, self._placeable())
        registry().lanes.notify()
        fleet_changed()

    def _placeable(self) -> bool:
        """Not held by the operator, its engine up, and the head holds each of its tokenizers (to key prompts)."""
        return not self.held and self.engine_ready and not self.tokenizers_due

