"""A node link's session on the head, from the node's hello to serving and to the link's end.

The handshake (nodes.handshakes), registration (the identity must be bound to the node's key), heartbeats, the
watchdog (handshake deadlines, missed heartbeats, revocations) and the lost link. The database is written only on
transitions: join, rejoin, lost. A registered session is the node's fleet.links.LinkHandle. Its collaborators are
each given what they send through: the generations on the link (nodes.link_generations), the tokenizer files
(nodes.link_tokenizers) and the deployments (nodes.link_deploy). The transport (nodes.consumers) carries the frames;
the router (nodes.link_router) hands the session the node's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from enum import StrEnum
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.db import DatabaseError, IntegrityError

from fleet import heads, metrics
from fleet.links import registry
from fleet.live import fleet_changed
from fleet.names import liveness_key, node_group, token_group
from nodes import link_answers, preparing, services
from nodes.handshakes import LinkHandshake
from nodes.link.channel import SecureChannel
from nodes.link.codes import CloseCode
from nodes.link.device import DeviceReport
from nodes.link.messages import (
    Bye,
    Check,
    Cut,
    Feature,
    Heads,
    Heartbeat,
    LinkError,
    Models,
    ModelState,
    Preparing,
    Pull,
    Register,
    Registered,
    TokenizerFile,
)
from nodes.link.placement import NodeSlot
from nodes.link.spec import spec_for_node
from nodes.link_checks import heartbeat_problem, model_files, register_problem
from nodes.link_deploy import LinkDeploy
from nodes.link_down import REDIS_AWAY, node_down
from nodes.link_generations import LinkGenerations
from nodes.link_tokenizers import LinkTokenizers
from nodes.link_transport import LinkTransport
from nodes.link_watchdog import LinkWatchdog
from nodes.models import LinkEvent
from sessions import cuts

log = logging.getLogger("fleet")

TOUCH_EVERY_S = 30
TOKENS_HISTORY_S = 600  # the fleet page's tokens/s chart: this much of each node's heartbeats, kept with them


class Stage(StrEnum):
    HELLO = "hello"  # frame 1 due
    PROOF = "proof"  # frame 3 due
    OPEN = "open"  # the channel is open: a register, check, pull or preparing is due
    JOINED = "joined"  # registered: the node serves


class LinkSession:
    """One node's link, hello to serving; implements fleet.links.LinkHandle for the dispatcher once registered."""

    def __init__(self, link: LinkTransport) -> None:
        self.link, self.send = link, link.send_sealed
        self.node_id = ""
        self.identity = ""
        self.handshake = LinkHandshake(link.peer, link.scope, link.send_frame)
        self.generations = LinkGenerations(self, self.send)
        self.tokenizers = LinkTokenizers()
        self.deploy: LinkDeploy | None = None  # once registered
        self.held = False  # drained or cordoned by the operator
        self.engine_ready = True  # the node's engine worker is up (heartbeats say so)
        self.heads_sent: list[str] | None = None  # the live heads last told to a node that takes `heads`
        self.features: frozenset[str] = frozenset()  # what the node takes beyond protocol 1 (its register's)
        self.tokens_history: deque = deque(maxlen=TOKENS_HISTORY_S // max(settings.FLEET_HEARTBEAT_S, 1) + 1)
        self.last_touch = 0.0
        self.said_bye = False
        self.watchdog = LinkWatchdog(self, self.handshake, link)

    @property
    def stage(self) -> Stage:
        if self.node_id:
            return Stage.JOINED
        if self.handshake.done:
            return Stage.OPEN
        return Stage.HELLO if self.handshake.responder is None else Stage.PROOF

    def begin(self) -> bool:
        """A handshake slot for the accepted link; False when none is free (then it is refused as busy)."""
        return self.handshake.begin()

    def watch(self) -> None:
        self.watchdog.start()

    async def step(self, frame: bytes) -> SecureChannel | None:
        """A handshake frame; the open channel after the last."""
        return await self.handshake.step(frame)

    async def opened(self) -> None:
        """The channel is open: the token's revocations reach this link from now (its group)."""
        if self.handshake.token is not None:
            await self.link.join(token_group(self.handshake.token.public_id))

    def busy(self) -> bool:
        """Linked in placement from here, or running generations here: the link's end has work to do."""
        return bool(self.node_id) and (registry().links.get(self.node_id) is self or bool(self.generations.running))

    # --- LinkHandle, used by fleet.dispatch ---
    async def send_generate(self, gen_id: str, spec: dict[str, Any]) -> None:
        spec, dropped = spec_for_node(spec, self.features)  # an older node would drop them unread
        if dropped:
            log.info("generation %s: node %r does not take %s; it runs without", gen_id, self.identity,
                     ", ".join(dropped))
        await self.generations.start(gen_id, spec)

    async def send_cancel(self, gen_id: str, reason: str) -> None:
        await self.generations.cancel(gen_id, reason)

    async def state_op(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await self.generations.state_op(op, args, timeout)

    async def close(self, code: int | None = None, reason: str | None = None) -> None:
        await self.link.close(code=code, reason=reason)

    # --- the node's messages (nodes.link_router) ---
    async def on_register(self, msg: Register) -> None:
        if problem := register_problem(msg):
            raise LinkError(f"register: {problem}")
        register = database_sync_to_async(services.node_register)
        fields = dict(
            identity=msg.identity, public_key=self.handshake.node_key, address=self.link.peer or "",
            token=self.handshake.token, models=[m["name"] for m in msg.models], lanes=msg.lanes,
            context_window=msg.context_window, capabilities=msg.capabilities,
            engine=f"{msg.engine} {msg.engine_version}".strip(), version=msg.version, labels=msg.labels,
            replicas=msg.replicas, tokenizers=msg.tokenizers, files=model_files(msg.models),
            device=DeviceReport.from_wire(msg.device).to_wire() if msg.device else {},
        )
        try:
            reg = await register(**fields)
        except IntegrityError:  # two first joins under one new identity raced; the second now sees the first's row
            reg = await register(**fields)
        node = reg.node
        self.node_id, self.identity = str(node.id), node.identity
        self.link.budget_lanes(msg.lanes)
        self.deploy = LinkDeploy(self.node_id, self.identity, dict(zip(fields["models"], reg.model_names,
                                                                        strict=False)), self.send)
        registry_ = registry()
        old = registry_.links.get(self.node_id)
        if old is not None and old is not self:
            await old.close(code=1000)  # a rejoin while the old link had not noticed it was gone
        # Registered goes out before the node is placeable: a generation placed in between went out first, and the
        # node, waiting for Registered, dropped the link ("expected registered, got Generate") at every rejoin. Its
        # slot (what it serves and holds) is in placement before, unschedulable until Registered has gone.
        wanted = await self.tokenizers.joined(reg.tokenizers)
        await registry_.aplacement.node_up(
            NodeSlot(self.node_id, node.identity, list(reg.model_names), msg.lanes, msg.context_window,
                     schedulable=False,
                     capabilities=sorted(k for k, v in (msg.capabilities or {}).items() if v is True),
                     tokenizers=dict(reg.tokenizers)),
            cache_cleared=msg.cache_cleared, head=heads.PROCESS_ID, warm=msg.warm,
        )
        self.features = frozenset(msg.features)
        if Feature.HEADS in msg.features:
            self.heads_sent = await asyncio.to_thread(registry().heads.heads_live)
        await self.send(Registered(node_id=self.node_id, model_names=reg.model_names,
                                   heartbeat_s=float(settings.FLEET_HEARTBEAT_S), warnings=reg.warnings,
                                   tokenizers_wanted=wanted, features=[Feature.BUNDLE.value, Feature.CUT.value],
                                   head=registry().heads.link_url(), heads=self.heads_sent or []))
        registry_.links[self.node_id] = self
        self.held, self.engine_ready = not node.schedulable, True
        await registry_.aplacement.set_schedulable(self.node_id, self._placeable())
        await self.link.join(node_group(self.node_id))
        verb = "rejoined" if reg.rejoin else "joined"
        log.info("fleet node %r %s from %s: %s, context window %d tokens, %d lanes", node.identity, verb,
                 self.link.peer, ", ".join(reg.model_names) or "no model", msg.context_window, msg.lanes)
        for warning in reg.warnings:
            log.warning("fleet node %r: %s", node.identity, warning)
        registry_.lanes.notify()
        await preparing.node_preparing_forget(node.identity)
        fleet_changed()
        await self.deploy.forget_gone(reg.model_names)
        await self.deploy.send_deployments(joined=True)

    async def on_heartbeat(self, msg: Heartbeat) -> None:
        if not self.node_id:
            raise LinkError("heartbeat before register")
        if problem := heartbeat_problem(msg):
            raise LinkError(f"heartbeat: {problem}")
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
        stats = _beat_stats(msg, now_s, list(self.tokens_history), self.deploy.fleet_figures(msg.models))
        await database_sync_to_async(cache.set)(liveness_key(self.node_id), stats, settings.FLEET_NODE_TIMEOUT_S)
        await self.deploy.check_idle(stats["models"])
        fleet_changed()
        if self.heads_sent is not None and (live := registry().heads.heads_live()) != self.heads_sent:
            self.heads_sent = live
            await self.send(Heads(heads=live))  # a head process started or died: the node dials the new ones
        now = time.monotonic()
        if now - self.last_touch > TOUCH_EVERY_S:
            self.last_touch = now
            try:
                await database_sync_to_async(services.node_touch)(node_id=self.node_id)
            except DatabaseError as exc:  # the database away: a bookkeeping stamp, never the link's end
                log.warning("fleet node %r: could not mark it seen in the database: %s", self.identity, exc)

    async def on_models(self, msg: Models) -> None:
        await self.deploy.on_models(msg)
        await self.tokenizers.on_models(self.node_id, msg)

    async def on_model_state(self, msg: ModelState) -> None:
        await self.deploy.on_model_state(msg)

    async def on_tokenizer_file(self, msg: TokenizerFile) -> None:
        if await self.tokenizers.on_file(msg, self.identity):
            await self._apply_schedulable()  # every asked-for file is in: the node takes generations

    async def on_check(self, msg: Check) -> None:
        await link_answers.key_check(msg, self.handshake.node_key)
        await self.close(code=int(CloseCode.NORMAL))

    async def on_pull(self, msg: Pull) -> None:
        await self.send(await link_answers.pull_grant(msg, self.handshake.node_key, self.link.peer))
        await self.close(code=int(CloseCode.NORMAL))

    async def on_preparing(self, msg: Preparing) -> None:
        await preparing.on_preparing(msg, node_key=self.handshake.node_key, address=self.link.peer or "")
        await self.close(code=int(CloseCode.NORMAL))

    async def on_cut(self, msg: Cut) -> None:
        cuts.reported(node_id=self.node_id, node=self.identity, cut=msg)

    async def on_bye(self, msg: Bye) -> None:
        self.said_bye = True  # stopped on purpose: logged as left, not lost
        await self.close(code=1000)

    # --- the operator, through the channel layer ---
    async def hold(self, schedulable: bool) -> None:
        self.held = not schedulable
        await self._apply_schedulable()

    async def redeploy(self) -> None:
        """A deployment changed, or another node now serves a model this one keeps for it: send the list again."""
        if self.node_id:
            await self.deploy.send_deployments()

    async def _apply_schedulable(self) -> None:
        """Placement sends work here only while the operator does not hold the node and its engine is up."""
        await registry().aplacement.set_schedulable(self.node_id, self._placeable())
        registry().lanes.notify()
        fleet_changed()

    def _placeable(self) -> bool:
        """Not held by the operator, its engine up, and the head holds each of its tokenizers (to key prompts)."""
        return not self.held and self.engine_ready and not self.tokenizers.due

    # --- the end ---
    async def lost(self, code: int) -> None:
        """The link closed: out of placement, the node offline if this was its last link, its generations told."""
        self.handshake.over()
        self.watchdog.stop()
        if self.handshake.token is not None and self.handshake.done:
            with contextlib.suppress(*REDIS_AWAY):  # a group's membership expires by itself
                await self.link.leave(token_group(self.handshake.token.public_id))
        if not self.node_id:
            return
        reg = registry()
        if reg.links.get(self.node_id) is self:
            del reg.links[self.node_id]
            if not await node_down(reg, self.node_id):  # its last link, fleet-wide
                await database_sync_to_async(services.node_mark_offline)(node_id=self.node_id)
            running = len(self.generations.running)
            await database_sync_to_async(services.link_event_record)(
                kind=LinkEvent.Kind.DROPPED, node_id=self.node_id, identity=self.identity,
                peer=self.link.peer or "", code=code, detail=f"{running} generation(s) running there")
            metrics.link_dropped(node=self.identity)
            if self.said_bye:
                log.info("fleet node %r left (it said goodbye); %d generation(s) running there", self.identity,
                         running)
            else:
                log.warning("fleet node %r lost (link closed, code %s); %d generation(s) running there",
                            self.identity, code, running)
            fleet_changed()
        await self.generations.lost(code)
        with contextlib.suppress(*REDIS_AWAY):
            await self.link.leave(node_group(self.node_id))
        reg.lanes.notify()


def _beat_stats(msg: Heartbeat, now_s: float, history: list, figures: dict) -> dict:
    """What the cache keeps of a node's last heartbeat (its liveness; the fleet page's and the API's figures)."""
    stats = {"lanes_busy": msg.lanes_busy, "lanes": msg.lanes, "kv_used": msg.kv_used, "kv_total": msg.kv_total,
             "tokens_per_s": msg.tokens_per_s, "replicas": msg.replicas, "at": now_s,
             "prefill_tps": msg.prefill_tps, "decode_slowdown_ms": msg.decode_slowdown_ms,
             "history": history, "models": figures}
    stats.update(memory_free=msg.memory_free, on_demand=msg.on_demand)  # room for on-demand models
    if msg.device:  # its GPUs' memory now (an older node sends none: the registered report stands)
        stats["device"] = DeviceReport.from_wire(msg.device).to_wire()
    return stats
